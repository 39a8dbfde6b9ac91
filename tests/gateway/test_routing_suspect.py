"""An engine that failed here is skipped for a few seconds (`Router.suspect`), but not past its leaving routing: one
that drained or whose heartbeats lapsed and then joined again is a new life, routed at once. A rolling restart of
two engines otherwise found the first one still suspect when the second drained (test_fleet's 'no engine' 503s)."""

from gateway import routing
from gateway.models import Engine
from tests.engine_states import engine_state_json


def _rows(*names: str) -> list[Engine]:
    return [Engine(name=name, url=f"http://{name}:8100", state=engine_state_json()) for name in names]  # unsaved


def _snapshot(router: routing.Router, monkeypatch, *names: str) -> None:
    monkeypatch.setattr(routing, "routable_engines", lambda: _rows(*names))
    router.load_snapshot()


def _routed(router: routing.Router) -> str | None:
    route = router.route(digest=None, min_uncached_tokens=0)
    return None if route is None else route.engine.name


def test_a_suspect_engine_still_in_routing_stays_skipped(monkeypatch):
    router = routing.Router()
    _snapshot(router, monkeypatch, "a")
    router.suspect("a")
    _snapshot(router, monkeypatch, "a")
    assert _routed(router) is None


def test_an_engine_that_left_routing_and_rejoined_is_not_suspect(monkeypatch):
    router = routing.Router()
    _snapshot(router, monkeypatch, "a", "b")
    router.suspect("a")  # it failed a request here while draining
    _snapshot(router, monkeypatch, "b")  # out of routing: restarting
    _snapshot(router, monkeypatch, "a", "b")  # joined again
    router.suspect("b")  # the second engine of the rolling restart drains in turn
    assert _routed(router) == "a"
