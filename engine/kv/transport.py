"""Moving KV block payloads between engines: a small framed protocol on a TCP control channel, the bytes either on
that channel (`TcpTransport`) or in shared memory on one host (`ShmTransport`).

    puller (decode engine)                         source (prefill engine, TransferServer)
    pull {lease, keys, via}            ------->     looks the lease up, serialises the asked blocks it holds
                                       <-------     blocks {via, sizes, ...}   (tcp: the bytes follow in the frame;
                                                                                shm: {segment}, a file in /dev/shm)
    done {lease}  (or release {lease}) ------->     releases the lease (its blocks go back to the prefix cache)
                                       <-------     released
    (the connection closing before `done` releases the lease too: the puller is gone or gave up)

A frame is `QKV1`, the header's length and the body's length (network order), a JSON header, the body. One lease is
pulled once. A source answers with blocks for a prefix of the asked keys (those the lease holds, in order); the
puller re-checks every key when it installs them, so the channel carries bytes and trusts nothing.

The seam for other transports (NIXL, NCCL, UCX): a `Transport` turns payloads into a descriptor on the source
(`offer`: here the bytes on the stream or a file in /dev/shm; with NIXL, the registered staging buffer's memory
descriptors) and a descriptor into payloads on the puller (`accept`: here a read; with NIXL, a one-sided read into
the puller's own registered buffer), and frees what `offer` took (`discard`). The control channel, the lease and
the failure rules stay as they are. No RDMA stub is built.

On /dev/shm a source keeps a locked marker and names the segments it offers after it (engine/kv/shm_files.py).

The channel carries bytes only (no torch): on CUDA the source fills them from page-locked staging buffers with
non-blocking copies (engine/server/kv_transfer.py), on CPU from the pool's own memory.
"""

import asyncio
import contextlib
import json
import logging
import mmap
import os
import secrets
import struct
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from engine.kv.shm_files import (
    SHM_PREFIX,
    SHM_ROOT,
    claim_marker,
    map_segment,
    reap_dead_sources,
    shm_reachable,
    write_segment,
)

log = logging.getLogger(__name__)

MAGIC = b"QKV1"
FRAME = struct.Struct("!4sIQ")  # magic, header bytes, body bytes
MAX_HEADER_BYTES = 1 << 20


class TransferError(Exception):
    """A pull that did not deliver: the peer is gone, timed out, refused the lease or broke the protocol. The
    puller recomputes; `code` says why (unknown_lease, timeout, closed, protocol, refused)."""

    def __init__(self, message: str, *, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


# frames
async def write_frame(writer: asyncio.StreamWriter, header: dict, body: Sequence[bytes | memoryview] = ()) -> None:
    encoded = json.dumps(header, separators=(",", ":")).encode()
    writer.write(FRAME.pack(MAGIC, len(encoded), sum(len(part) for part in body)) + encoded)
    for part in body:
        writer.write(part)
        await writer.drain()  # one payload at a time in the socket's buffer, not all of them
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict, int]:
    """The next header and the length of the body that follows it (unread). EOF before a frame: TransferError."""
    try:
        magic, header_bytes, body_bytes = FRAME.unpack(await reader.readexactly(FRAME.size))
    except asyncio.IncompleteReadError as error:
        raise TransferError("the peer closed the connection", code="closed") from error
    if magic != MAGIC or header_bytes > MAX_HEADER_BYTES:
        raise TransferError("not a KV transfer frame", code="protocol")
    try:
        header = json.loads(await reader.readexactly(header_bytes))
    except asyncio.IncompleteReadError as error:
        raise TransferError("the peer closed the connection mid-frame", code="closed") from error
    except ValueError as error:
        raise TransferError(f"a frame's header is not JSON: {error}", code="protocol") from error
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise TransferError("a frame's header has no op", code="protocol")
    return header, body_bytes


