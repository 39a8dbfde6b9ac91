"""Moving KV blocks between engines: a small message protocol on a WebSocket control channel (aiohttp's server and
client), the bytes on that channel (`TcpTransport`), in shared memory on one host (`ShmTransport`), or written by the
source straight into the puller's registered memory over NIXL (engine/kv/nixl.py, driven from
engine/server/kv_transfer.py through `TransferServer.push` and `Pull.push`).

    puller (decode engine)                         source (prefill engine, TransferServer)
    GET {PATH}?lease={id} (WebSocket)  ------->     the connection is the lease's from here on
    pull {keys, via}                   ------->     looks the lease up, serialises the asked blocks it holds
                                       <-------     blocks {via, sizes, ...}   (tcp: one binary message per payload
                                                                                follows; shm: {segment}, a file in
                                                                                /dev/shm)
    done  (or release {reason})        ------->     releases the lease (its blocks go back to the prefix cache)
                                       <-------     released
    (the connection closing before `done` releases the lease too: the puller is gone or gave up; so does one whose
    puller left before the source, hung, could even answer its handshake)

The channel is one WebSocket per pull, at ws://{lease.transport.tcp}{PATH}?lease={id}: a header is a JSON text
message with an `op`, a payload a binary message. One lease is pulled once. A source answers with blocks for a prefix of the
asked keys (those the lease holds, in order); the puller re-checks every key when it installs them, so the channel
carries bytes and trusts nothing.

A `Transport` of framed payloads turns them into a descriptor on the source (`offer`: the bytes on the channel, or a
file in /dev/shm) and a descriptor into payloads on the puller (`accept`), and frees what `offer` took (`discard`).
NIXL moves pages, not payloads: the puller's `pull` header carries its NIXL target, and the source answers `blocks
{via: nixl, keys, sums}` once its write is complete. The control channel, the lease and the failure rules are the
same for all three.

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
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp
from aiohttp import WSMsgType, web

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

PATH = "/kv/v1/pull"  # the channel's WebSocket endpoint on the source's transfer port
MAX_HEADER_BYTES = 1 << 20
MAX_PAYLOAD_BYTES = 1 << 31  # one block's bytes: a larger message is refused
CLOSE_TIMEOUT_S = 1.0  # how long a closing side waits for the peer's close answer
Channel = web.WebSocketResponse | aiohttp.ClientWebSocketResponse  # the same send and receive on either side


class TransferError(Exception):
    """A pull that did not deliver: the peer is gone, timed out, refused the lease or broke the protocol. The
    puller recomputes; `code` says why (unknown_lease, timeout, closed, protocol, refused)."""

    def __init__(self, message: str, *, code: str = "refused") -> None:
        super().__init__(message)
        self.code = code


# messages
async def write_frame(channel: Channel, header: dict, body: Sequence[bytes | memoryview] = ()) -> None:
    """A header, then each payload as its own message (one payload at a time in the socket's buffer)."""
    await channel.send_str(json.dumps(header, separators=(",", ":")))
    for part in body:
        await channel.send_bytes(part)


def _closed(message: aiohttp.WSMessage) -> bool:
    return message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR)


async def read_frame(channel: Channel) -> dict:
    """The next header. The peer gone before it: TransferError "closed"; anything but a JSON object with an op:
    "protocol"."""
    message = await channel.receive()
    if _closed(message):
        raise TransferError("the peer closed the connection", code="closed")
    if message.type != WSMsgType.TEXT or len(message.data) > MAX_HEADER_BYTES:
        raise TransferError("not a KV transfer header", code="protocol")
    try:
        header = json.loads(message.data)
    except ValueError as error:
        raise TransferError(f"a header is not JSON: {error}", code="protocol") from error
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise TransferError("a header has no op", code="protocol")
    return header


async def read_payloads(channel: Channel, sizes: object) -> list[bytes]:
    """The payloads a `blocks` header announced, one message each, of the sizes it said."""
    if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise TransferError(f"bad payload sizes {sizes!r}", code="protocol")
    payloads = []
    for n in sizes:
        message = await channel.receive()
        if _closed(message):
            raise TransferError(f"the peer closed the connection after {len(payloads)} of {len(sizes)} payloads",
                                code="closed")
        if message.type != WSMsgType.BINARY or len(message.data) != n:
            raise TransferError(f"payload {len(payloads)} is not the {n} bytes announced", code="protocol")
        payloads.append(message.data)
    return payloads


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
    async def offer(self, payloads: list[bytes], channel: Channel) -> None:
        """Source side: send the `blocks` header describing (and, on the channel, followed by) the payloads."""

    @abstractmethod
    async def accept(self, header: dict, channel: Channel) -> list[bytes]:
        """Puller side: the payloads a `blocks` header describes."""

    @abstractmethod
    def discard(self) -> None:
        """Source side: free what `offer` took (after `done`, or when the connection ends)."""


