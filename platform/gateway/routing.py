"""Choosing an engine: one where the adapter is resident, else the adapter's rendezvous-hash favourite (so each
adapter warms on few engines), else the least loaded. Engines come from the database, refreshed once a second
per process; an engine that just failed here is skipped for a few seconds before the health check notices."""

import hashlib
import time

from engine.contract import state_load, state_resident_digests
from gateway.engine_client import EngineRef
from gateway.models import Engine

SNAPSHOT_SECONDS = 1.0
SUSPECT_SECONDS = 5.0


resident_digests = state_resident_digests  # the contract's reading of /v1/state
engine_load = state_load


class Router:
    """Per-process routing state: the engine snapshot, engines that just failed, requests in flight."""

    def __init__(self) -> None:
        self._engines: list[EngineRef] = []
        self._loaded_at = -SNAPSHOT_SECONDS
        self._suspect_until: dict[str, float] = {}
        self._in_flight: dict[str, int] = {}
        self._served: dict[str, set[str]] = {}  # engine name -> digests it served since the last snapshot

    def snapshot_stale(self) -> bool:
        return time.monotonic() - self._loaded_at >= SNAPSHOT_SECONDS

    def load_snapshot(self) -> None:
        """Reads the engines (a blocking database read: call it through sync_to_async)."""
        rows = Engine.objects.filter(enabled=True, healthy=True).order_by("name")
        self._engines = [
            EngineRef(
                name=row.name, url=row.url.rstrip("/"), token=row.token, pool=row.pool,
                gpu_price_per_hour=str(row.gpu_price_per_hour), resident=resident_digests(row.state),
                load=engine_load(row.state),
            )
            for row in rows
        ]  # fmt: skip
        self._loaded_at = time.monotonic()

    def has_snapshot(self) -> bool:
        return self._loaded_at >= 0

    def keep_snapshot(self) -> None:
        """Use the engines last read for another interval (the database could not be read)."""
        self._loaded_at = time.monotonic()

    def candidates(self, *, digest: str | None, exclude: frozenset[str] = frozenset()) -> list[EngineRef]:
        now = time.monotonic()
        usable = [
            e for e in self._engines if e.name not in exclude and self._suspect_until.get(e.name, 0.0) <= now
        ]
        if not usable:
            return []

        def load(engine: EngineRef) -> int:
            return engine.load + self._in_flight.get(engine.name, 0)

        if digest is None:
            return sorted(usable, key=load)
        resident = [e for e in usable if digest in e.resident or digest in self._served.get(e.name, ())]
        others = [e for e in usable if e not in resident]
        others.sort(key=lambda e: hashlib.sha256(f"{digest}:{e.name}".encode()).digest(), reverse=True)
        return sorted(resident, key=load) + others

    def suspect(self, name: str) -> None:
        self._suspect_until[name] = time.monotonic() + SUSPECT_SECONDS

    def started(self, engine: EngineRef, digest: str | None) -> None:
        self._in_flight[engine.name] = self._in_flight.get(engine.name, 0) + 1
        if digest is not None:
            self._served.setdefault(engine.name, set()).add(digest)

    def ended(self, engine: EngineRef) -> None:
        self._in_flight[engine.name] = max(0, self._in_flight.get(engine.name, 0) - 1)


router = Router()
