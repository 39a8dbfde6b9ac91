"""The gateway's HTTP server: uvicorn's httptools protocol with one ASGI extension, `quilt.gateway`, that saves the
streamed completion two system calls and a task per request.

    uvicorn gateway.asgi:application --app-dir platform --http gateway.http_protocol:GatewayHttpProtocol

The extension (`scope["extensions"]["quilt.gateway"]`, the request's `GatewayCycle`) offers:

- `when_disconnected(callback)`: called once if the client goes away before its response ended, in place of a
  task that awaits `receive()` for `http.disconnect` beside every request;
- `start_with_body(start, body)`: the response's head and its first body part written together (one write, one
  system call, one wake-up of the client) rather than one after the other;
- `current_task()`: the request's task, without `asyncio.current_task()`'s getpid system call (CPython 3.11's
  running-loop check).

Everything else is uvicorn's own: the head is built, checked and framed by its `send`, in the same order. An
application that finds no extension (another server) does what it did before.
"""

import asyncio
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

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
