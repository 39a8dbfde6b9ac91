"""The server's view of adapters: read and checked on first sight (off the engine thread), prefetch, evict.

An adapter the engine cannot read (missing, corrupt, wrong shape for the base, over the rank limit, any
loader exception) is `AdapterUnavailable`: a 503 for that request alone, with a message that names the
adapter and never a server path; the engine stays healthy.
"""

import asyncio
import time
from pathlib import Path

from engine.adapter_pool import failure_reason, read_adapter
from engine.llm_engine import LLMEngine
from engine.server.engine_loop import API_TIER, Conflict, EngineLoop
from engine.server.protocol import AdapterRef, BadRequest

TIERS = {"host": "host", "gpu": "device"}  # API name -> the pool's


class NotFound(LookupError):
    """Nothing by that name here (404)."""


class AdapterUnavailable(Exception):
    """The adapter could not be loaded (503, error type "adapter_unavailable")."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"adapter {digest[:12]} could not be loaded: {reason}")


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

    async def ensure(self, ref: AdapterRef) -> float:
        """Make the adapter usable by requests: read and checked once, then known by its digest. Returns the
        seconds this call waited for it (0 when it was known)."""
        if ref.digest in self.known:
            return 0.0
        started = time.monotonic()
        task = self._pending.get(ref.digest)
        if task is None:
            task = asyncio.create_task(self._load(ref))
            self._pending[ref.digest] = task
            task.add_done_callback(lambda _: self._pending.pop(ref.digest, None))
        await asyncio.shield(task)
        return time.monotonic() - started

    async def _load(self, ref: AdapterRef) -> None:
        path = self.locate(ref)
        engine = self.loop.engine

        def read():
            adapter = read_adapter(path, engine.hf_config, engine.config.max_adapter_rank, digest=ref.digest)
            if adapter.digest != ref.digest:
                raise ValueError(f"its content has digest {adapter.digest[:12]}")
            return engine.adapter_pool.prepare(adapter)

        started = time.perf_counter()
        try:
            prepared = await asyncio.to_thread(read)
        except ValueError as error:
            raise AdapterUnavailable(ref.digest, str(error)) from error
        except Exception as error:  # every loader failure is this adapter's alone
            raise AdapterUnavailable(ref.digest, failure_reason(error)) from error
        seconds = time.perf_counter() - started
        await self.loop.call(lambda engine: engine.adapter_pool.add_loaded(prepared, path, seconds=seconds))
        self.known[ref.digest] = path

    async def prefetch(self, ref: AdapterRef, *, tier: str) -> list[str]:
        """Warm an adapter into the host cache, or on into device pages; returns the tiers it is in."""
        if tier not in TIERS:
            raise BadRequest(f"tier must be one of {tuple(TIERS)}", param="tier")
        await self.ensure(ref)

        def warm(engine: LLMEngine) -> list[str]:
            try:
                return [API_TIER[t] for t in engine.prefetch_adapter(ref.digest, TIERS[tier])]
            except RuntimeError as error:
                raise Conflict(str(error)) from error

        return await self.loop.call(warm)

    async def evict(self, digest: str) -> list[str]:
        """Drop an adapter from device pages and the host cache if no request uses it; returns the tiers left."""

        def drop(engine: LLMEngine) -> list[str]:
            if not engine.adapter_pool.is_registered(digest):
                raise NotFound(f"adapter {digest} is not known to this engine")
            try:
                return [API_TIER[t] for t in engine.evict_adapter(digest)]
            except RuntimeError as error:
                raise Conflict(str(error)) from error

        evicted = await self.loop.call(drop)
        self.known.pop(digest, None)
        return evicted