async def read_body(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    try:
        return await reader.readexactly(nbytes)
    except asyncio.IncompleteReadError as error:
        raise TransferError(f"the peer closed the connection after {len(error.partial)} of {nbytes} bytes",
                            code="closed") from error


def split(data: bytes | memoryview | mmap.mmap, sizes: list[int]) -> list[memoryview]:
    """Views of the payloads in one buffer (no copy: they keep the buffer alive)."""
    if not all(isinstance(n, int) and n >= 0 for n in sizes) or sum(sizes) != len(data):
        raise TransferError(f"payload sizes {sum(sizes) if all(isinstance(n, int) for n in sizes) else sizes} "
                            f"do not add up to the {len(data)} bytes received", code="protocol")
    view, out, at = memoryview(data), [], 0
    for n in sizes:
        out.append(view[at : at + n])
        at += n
    return out


def transfer_address(value: object) -> tuple[str, int] | None:
    """A lease's `transport.tcp`, "host:port", as (host, port); None when it is not one. Any host name the resolver
    may take is accepted (underscores included: Docker and Kubernetes service names have them), an IPv6 address in
    brackets; never whitespace, control characters or URL syntax."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    host, _, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or any(c not in "0123456789abcdefABCDEF:." for c in host):
            return None
    elif not host or len(host) > 253 or ":" in host or any(c.isspace() or not c.isprintable() or c in "/?#@[]\\"
                                                        for c in host):
        return None
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


# transports: where the bytes of one pull travel
class Transport(ABC):
    name: str

    @abstractmethod
    async def offer(self, payloads: list[bytes], writer: asyncio.StreamWriter) -> None:
        """Source side: send the `blocks` frame describing (and, on the stream, carrying) the payloads."""

    @abstractmethod
    async def accept(self, header: dict, body_bytes: int, reader: asyncio.StreamReader) -> list[bytes]:
        """Puller side: the payloads a `blocks` frame describes."""

    @abstractmethod
    def discard(self) -> None:
        """Source side: free what `offer` took (after `done`, or when the connection ends)."""


class TcpTransport(Transport):
    name = "tcp"

    def discard(self) -> None:  # the bytes went on the stream: nothing kept
        pass

    async def offer(self, payloads: list[bytes], writer: asyncio.StreamWriter) -> None:
        await write_frame(writer, {"op": "blocks", "via": self.name, "sizes": [len(p) for p in payloads]}, payloads)

    async def accept(self, header: dict, body_bytes: int, reader: asyncio.StreamReader) -> list[bytes]:
        return split(await read_body(reader, body_bytes), header.get("sizes") or [])


class ShmTransport(Transport):
    """The payloads in one file under /dev/shm (tmpfs: shared memory), named after the source's marker: the puller
    maps it and removes its name at once (the source removes it too once the puller is done or gone)."""

    name = "shm"

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.segment: Path | None = None

    async def offer(self, payloads: list[bytes], writer: asyncio.StreamWriter) -> None:
        self.segment = SHM_ROOT / f"{self.prefix}.{secrets.token_hex(8)}"
        await asyncio.to_thread(write_segment, self.segment, payloads)
        await write_frame(writer, {"op": "blocks", "via": self.name, "segment": self.segment.name,
                                   "sizes": [len(p) for p in payloads]})

    async def accept(self, header: dict, body_bytes: int, reader: asyncio.StreamReader) -> list[bytes]:
        name = header.get("segment")
        if not isinstance(name, str) or "/" in name or not name.startswith("quilt-kv-"):
            raise TransferError(f"bad shared-memory segment name {name!r}", code="protocol")
        try:
            data = await asyncio.to_thread(map_segment, SHM_ROOT / name)
        except (OSError, ValueError) as error:
            raise TransferError(f"shared-memory segment {name} cannot be read: {error}", code="closed") from error
        return split(data, header.get("sizes") or [])

    def discard(self) -> None:
        if self.segment is not None:
            self.segment.unlink(missing_ok=True)
            self.segment = None


# the source side
STREAM_LIMIT = 8 << 20  # bytes a connection buffers before it pauses reading (asyncio's 64 KiB pauses a lot)
LeaseBlocks = Callable[[str, list[str]], Awaitable[list[bytes]]]  # (lease id, keys) -> payloads; LeaseRefused
LeaseRelease = Callable[[str, str], Awaitable[None]]  # (lease id, reason) -> None; a second release is a no-op.
# reason: "done" (installed), "released" (the puller gave up), "closed" (the connection ended first), "drain"


class LeaseRefused(Exception):
    """The source will not serve this pull (unknown or expired lease, already pulled); its message goes back."""

    def __init__(self, message: str, *, code: str = "unknown_lease") -> None:
        super().__init__(message)
        self.code = code


class TransferServer:
    """The source engine's listener: one connection per pull. `blocks` and `release` are the lease table's."""

    def __init__(self, *, blocks: LeaseBlocks, release: LeaseRelease, host: str, port: int = 0,
                 advertise_host: str | None = None, shm: bool = True, idle_timeout_s: float = 60.0) -> None:
        self.blocks = blocks
        self.release = release
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.idle_timeout_s = idle_timeout_s
        self.shm_name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}" if shm and SHM_ROOT.is_dir() else None
        self._marker: int | None = None  # the marker's descriptor: its lock says this source is alive
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def address(self) -> dict:
        """The lease's `transport` object: {"tcp": "host:port", "shm": marker name or None}."""
        return {"tcp": f"{self.advertise_host}:{self.port}", "shm": self.shm_name}

    async def start(self) -> "TransferServer":
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=STREAM_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.shm_name is not None:
            reaped = reap_dead_sources()
            if reaped:
                log.info("removed %d files that dead sources left in %s: %s", len(reaped), SHM_ROOT, ", ".join(reaped))
            try:  # the marker: a puller that sees it shares this host's /dev/shm
                self._marker = claim_marker(self.shm_name)
            except OSError as error:
                log.warning("no shared-memory transfers (%s): TCP only", error)
                self.shm_name = None
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None
        if self.shm_name is not None:
            for path in SHM_ROOT.glob(f"{self.shm_name}*"):
                path.unlink(missing_ok=True)
        if self._marker is not None:
            os.close(self._marker)
            self._marker = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(asyncio.current_task())
        transport: Transport | None = None
        lease_id, reason = None, "closed"  # a lease pulled here ends with this reason when the connection does
        try:
            while True:
                header, body_bytes = await asyncio.wait_for(read_frame(reader), self.idle_timeout_s)
                if body_bytes:
                    raise TransferError("a request frame carries no body", code="protocol")
                op = header["op"]
                if op == "pull" and transport is None:
                    lease_id = header.get("lease")
                    keys, via = header.get("keys"), header.get("via", "tcp")
                    if not isinstance(lease_id, str) or not isinstance(keys, list) \
                            or not all(isinstance(k, str) for k in keys) or via not in ("tcp", "shm"):
                        raise TransferError("pull needs a lease id, a list of hex keys and via tcp|shm",
                                            code="protocol")
                    try:
                        payloads = await self.blocks(lease_id, keys)
                    except LeaseRefused as refused:
                        lease_id = None  # not ours to release: unknown, expired or pulled by someone else
                        await write_frame(writer, {"op": "error", "code": refused.code, "message": str(refused)})
                        return
                    transport = ShmTransport(self.shm_name) if via == "shm" and self.shm_name else TcpTransport()
                    await transport.offer(payloads, writer)
                elif op in ("done", "release") and isinstance(header.get("lease"), str) \
                        and (header["lease"] == lease_id or transport is None):
                    if op == "release":
                        log.info("lease %s released by the puller: %s", header["lease"], header.get("reason"))
                    await self.release(header["lease"], "done" if op == "done" else "released")
                    lease_id = None
                    await write_frame(writer, {"op": "released"})
                    return
                else:
                    raise TransferError(f"unexpected {op!r} frame", code="protocol")
        except (TransferError, TimeoutError, ConnectionError, asyncio.IncompleteReadError) as error:
            if lease_id is not None:
                log.info("lease %s: the transfer ended before the puller was done: %s", lease_id,
                         error or type(error).__name__)
        except asyncio.CancelledError:
            reason = "drain"
            raise
        finally:
            if transport is not None:
                transport.discard()
            if lease_id is not None:
                with contextlib.suppress(Exception):
                    await self.release(lease_id, reason)
            writer.close()
            self._connections.discard(asyncio.current_task())


# the puller side
class Pull:
    """One pull over one connection: `async with Pull(address, lease_id, timeout_s=...) as pull`, then
    `await pull.fetch(keys)` and `await pull.done()` once the blocks are installed. Leaving without `done` closes
    the connection, which releases the lease on the source."""

    def __init__(self, address: dict, lease_id: str, *, timeout_s: float, prefer_shm: bool = True) -> None:
        self.address = address
        self.lease_id = lease_id
        self.timeout_s = timeout_s
        self.via = "shm" if prefer_shm and shm_reachable(address) else "tcp"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "Pull":
        address = transfer_address(self.address.get("tcp"))
        if address is None:
            raise TransferError(f"bad transfer address {self.address.get('tcp')!r}", code="protocol")
        host, port = address
        try:
            connecting = asyncio.open_connection(host, port, limit=STREAM_LIMIT)
            self._reader, self._writer = await asyncio.wait_for(connecting, self.timeout_s)
        except TimeoutError as error:
            raise TransferError(f"no connection to {host}:{port} in {self.timeout_s:g} s", code="timeout") from error
        except OSError as error:
            raise TransferError(f"no connection to {host}:{port}: {error}", code="closed") from error
        return self

    async def __aexit__(self, *exc) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()

    async def fetch(self, keys: list[str]) -> list[bytes]:
        """Payloads for a prefix of `keys` (hex), within the timeout; TransferError otherwise."""
        return await self._timed(self._fetch(keys), "the pull")

    async def _fetch(self, keys: list[str]) -> list[bytes]:
        await write_frame(self._writer, {"op": "pull", "lease": self.lease_id, "keys": keys, "via": self.via})
        header, body_bytes = await read_frame(self._reader)
        if header["op"] == "error":
            raise TransferError(str(header.get("message")), code=str(header.get("code") or "refused"))
        if header["op"] != "blocks" or header.get("via") not in ("tcp", "shm"):
            raise TransferError(f"unexpected {header['op']!r} frame", code="protocol")
        transport = TcpTransport() if header["via"] == "tcp" else ShmTransport(str(self.address.get("shm")))
        payloads = await transport.accept(header, body_bytes, self._reader)
        if len(payloads) > len(keys):
            raise TransferError(f"{len(payloads)} blocks for {len(keys)} keys", code="protocol")
        return payloads

    async def done(self, *, reason: str | None = None) -> None:
        """Tell the source the blocks are installed (or, with a reason, given up): it releases the lease."""
        header = {"op": "done" if reason is None else "release", "lease": self.lease_id}
        if reason is not None:
            header["reason"] = reason
        await self._timed(self._exchange(header), "the release")

    async def _exchange(self, header: dict) -> None:
        await write_frame(self._writer, header)
        answer, _ = await read_frame(self._reader)
        if answer["op"] != "released":
            raise TransferError(f"unexpected {answer['op']!r} frame", code="protocol")

    async def _timed(self, work: Awaitable, what: str):
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError as error:
            raise TransferError(f"{what} took more than {self.timeout_s:g} s", code="timeout") from error
        except (ConnectionError, OSError) as error:
            raise TransferError(f"{what} failed: {error}", code="closed") from error


async def release_remote(address: dict, lease_id: str, *, reason: str, timeout_s: float = 5.0) -> bool:
    """Release a lease without pulling it (a puller that will not pull after all); whether the source answered."""
    try:
        async with Pull(address, lease_id, timeout_s=timeout_s, prefer_shm=False) as pull:
            await pull.done(reason=reason)
        return True
    except TransferError as error:
        log.warning("lease %s could not be released on %s: %s", lease_id, address.get("tcp"), error)
        return False
