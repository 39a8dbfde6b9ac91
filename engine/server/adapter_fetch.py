"""Downloads of adapters through the short-lived signed URLs the gateway hands with a request (remote storage:
S3 or any store that signs GET URLs), into the engine's disk cache.

Runs on the server's event loop, never on the engine thread: requests for adapters in memory keep stepping while
one downloads. A download is bounded in time (`timeout_s`, the whole of it) and in bytes (each answer's announced
length, reserved in the cache before a byte is written, and no byte past it). It checks nothing of the content:
the registry reads the staged files and checks the digest and the sidecar's checksums before they enter the
cache. Any failure is a `DownloadFailed` whose message names no URL (they carry signatures).
"""

import asyncio
import shutil
from pathlib import Path

import httpx

from engine.server.adapter_disk_cache import AdapterDiskCache, CacheFull

CHUNK_BYTES = 1 << 20


class DownloadFailed(Exception):
    """The blob could not be downloaded; the message is for the tenant."""


class AdapterFetcher:
    def __init__(self, cache: AdapterDiskCache, *, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("the adapter download timeout must be > 0 seconds")
        self.cache = cache
        self.timeout_s = timeout_s
        self.downloads = {"ok": 0, "failed": 0}  # finished downloads by outcome (the metrics read them)
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made on the event loop that uses it
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), follow_redirects=False)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def download(self, urls: dict[str, str]) -> tuple[Path, int]:
        """Every file of `urls` (file name -> URL) into a fresh staging folder of the cache; returns the folder
        and the bytes reserved for it (the caller commits or discards both)."""
        try:
            staged = self.cache.staging()
        except OSError as error:
            self.downloads["failed"] += 1
            raise DownloadFailed(f"its download could not be written ({error.strerror or 'disk error'})") from error
        reserved = 0
        try:
            async with asyncio.timeout(self.timeout_s):
                for name, url in urls.items():
                    reserved += await self._file(url, staged / name)
        except BaseException as error:
            self.cache.release(reserved)
            discard_staged(staged)
            self.downloads["failed"] += 1
            if isinstance(error, TimeoutError):
                raise DownloadFailed(f"its download took longer than {self.timeout_s:g} s") from error
            if isinstance(error, httpx.HTTPError | httpx.InvalidURL):
                raise DownloadFailed(f"its download failed ({type(error).__name__})") from error
            if isinstance(error, OSError):  # the cache's disk: full, or not writable
                raise DownloadFailed(f"its download could not be written ({error.strerror or 'disk error'})") from error
            raise
        self.downloads["ok"] += 1
        return staged, reserved

    async def _file(self, url: str, out: Path) -> int:
        """One file; returns the bytes reserved for it (its length)."""
        async with self.client().stream("GET", url) as response:
            if response.status_code != 200:
                raise DownloadFailed(f"its download was answered HTTP {response.status_code}")
            try:
                length = int(response.headers["content-length"])
            except (KeyError, ValueError):
                raise DownloadFailed("its download announced no length") from None
            try:
                self.cache.reserve(length)
            except CacheFull as error:
                raise DownloadFailed(str(error)) from None
            written = 0
            try:
                with open(out, "wb") as handle:
                    async for chunk in response.aiter_raw(CHUNK_BYTES):
                        written += len(chunk)
                        if written > length:
                            raise DownloadFailed("its download sent more bytes than it announced")
                        handle.write(chunk)
                if written != length:
                    raise DownloadFailed(f"its download ended after {written} of {length} bytes")
            except BaseException:
                self.cache.release(length)
                raise
            return length


def discard_staged(staged: Path) -> None:
    shutil.rmtree(staged, ignore_errors=True)
