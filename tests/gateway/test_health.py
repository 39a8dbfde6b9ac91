"""GET /health and /v1/health, as load balancers and guidellm ask them, without a key: 200 while the gateway reaches
PostgreSQL, Redis and a healthy engine (the package's real stack), 503 naming what failed otherwise: gateways
started against a database or a Redis that is not there, or holding a token the engine refuses, and the stack's own
gateway while its one engine is disabled."""

import contextlib

import httpx
import pytest

from tests.gateway.conftest import engine_set, free_port, launch_gateway, stop, wait_for_gateway, wait_until
from tests.gateway.v1_schema import check_answer

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def _health(base: str, path: str) -> httpx.Response:
    return httpx.get(f"{base}{path}", timeout=30)


def _root(gateway_v1: str) -> str:
    return gateway_v1.removesuffix("/v1")


@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_a_gateway_that_can_serve_is_healthy_without_a_key(stack, path):
    response = _health(_root(stack.gateways[0]), path)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "ok" and body["failed"] == []
    assert set(body["checks"]) == {"database", "redis", "engines"}
    assert all(check["ok"] for check in body["checks"].values())
    assert body["checks"]["engines"]["detail"] == "1 of 1 routable engines answer healthy."
    assert response.headers["cache-control"] == "no-store"
    check_answer("get", path, 200, body)
    assert httpx.head(f"{_root(stack.gateways[1])}{path}", timeout=30).status_code == 200
    assert httpx.post(f"{_root(stack.gateways[1])}{path}", timeout=30).status_code == 405


def _dead_url(scheme: str, path: str = "") -> str:
    return f"{scheme}://127.0.0.1:{free_port()}{path}"  # nothing listens there


@pytest.fixture(scope="module")
def broken_gateways(stack):
    """A gateway for each thing that can fail, started together: its database, its Redis, its engine token."""
    from tests.conftest import test_database_url

    database = test_database_url().rsplit("@", 1)
    environments = {
        "database": {"DATABASE_URL": f"{database[0]}@127.0.0.1:{free_port()}/{database[1].split('/', 1)[1]}"},
        "redis": {"REDIS_URL": _dead_url("redis", "/13")},
        "engines": {"QUILT_ENGINE_TOKEN": "not-the-engines-token"},
    }
    media = stack.model_dir.parent / "media"
    processes, urls = {}, {}
    try:
        for name, extra in environments.items():
            port = free_port()
            processes[name] = launch_gateway(stack.env | extra, port, media / f"health-{name}.log")
            urls[name] = f"http://127.0.0.1:{port}"
        for process in processes.values():
            wait_for_gateway(process)
        yield urls
    finally:
        for process in processes.values():
            stop(process)


@pytest.mark.parametrize(("failing", "detail"), [
    ("database", "The database is unreachable."),
    ("redis", "Redis is unreachable."),
    ("engines", "No engine answers healthy: 0 of 1 routable engines."),
])  # fmt: skip
def test_each_failure_is_a_503_naming_it(broken_gateways, failing, detail):
    for path in ("/health", "/v1/health"):
        response = _health(broken_gateways[failing], path)
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["status"] == "unavailable" and failing in body["failed"]
        assert body["checks"][failing] == {"ok": False, "detail": detail}
        if failing != "database":  # without its database a gateway knows no engine to ask either
            assert body["failed"] == [failing]
        assert "127.0.0.1" not in response.text  # no address of a store or engine
        check_answer("get", path, 503, body)


def test_a_fleet_with_no_engine_up_is_a_503(stack):
    gateway = _root(stack.gateways[0])
    engine_set("engine-a", enabled=False)
    try:
        def unhealthy():
            response = _health(gateway, "/health")
            return response if response.status_code == 503 else None

        body = wait_until(unhealthy, timeout=30, what="the gateway seeing no engine").json()
        assert body["failed"] == ["engines"]
        assert body["checks"]["engines"]["detail"] == "No engine is up: none is registered, enabled and healthy."
    finally:
        engine_set("engine-a", enabled=True)
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: _health(gateway, "/health").status_code == 200, timeout=30, what="healthy again")
