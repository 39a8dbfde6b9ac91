"""The server's view of adapters: read and checked on first sight (off the engine thread), prefetch, evict.

An adapter the engine cannot read (missing, corrupt, wrong shape for the base, over the rank limit, any
loader exception) is `AdapterUnavailable`: a 503 for that request alone, with a message that names the
adapter and never a server path; the engine stays healthy.

An adapter handed by signed URLs (remote storage) is downloaded into the disk cache when the cache lacks it: one
download per digest however many requests wait for it, on the event loop (requests for adapters in memory keep
stepping). The downloaded files are read with the digest recomputed from the tensors and the sidecar's checksums
checked; only a blob that matches the digest asked for enters the cache and serves. A failed download, or a blob
that does not match, fails the requests that waited for it, and the next request downloads again.
"""

import asyncio
import time
from pathlib import Path

from engine.adapter_pool import failure_reason, read_adapter
from engine.llm_engine import LLMEngine
from engine.server.adapter_fetch import AdapterFetcher, DownloadFailed, discard_staged
from engine.server.engine_loop import API_TIER, Conflict, EngineLoop
from engine.server.protocol import AdapterRef, BadRequest

TIERS = {"host": "host", "gpu": "device"}  # API name -> the pool's
PIN_WAIT_SECONDS = 30.0


class NotFound(LookupError):
    """Nothing by that name here (404)."""


class AdapterUnavailable(Exception):
    """The adapter could not be loaded (503, error type "adapter_unavailable")."""

    def __init__(self, digest: str, reason: str) -> None:
        super().__init__(f"adapter {digest[:12]} could not be loaded: {reason}")


class AdapterRegistry:
    def __init__(self, loop: EngineLoop, *, store: Path | None, fetcher: AdapterFetcher | None = None) -> None:
        self.loop = loop
        self.store = store
        self.fetcher = fetcher  # None: adapters handed by URL are refused
        if fetcher is not None:
            fetcher.cache.on_evict = self._forget
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
        if ref.urls is not None and self.fetcher is None:
            raise BadRequest("this engine downloads no adapters (no --adapter-disk-cache)", param="adapter.urls")
        if ref.digest in self.known and (ref.urls is None or self.fetcher.cache.get(ref.digest) is not None):
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
        if ref.urls is not None:
            return await self._fetch(ref)
        path = self.locate(ref)
        prepared, seconds = await self._read(ref.digest, path, known_digest=True)
        await self.loop.call(lambda engine: engine.adapter_pool.add_loaded(prepared, path, seconds=seconds))
        self.known[ref.digest] = path

    async def _fetch(self, ref: AdapterRef) -> None:
        """From the disk cache (its checksums checked on the read), else downloaded and checked whole."""
        cache = self.fetcher.cache
        path = cache.get(ref.digest)
        if path is not None:
            try:
                prepared, seconds = await self._read(ref.digest, path, known_digest=True)
            except AdapterUnavailable:
                cache.discard(ref.digest)  # corrupt on this disk: the next request downloads it again
                raise
        else:
            started = time.perf_counter()
            try:
                staged, reserved = await self.fetcher.download(ref.urls)
            except DownloadFailed as error:
                raise AdapterUnavailable(ref.digest, str(error)) from error
            try:
                prepared, _ = await self._read(ref.digest, staged, known_digest=False)
            except BaseException:
                cache.release(reserved)
                discard_staged(staged)
                raise
            path = cache.commit(ref.digest, staged, reserved=reserved)
            seconds = time.perf_counter() - started
        await self.loop.call(lambda engine: engine.adapter_pool.add_loaded(prepared, path, seconds=seconds))
        self.known[ref.digest] = path

    async def _read(self, digest: str, path: Path, *, known_digest: bool):
        """The adapter at `path`, read and checked off the event loop, and the seconds it took. known_digest: the
        folder is one this engine trusts to be `digest`'s (its sidecar must name it and its checksums hold);
        otherwise the digest is recomputed from the tensors."""
        engine = self.loop.engine

        def read():
            adapter = read_adapter(path, engine.hf_config, engine.config.max_adapter_rank,
                                   digest=digest if known_digest else None)
            if adapter.digest != digest:
                raise ValueError(f"its content has digest {adapter.digest[:12]}")
            return engine.adapter_pool.prepare(adapter)

        started = time.perf_counter()
        try:
            prepared = await asyncio.to_thread(read)
        except ValueError as error:
            raise AdapterUnavailable(digest, str(error)) from error
        except Exception as error:  # every loader failure is this adapter's alone
            raise AdapterUnavailable(digest, failure_reason(error)) from error
        return prepared, time.perf_counter() - started

    def unreadable(self, ref: AdapterRef | None) -> None:
        """The engine could not read a known adapter again (its host copy had gone, and the file failed its checks):
        a downloaded one leaves the disk cache, so the next request downloads it again."""
        if ref is not None and ref.urls is not None and self.fetcher is not None:
            self.fetcher.cache.discard(ref.digest)

    def _forget(self, digest: str) -> None:
        """Its files left the disk cache: the next request for it downloads them again."""
        self.known.pop(digest, None)

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

    async def pin(self, ref: AdapterRef, *, tier: str) -> list[str]:
        """Keep an adapter always warm in "host" or "gpu" (LLMEngine.pin_adapter); returns the tiers it is in.
        PinRefused (409) when the tier's pins would pass its budget. A read the engine itself started (the
        adapter had left host memory) is waited for, up to PIN_WAIT_SECONDS."""
        if tier not in TIERS:
            raise BadRequest(f"tier must be one of {tuple(TIERS)}", param="tier")
        await self.ensure(ref)

        def pin(engine: LLMEngine) -> list[str] | None:
            if engine.adapter_pool.is_loading(ref.digest):
                return None
            try:
                return [API_TIER[t] for t in engine.pin_adapter(ref.digest, TIERS[tier])]
            except RuntimeError as error:
                if engine.adapter_pool.is_loading(ref.digest):
                    return None
                raise Conflict(str(error)) from error

        deadline = time.monotonic() + PIN_WAIT_SECONDS
        while (tiers := await self.loop.call(pin)) is None:
            if time.monotonic() > deadline:
                raise Conflict(f"adapter {ref.digest[:12]} is still loading: try again")
            await asyncio.sleep(0.02)
        return tiers

    async def unpin(self, digest: str) -> str | None:
        """Let an adapter be evicted again; returns the API tier it was pinned in (None: it was not pinned)."""
        tier = await self.loop.call(lambda engine: engine.unpin_adapter(digest))
        return None if tier is None else API_TIER[tier]

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