class TcpTransport(Transport):
    name = "tcp"

    def discard(self) -> None:  # the bytes went on the channel: nothing kept
        pass

    async def offer(self, payloads: list[bytes], channel: Channel) -> None:
        await write_frame(channel, {"op": "blocks", "via": self.name, "sizes": [len(p) for p in payloads]}, payloads)

    async def accept(self, header: dict, channel: Channel) -> list[bytes]:
        return await read_payloads(channel, header.get("sizes"))


class ShmTransport(Transport):
    """The payloads in one file under /dev/shm (tmpfs: shared memory), named after the source's marker: the puller
    maps it and removes its name at once (the source removes it too once the puller is done or gone)."""

    name = "shm"

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.segment: Path | None = None

    async def offer(self, payloads: list[bytes], channel: Channel) -> None:
        self.segment = SHM_ROOT / f"{self.prefix}.{secrets.token_hex(8)}"
        await asyncio.to_thread(write_segment, self.segment, payloads)
        await write_frame(channel, {"op": "blocks", "via": self.name, "segment": self.segment.name,
                                    "sizes": [len(p) for p in payloads]})

    async def accept(self, header: dict, channel: Channel) -> list[bytes]:
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


VIAS = ("tcp", "shm", "nixl")


def channel_for(address: dict, backend: str) -> str:
    """How a puller whose backend is `backend` (nixl, shm or tcp) pulls from a source at `address` (a lease's
    transport): the first, in the order nixl, shm, tcp, that both ends can use and the backend allows."""
    if backend == "nixl" and address.get("nixl"):
        return "nixl"
    if backend in ("nixl", "shm") and shm_reachable(address):
        return "shm"
    return "tcp"


# the source side
LeaseBlocks = Callable[[str, list[str]], Awaitable[list[bytes]]]  # (lease id, keys) -> payloads; LeaseRefused
LeasePush = Callable[[str, list[str], dict], Awaitable[dict]]  # (lease id, keys, NIXL target) -> the `blocks` header
# once the blocks are written; LeaseRefused, or TransferError when the write cannot be done
LeaseRelease = Callable[[str, str], Awaitable[None]]  # (lease id, reason) -> None; a second release is a no-op.
# reason: "done" (installed), "released" (the puller gave up), "closed" (the connection ended first), "drain"


class LeaseRefused(Exception):
    """The source will not serve this pull (unknown or expired lease, already pulled); its message goes back."""

    def __init__(self, message: str, *, code: str = "unknown_lease") -> None:
        super().__init__(message)
        self.code = code


