"""The server's view of adapters: validate on first sight (so bad ones get a 400), prefetch, evict."""

import asyncio
import itertools
from pathlib import Path

import adapters
from engine.adapter_pool import read_adapter
from engine.llm_engine import LLMEngine
from engine.server.engine_loop import Conflict, EngineLoop
from engine.server.protocol import AdapterRef, BadRequest

TIERS = ("host", "gpu")


class NotFound(LookupError):
    """Nothing by that name here (404)."""


class AdapterRegistry:
    def __init__(self, loop: EngineLoop, *, store: Path | None) -> None:
        self.loop = loop
        self.store = store
        self.known: dict[str, Path] = {}  # digest -> path, validated and registered with the engine
        self._pending: dict[str, asyncio.Task] = {}

    def locate(self, ref: AdapterRef) -> Path:
        if ref.path is not None:
            return Path(ref.path)
        if self.store is None:
            raise BadRequest(f"adapter {ref.digest} has no path and this engine has no --adapter-store",
                             param="adapter.path")
        return self.store / ref.digest

    async def ensure(self, ref: AdapterRef) -> None:
        """Make the adapter usable by requests: read and checked once, then known by its digest."""
        if ref.digest in self.known:
            return
        task = self._pending.get(ref.digest)
        if task is None:
            task = asyncio.create_task(self._load(ref))
            self._pending[ref.digest] = task
            task.add_done_callback(lambda _: self._pending.pop(ref.digest, None))
        await asyncio.shield(task)

    async def _load(self, ref: AdapterRef) -> None:
        path = self.locate(ref)
        if not path.exists():
            raise BadRequest(f"adapter {ref.digest} not found at {path}", param="adapter.path")
        engine = self.loop.engine
        try:
            adapter = await asyncio.to_thread(read_adapter, path, engine.hf_config, engine.config.max_adapter_rank)
        except adapters.AdapterError as error:
            raise BadRequest(f"adapter {ref.digest} is unusable ({error.code}): {error}", param="adapter") from error
        if adapter.digest != ref.digest:
            raise BadRequest(f"adapter at {path} has digest {adapter.digest}, not {ref.digest}", param="adapter.digest")

        def register(engine: LLMEngine) -> None:
            try:
                engine.adapter_pool.add_loaded(adapter, path)
            except adapters.AdapterError as error:
                raise BadRequest(f"adapter {ref.digest} is unusable ({error.code}): {error}",
                                 param="adapter") from error

        await self.loop.call(register)
        self.known[ref.digest] = path

    async def prefetch(self, ref: AdapterRef, *, tier: str) -> list[str]:
        """Warm an adapter into the host cache, or on into a GPU slot; returns the tiers it is in."""
        if tier not in TIERS:
            raise BadRequest(f"tier must be one of {TIERS}", param="tier")
        await self.ensure(ref)

        def warm(engine: LLMEngine) -> list[str]:
            pool = engine.adapter_pool
            if tier == "gpu" and ref.digest not in pool.slots:
                in_use = engine.scheduler.running_adapters()
                if len(pool.slots) >= pool.num_slots and all(d in in_use for d in pool.slots):
                    raise Conflict("every GPU adapter slot is used by running requests")
                pool.activate({ref.digest}, in_use)
            return resident_tiers(engine, ref.digest)

        return await self.loop.call(warm)

    async def evict(self, digest: str) -> list[str]:
        """Drop an adapter from GPU slots and the host cache if no request uses it; returns the tiers left."""

        def drop(engine: LLMEngine) -> list[str]:
            pool = engine.adapter_pool
            if not pool.is_registered(digest):
                raise NotFound(f"adapter {digest} is not known to this engine")
            scheduler = engine.scheduler
            users = [s for s in itertools.chain(scheduler.running, scheduler.waiting) if s.adapter == digest]
            if users:
                raise Conflict(f"adapter {digest} is in use by {len(users)} sequence(s)")
            evicted = resident_tiers(engine, digest)
            if digest in pool.slots:
                pool.free_slots.append(pool.slots.pop(digest))
            pool.host.pop(digest, None)
            return evicted

        evicted = await self.loop.call(drop)
        self.known.pop(digest, None)
        return evicted


def resident_tiers(engine: LLMEngine, digest: str) -> list[str]:
    pool = engine.adapter_pool
    return [tier for tier, present in (("gpu", digest in pool.slots), ("host", digest in pool.host)) if present]
