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

The application may also name routes it serves without ASGI's layers (`direct_routes`, `serve_direct`): a POST to one
of them over HTTP/1.1, whole in the server's hands, goes from the parser to the application's `serve_direct(cycle,
kind)` in a `DirectCycle`: no URL parse, no proxy-headers middleware (a request with X-Forwarded-* headers takes the
ASGI path, where it decides), no ASGI receive, no asyncio.Event. The cycle is still uvicorn's (its `send`, its
`receive`, its error handling around the application), so the answer's bytes are the same.

A kept-alive connection's idle timer is armed once and moved forward lazily (`_keep_alive_due`), rather than made at
each response's end and cancelled at the next request's first bytes.

Everything else is uvicorn's own. An application that finds no extension (another server) does what it did before.
"""

import asyncio
import operator
import time
from collections.abc import Callable, Coroutine

from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from engine.server.http_protocol import Held  # a transport's stand-in while uvicorn's send frames a message

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
        transport, held = self.transport, Held()
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

    def write_now(self, data: bytes, more: bool) -> bool:
        """`send` of a body message for a started chunked response, done here without a coroutine when `send` would
        write it at once; False when flow control holds writes, the client is gone, or the response is not a
        started, unfinished, chunked one (the caller then awaits `send`, which decides)."""
        if self.flow.write_paused or self.disconnected or not self.chunked_encoding or not self.response_started:
            return False
        if self.response_complete or self.scope["method"] == "HEAD":
            return False
        if more:
            if data:
                self.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return True
        self.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
        return True

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


class _Signal:
    """What uvicorn's cycle needs of its asyncio.Event (set, clear, wait), for the one task that waits on it."""

    __slots__ = ("flag", "waiter", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.flag, self.waiter, self.loop = False, None, loop

    def set(self) -> None:
        self.flag = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    async def wait(self) -> bool:
        if not self.flag:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return True


class DirectCycle(GatewayCycle):
    """A request to one of the application's direct routes: uvicorn's cycle (its `send`, `receive`, `run_asgi`),
    made without its constructor. The per-request state the constructor would set is read from the class until the
    cycle changes it; the body is bytes (`+=` as uvicorn's parser callbacks extend it)."""

    disconnected = response_started = response_complete = waiting_for_100_continue = False
    chunked_encoding = None
    expected_content_length = 0
    more_body = True
    body = b""

    def __init__(self, protocol: "GatewayHttpProtocol", serve: Callable[["DirectCycle", str], Coroutine], kind: str):
        self.scope, self.transport, self.flow, self.loop = protocol.scope, protocol.transport, protocol.flow, protocol.loop
        self.logger, self.access_logger, self.access_log = protocol.logger, protocol.access_logger, protocol.access_log
        self.default_headers = protocol.server_state.default_headers
        self.message_event = _Signal(protocol.loop)
        self.received = time.monotonic()  # the request's receipt (its head), where the request log's times start
        self.keep_alive = protocol.parser.should_keep_alive()
        self.on_response = protocol.on_response_complete
        self.serve, self.kind = serve, kind

    def run_asgi(self, app) -> Coroutine:
        """uvicorn's `run_asgi` around the application's `serve_direct` (`app`, the server's application, unused)."""
        return super().run_asgi(self._serve)

    def _serve(self, scope, receive, send) -> Coroutine:
        return self.serve(self, self.kind)


def _direct_server(app) -> tuple[dict[bytes, str], Callable] | None:
    """The application's direct routes (raw path -> kind) and its `serve_direct`, found under the server's
    middleware (`.app`), or None."""
    for _ in range(8):
        routes = getattr(app, "direct_routes", None)
        if routes is not None:
            return routes, app.serve_direct
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


_FORWARDED = (b"x-forwarded-proto", b"x-forwarded-for")


class GatewayHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.config
        direct = getattr(config, "quilt_direct", False)
        if direct is False:
            direct = config.quilt_direct = _direct_server(self.app)
        self.direct_routes, self.serve_direct = direct or ({}, None)
        self.idle_since: float | None = None
        self.unstarted: DirectCycle | None = None  # a direct route's request whose body has not all come yet

    def on_headers_complete(self) -> None:
        kind = self.direct_routes.get(self.url)
        if kind is not None and self._direct(kind):
            return
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

    def _direct(self, kind: str) -> bool:
        """Starts a direct route's request (or queues it behind the one in progress), when nothing about it needs
        what uvicorn's path does: else False, and that path takes it."""
        parser = self.parser
        if parser.get_method() != b"POST" or parser.get_http_version() != "1.1" or parser.should_upgrade():
            return False
        if self.expect_100_continue or self.root_path or self.limit_concurrency is not None:
            return False
        headers = dict(self.headers)
        if _FORWARDED[0] in headers or _FORWARDED[1] in headers:
            return False  # uvicorn's proxy-headers middleware may change the scope's scheme and client
        scope = self.scope
        scope["method"], scope["path"], scope["raw_path"], scope["query_string"] = "POST", self.url.decode(), self.url, b""
        existing = self.cycle
        cycle = self.cycle = DirectCycle(self, self.serve_direct, kind)
        scope["extensions"] = {EXTENSION: cycle}
        if existing is None or existing.response_complete:
            self.unstarted = cycle  # started when its body has come (`on_message_complete`), or past the high-water
            # mark (`on_body`): a body sent after the head (as httpx sends it) is not waited for in a task
        else:  # pipelined: uvicorn's queue
            self.flow.pause_reading()
            self.pipeline.appendleft((cycle, self.app))
        return True

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self.unstarted is not None and len(self.cycle.body) > HIGH_WATER_LIMIT:  # reading paused: the task reads on
            self._start_unstarted()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.unstarted is not None:
            self._start_unstarted()

    def _start_unstarted(self) -> None:
        cycle, self.unstarted = self.unstarted, None
        self._start_asgi_task(cycle, self.app)

    def on_response_complete(self) -> None:
        """uvicorn's, with the idle timer armed once and moved forward when it comes due (`_keep_alive_due`)."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self.idle_since = None
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _unset_keepalive_if_required(self) -> None:
        self.idle_since = None  # data came: not idle (the timer, if armed, finds that when it comes due)

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        since = self.idle_since
        if since is None:
            return  # busy: the response's end arms it again
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()

    def connection_lost(self, exc: Exception | None) -> None:
        cycle, self.unstarted = self.cycle, None  # a request whose body never all came is not served
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        super().connection_lost(exc)
        if isinstance(cycle, GatewayCycle) and cycle.disconnected and cycle.on_disconnect is not None:
            callback, cycle.on_disconnect = cycle.on_disconnect, None
            callback()