class TransferServer:
    """The source engine's listener (an aiohttp web server on its own port): one WebSocket per pull. `blocks` and
    `release` are the lease table's; `push` (with `nixl`, the source's NIXL agent name) serves pulls over NIXL;
    `wrap` wraps each tcp or shm transport (engine/kv/faults.py)."""

    def __init__(self, *, blocks: LeaseBlocks, release: LeaseRelease, host: str, port: int = 0,
                 advertise_host: str | None = None, shm: bool = True, idle_timeout_s: float = 60.0,
                 push: LeasePush | None = None, nixl: str | None = None,
                 wrap: Callable[[Transport], Transport] | None = None) -> None:
        self.blocks = blocks
        self.release = release
        self.push = push
        self.nixl = nixl if push is not None else None
        self.wrap = wrap
        self.host, self.port = host, port
        self.advertise_host = advertise_host or host
        self.idle_timeout_s = idle_timeout_s
        self.shm_name = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}" if shm and SHM_ROOT.is_dir() else None
        self._marker: int | None = None  # the marker's descriptor: its lock says this source is alive
        self._runner: web.AppRunner | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def address(self) -> dict:
        """The lease's `transport` object: {"tcp": "host:port", "shm": marker name or None, "nixl": agent or None}."""
        return {"tcp": f"{self.advertise_host}:{self.port}", "shm": self.shm_name, "nixl": self.nixl}

    async def start(self) -> "TransferServer":
        app = web.Application()
        app.router.add_get(PATH, self._serve)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=CLOSE_TIMEOUT_S)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
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
        if self._runner is not None:
            for task in list(self._connections):  # pulls under way end as "drain"
                task.cancel()
            await self._runner.cleanup()
            self._runner = None
        if self.shm_name is not None:
            for path in SHM_ROOT.glob(f"{self.shm_name}*"):
                path.unlink(missing_ok=True)
        if self._marker is not None:
            os.close(self._marker)
            self._marker = None

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        lease_id = request.query.get("lease")  # the lease this connection is for: it ends with the connection
        channel = web.WebSocketResponse(compress=False, max_msg_size=MAX_HEADER_BYTES, timeout=CLOSE_TIMEOUT_S)
        if not lease_id or not channel.can_prepare(request).ok:
            return web.Response(status=400, text=f"a WebSocket naming its lease: {PATH}?lease=<id>")
        task = asyncio.current_task()
        self._connections.add(task)
        transport: Transport | None = None
        pushed = False  # a NIXL pull was served
        reason = "closed"  # how the lease ends if the connection ends first
        try:
            await channel.prepare(request)
            while True:
                header = await asyncio.wait_for(read_frame(channel), self.idle_timeout_s)
                op = header["op"]
                if op == "pull" and transport is None and not pushed:
                    keys, via = header.get("keys"), header.get("via", "tcp")
                    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or via not in VIAS \
                            or (via == "nixl" and (self.push is None or not isinstance(header.get("nixl"), dict))):
                        raise TransferError("pull needs a list of hex keys and via tcp|shm (or nixl, with a target, "
                                            "from a source that offers it)", code="protocol")
                    try:
                        if via == "nixl":
                            pushed = True
                            await write_frame(channel, await self.push(lease_id, keys, header["nixl"]))
                            continue
                        payloads = await self.blocks(lease_id, keys)
                    except LeaseRefused as refused:
                        lease_id = None  # not ours to release: unknown, expired or pulled by someone else
                        await write_frame(channel, {"op": "error", "code": refused.code, "message": str(refused)})
                        return channel
                    except TransferError as error:  # a NIXL write that could not be done: the puller recomputes
                        await write_frame(channel, {"op": "error", "code": error.code, "message": str(error)})
                        return channel
                    transport = ShmTransport(self.shm_name) if via == "shm" and self.shm_name else TcpTransport()
                    if self.wrap is not None:
                        transport = self.wrap(transport)
                    await transport.offer(payloads, channel)
                elif op in ("done", "release"):
                    if op == "release":
                        log.info("lease %s released by the puller: %s", lease_id, header.get("reason"))
                    await self.release(lease_id, "done" if op == "done" else "released")
                    lease_id = None
                    await write_frame(channel, {"op": "released"})
                    return channel
                else:
                    raise TransferError(f"unexpected {op!r} header", code="protocol")
        except (TransferError, TimeoutError, ConnectionError) as error:
            if lease_id is not None:
                log.info("lease %s: the transfer ended before the puller was done: %s", lease_id,
                         error or type(error).__name__)
            return channel
        except asyncio.CancelledError:
            reason = "drain"
            raise
        finally:
            if transport is not None:
                transport.discard()
            if lease_id is not None:
                with contextlib.suppress(Exception):
                    await self.release(lease_id, reason)
            self._connections.discard(task)
            with contextlib.suppress(Exception):
                await channel.close()


