"""The gateway's HTTP server: uvicorn's httptools protocol with one ASGI extension, `quilt.gateway`, that saves the
streamed completion two system calls and a task per request.

    uvicorn gateway.asgi:application --app-dir platform --http gateway.http_protocol:GatewayHttpProtocol

The extension (`scope["extensions"]["quilt.gateway"]`, the request's `GatewayCycle`) offers:

- `when_disconnected(callback)`: called once if the client goes away before its response ended, in place of a
  task that awaits `receive()` for `http.disconnect` beside every request;
- `start_with_body(start, body)`: the response's head and its first body part written together (one write, one
  system call, one wake-up of the client) rather than one after the other, the head built as uvicorn's `send`
  builds it (and by it, in its special cases);
- `current_task()`: the request's task, without `asyncio.current_task()`'s getpid system call (CPython 3.11's
  running-loop check).

Everything else is uvicorn's own. An application that finds no extension (another server) does what it did before.
"""

import asyncio
import operator
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

EXTENSION = "quilt.gateway"
COMMAND_LINE = ("--http", "gateway.http_protocol:GatewayHttpProtocol")  # uvicorn's options that select it


class GatewayCycle(RequestResponseCycle):
    """A request of the gateway's: uvicorn's cycle, with what `EXTENSION` offers."""

    on_disconnect: Callable[[], None] | None = None
    loop: asyncio.AbstractEventLoop

    def when_disconnected(self, callback: Callable[[], None] | None) -> None:
        self.on_disconnect = callback

    def current_task(self) -> asyncio.Task | None:
        return asyncio.current_task(self.loop)

    async def start_with_body(self, start: dict, body: dict) -> None:
        head = self._plain_head(start) if body.get("more_body") else None
        if head is not None:
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            self.response_started, self.waiting_for_100_continue, self.chunked_encoding = True, False, True
            data = body.get("body", b"")
            self.transport.write(head + b"%x\r\n%s\r\n" % (len(data), data) if data else head)
            return
        transport, held = self.transport, _Held()
        self.transport = held  # uvicorn's send frames both messages into `held`, then they leave in one write
        try:
            await self.send(start)
            await self.send(body)
        finally:
            self.transport = transport
            if held.parts:
                transport.write(b"".join(held.parts))
            if held.closing:
                transport.close()


    def _plain_head(self, start: dict) -> bytes | None:
        """The head uvicorn's `send` writes for `start` (a chunked response), built in C without its loop over the
        headers (two regular-expression searches each): when none of its special cases applies (no access log, no
        HEAD, a status with a body, header names in lower case and none of content-length, transfer-encoding or
        connection) and no header has a character its checks refuse; None otherwise, and its `send` decides (and
        refuses an invalid header) as ever. Its checks look for single characters (`_NAME_REFUSED`,
        `_VALUE_REFUSED`, read off its own expressions), so deleting them from all names at once finds them too."""
        status, headers = start["status"], [*self.default_headers, *start.get("headers", ())]
        if self.response_started or self.access_log or self.scope["method"] == "HEAD" or status in (204, 304):
            return None
        names, values = b"".join(map(_NAME, headers)), b"".join(map(_VALUE, headers))
        if not names.islower() or not _SPECIAL.isdisjoint(map(_NAME, headers)):
            return None
        if len(names.translate(None, _NAME_REFUSED)) != len(names):
            return None
        if len(values.translate(None, _VALUE_REFUSED)) != len(values):
            return None
        ending = b"transfer-encoding: chunked\r\n\r\n" if self.keep_alive else _CLOSE_ENDING
        return b"".join([STATUS_LINE[status], b"\r\n".join([*map(b": ".join, headers), b""]), ending])


_NAME, _VALUE = operator.itemgetter(0), operator.itemgetter(1)
_NAME_REFUSED = bytes(byte for byte in range(256) if HEADER_RE.search(bytes([byte])))
_VALUE_REFUSED = bytes(byte for byte in range(256) if HEADER_VALUE_RE.search(bytes([byte])))
_SPECIAL = frozenset((b"content-length", b"transfer-encoding", b"connection"))
_CLOSE_ENDING = b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n"


class _Held:
    """Stands in for the transport while a head and its first body part are framed."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closing = True


class GatewayHttpProtocol(HttpToolsProtocol):
    def on_headers_complete(self) -> None:
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is before:  # an upgrade (WebSocket): no request cycle was made
            return
        # uvicorn makes its RequestResponseCycle by name; GatewayCycle adds methods only (the same instance layout),
        # and the request's task has not run yet.
        cycle.__class__ = GatewayCycle
        cycle.loop = self.loop
        cycle.scope["extensions"] = {**cycle.scope.get("extensions", {}), EXTENSION: cycle}

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if isinstance(cycle, GatewayCycle) and cycle.disconnected and cycle.on_disconnect is not None:
            callback, cycle.on_disconnect = cycle.on_disconnect, None
            callback()
