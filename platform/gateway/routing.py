"""Choosing an engine, per gateway process: the engines come from the database (static ones while healthy,
self-registered ones while their heartbeats keep coming), re-read once a second; each decision is
`route_score.choose` (docs/routing.md) over that snapshot, with each engine's load estimated from its heartbeat and
this process's live count of requests in flight there (`route_score.Loads`). An engine that just failed here is
skipped for a few seconds, or until it leaves routing (a drain, lapsed heartbeats): when it joins again it is a new
life.
On a fleet with prefill and decode roles, `route` may add a prefill engine (`route_score.choose_route`)."""

import logging
import time
from collections.abc import Sequence
from typing import NamedTuple

from asgiref.sync import sync_to_async

from gateway.connections import DATABASE_DOWN, checked_connection
from gateway.engine_client import EngineRef
from gateway.models import Engine
from gateway.route_score import Fleet, Loads, candidate_from_state, choose, choose_route

log = logging.getLogger(__name__)

SNAPSHOT_SECONDS = 1.0
SUSPECT_SECONDS = 5.0


def routable_engines():
    """Engines to route to: enabled and up (models.engine_up: the rule the console shows too)."""
    return Engine.objects.up().filter(enabled=True).order_by("name")


class Route(NamedTuple):
    """The engine that serves a request, and the one that computes its prompt's KV first (or None); `reason` is
    route_score.Route's. A named tuple: made on every request, five times cheaper than a frozen dataclass."""

    engine: EngineRef
    prefill: EngineRef | None
    reason: str
    uncached_tokens: int = 0


class Router:
    """Per-process routing state: the engine snapshot, engines that just failed, requests in flight."""

    def __init__(self) -> None:
        self._engines: list[EngineRef] = []
        self._fleet = Fleet([])
        self._index: dict[str, int] = {}
        self._loaded_at = -SNAPSHOT_SECONDS
        self.stale_at = self._loaded_at + SNAPSHOT_SECONDS  # time.monotonic() from which `snapshot_stale()`
        self._suspect_until: dict[str, float] = {}
        self._in_flight: dict[str, int] = {}  # engine name -> requests this process sent there, not yet ended
        self._loads = Loads([], [])

    def snapshot_stale(self) -> bool:
        return time.monotonic() - self._loaded_at >= SNAPSHOT_SECONDS

    def load_snapshot(self) -> None:
        """Reads the engines (a blocking database read: call it through sync_to_async). An engine up whose state
        this side cannot read is left out (Engine.reported_state logs why)."""
        rows = [(row, state) for row in routable_engines() if (state := row.reported_state()) is not None]
        self._engines = [
            EngineRef(
                name=row.name, url=row.url.rstrip("/"), token=row.token, pool=row.pool,
                gpu_price_per_hour=str(row.gpu_price_per_hour), resident=state.resident_digests(), load=state.load,
                channel=state.channel,
            )
            for row, state in rows
        ]  # fmt: skip
        self._fleet = Fleet([candidate_from_state(row.name, state) for row, state in rows])
        self._index = {engine.name: i for i, engine in enumerate(self._engines)}
        if self._suspect_until:  # one out of routing now (drained, heartbeats lapsed) comes back as a new life
            self._suspect_until = {name: until for name, until in self._suspect_until.items() if name in self._index}
        self._loads = Loads([e.load for e in self._engines], [self._in_flight.get(e.name, 0) for e in self._engines])
        self._loaded_at = time.monotonic()
        self.stale_at = self._loaded_at + SNAPSHOT_SECONDS

    def has_snapshot(self) -> bool:
        return self._loaded_at >= 0

    def keep_snapshot(self) -> None:
        """Use the engines last read for another interval (the database could not be read)."""
        self._loaded_at = time.monotonic()
        self.stale_at = self._loaded_at + SNAPSHOT_SECONDS

    def engines(self) -> list[EngineRef]:
        return list(self._engines)

    def choose(self, *, digest: str | None, fingerprints: Sequence[str] = (),
               exclude: frozenset[str] = frozenset()) -> EngineRef | None:
        skipped = self._skipped(exclude)
        index = choose(self._fleet, adapter=digest, fingerprints=fingerprints, loads=self._loads.values,
                       step=self._loads.step, exclude=skipped)
        return None if index is None else self._engines[index]

    def route(self, *, digest: str | None, fingerprints: Sequence[str] = (), prompt_chars: int = 0,
              prompt_tokens: int = 0, min_uncached_tokens: int, disaggregate: bool = True,
              exclude: frozenset[str] = frozenset()) -> Route | None:
        skipped = self._skipped(exclude) if exclude or self._suspect_until else ()
        fleet, loads = self._fleet, self._loads
        if not fleet.split:  # every engine serves whole requests: `choose_route`'s answer is `choose`'s, colocated
            serving = choose(fleet, adapter=digest, fingerprints=fingerprints, loads=loads.values, step=loads.step,
                             exclude=skipped)  # fmt: skip
            return None if serving is None else Route(self._engines[serving], None, "colocated")
        route = choose_route(fleet, adapter=digest, fingerprints=fingerprints, loads=loads.values, step=loads.step,
                             exclude=skipped, prompt_chars=prompt_chars, prompt_tokens=prompt_tokens,
                             min_uncached_tokens=min_uncached_tokens, disaggregate=disaggregate)  # fmt: skip
        if route is None:
            return None
        prefill = None if route.prefill is None else self._engines[route.prefill]
        return Route(self._engines[route.serving], prefill, route.reason, route.uncached_tokens)

    def _skipped(self, exclude: frozenset[str]) -> list[int]:
        """The indexes of the engines excluded or suspect now; an engine whose suspicion has lapsed is forgotten."""
        now = time.monotonic()
        self._suspect_until = {name: until for name, until in self._suspect_until.items() if until > now}
        return [i for i, e in enumerate(self._engines) if e.name in exclude or e.name in self._suspect_until]

    def suspect(self, name: str) -> None:
        self._suspect_until[name] = time.monotonic() + SUSPECT_SECONDS

    def started(self, engine: EngineRef, digest: str | None, fingerprints: Sequence[str] = ()) -> None:
        name = engine.name
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        index = self._index.get(name)
        if index is not None:
            if digest is not None or fingerprints:  # else `served` has nothing to note
                self._fleet.served(index, adapter=digest, fingerprints=fingerprints)
            self._loads.started(index)

    def ended(self, engine: EngineRef) -> None:
        name = engine.name
        in_flight = self._in_flight.get(name, 0) - 1
        self._in_flight[name] = in_flight if in_flight > 0 else 0
        index = self._index.get(name)
        if index is not None and self._loads.in_flight[index] > 0:
            self._loads.ended(index)


router = Router()


async def engines_refresh() -> None:
    """Re-reads the engines once a second; while the database is away, routes on the engines last read."""
    if not router.snapshot_stale():
        return
    try:
        await _load_snapshot()
    except DATABASE_DOWN as error:
        if not router.has_snapshot():
            raise
        router.keep_snapshot()
        log.warning("engines not re-read (the database is unreachable: %s); routing on the last snapshot", error)


_load_snapshot = sync_to_async(checked_connection(router.load_snapshot), thread_sensitive=False)