# the puller side
class Pull:
    """One pull over one connection: `async with Pull(address, lease_id, timeout_s=...) as pull`, then
    `await pull.fetch(keys)` (tcp, shm) or `await pull.push(keys, target)` (nixl), and `await pull.done()` once the
    blocks are installed. Leaving without `done` closes the connection, which releases the lease on the source.
    `via`: the channel (channel_for); by default shared memory where the source offers it on this host, else TCP."""

    def __init__(self, address: dict, lease_id: str, *, timeout_s: float, via: str | None = None) -> None:
        self.address = address
        self.lease_id = lease_id
        self.timeout_s = timeout_s
        self.via = via or channel_for(address, "shm")
        self._session: aiohttp.ClientSession | None = None
        self._channel: aiohttp.ClientWebSocketResponse | None = None

    async def __aenter__(self) -> "Pull":
        address = transfer_address(self.address.get("tcp"))
        if address is None:
            raise TransferError(f"bad transfer address {self.address.get('tcp')!r}", code="protocol")
        host, port = address
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}{PATH}"
        self._session = aiohttp.ClientSession()
        try:
            connecting = self._session.ws_connect(url, params={"lease": self.lease_id}, compress=0,
                                                  max_msg_size=MAX_PAYLOAD_BYTES, autoping=True,
                                                  timeout=aiohttp.ClientWSTimeout(ws_close=CLOSE_TIMEOUT_S))
            self._channel = await asyncio.wait_for(connecting, self.timeout_s)
        except TimeoutError as error:
            await self._session.close()
            raise TransferError(f"no connection to {host}:{port} in {self.timeout_s:g} s", code="timeout") from error
        except (aiohttp.ClientError, OSError) as error:
            await self._session.close()
            raise TransferError(f"no connection to {host}:{port}: {error}", code="closed") from error
        return self

    async def __aexit__(self, *exc) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
        if self._session is not None:
            await self._session.close()

    async def fetch(self, keys: list[str]) -> list[bytes]:
        """Payloads for a prefix of `keys` (hex), within the timeout; TransferError otherwise."""
        return await self._timed(self._fetch(keys), "the pull")

    async def _fetch(self, keys: list[str]) -> list[bytes]:
        await write_frame(self._channel, {"op": "pull", "keys": keys, "via": self.via})
        header = await read_frame(self._channel)
        if header["op"] == "error":
            raise TransferError(str(header.get("message")), code=str(header.get("code") or "refused"))
        if header["op"] != "blocks" or header.get("via") not in ("tcp", "shm"):
            raise TransferError(f"unexpected {header['op']!r} header", code="protocol")
        transport = TcpTransport() if header["via"] == "tcp" else ShmTransport(str(self.address.get("shm")))
        payloads = await transport.accept(header, self._channel)
        if len(payloads) > len(keys):
            raise TransferError(f"{len(payloads)} blocks for {len(keys)} keys", code="protocol")
        return payloads

    async def push(self, keys: list[str], target: dict) -> tuple[list[str], list[int]]:
        """Over NIXL: the source writes the blocks of a prefix of `keys` into `target` (the puller's landing slots);
        the keys it wrote and their sums, once the write is complete; TransferError otherwise."""
        return await self._timed(self._push(keys, target), "the NIXL pull")

    async def _push(self, keys: list[str], target: dict) -> tuple[list[str], list[int]]:
        await write_frame(self._channel, {"op": "pull", "keys": keys, "via": "nixl", "nixl": target})
        header = await read_frame(self._channel)
        if header["op"] == "error":
            raise TransferError(str(header.get("message")), code=str(header.get("code") or "refused"))
        written, sums = header.get("keys"), header.get("sums")
        if header["op"] != "blocks" or header.get("via") != "nixl" or not isinstance(written, list) \
                or not isinstance(sums, list) or len(sums) != len(written) or written != keys[: len(written)] \
                or not all(isinstance(n, int) for n in sums):
            raise TransferError(f"unexpected {header['op']!r} header for a NIXL pull", code="protocol")
        return written, sums

    async def done(self, *, reason: str | None = None) -> None:
        """Tell the source the blocks are installed (or, with a reason, given up): it releases the lease."""
        header = {"op": "done" if reason is None else "release"}
        if reason is not None:
            header["reason"] = reason
        await self._timed(self._exchange(header), "the release")

    async def _exchange(self, header: dict) -> None:
        await write_frame(self._channel, header)
        answer = await read_frame(self._channel)
        if answer["op"] != "released":
            raise TransferError(f"unexpected {answer['op']!r} header", code="protocol")

    async def _timed(self, work: Awaitable, what: str):
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError as error:
            raise TransferError(f"{what} took more than {self.timeout_s:g} s", code="timeout") from error
        except (ConnectionError, OSError, aiohttp.ClientError) as error:
            raise TransferError(f"{what} failed: {error}", code="closed") from error


async def release_remote(address: dict, lease_id: str, *, reason: str, timeout_s: float = 5.0) -> bool:
    """Release a lease without pulling it (a puller that will not pull after all); whether the source answered."""
    try:
        async with Pull(address, lease_id, timeout_s=timeout_s, via="tcp") as pull:
            await pull.done(reason=reason)
        return True
    except TransferError as error:
        log.warning("lease %s could not be released on %s: %s", lease_id, address.get("tcp"), error)
        return False
