"""HTTP/1.1 to the engines, lean: keep-alive connections per engine address, each an asyncio protocol whose callback
feeds what arrives to httptools (uvicorn's parser); a response is read from what has been parsed. Written here
rather than using httpx because httpx's per-request machinery (pool scans, per-request socket checks, anyio wrappers)
was a third of the gateway's CPU per streamed request in a py-spy profile, and as a protocol rather than over asyncio
streams because their reader and writer (a read coroutine and an `asyncio.timeout` per read) were most of what
remained; the engine's internal API needs only POST/GET with a JSON body and a streamed NDJSON answer.

A response not read to its end is closed with its connection (the engine then aborts the request); one read to
its end gives its connection back. A request on a reused connection that the engine had closed meanwhile is
sent once more on a new one (the engine never saw it). Each wait for the engine is bounded by `read_timeout`, a
timer on the connection's loop: `asyncio.timeout` asks for the running loop, a getpid() syscall in CPython 3.11."""

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable
from urllib.parse import urlsplit

import httptools

from engine.contract import KEEP_ALIVE_SECONDS

MAX_IDLE_PER_ENGINE = 256
IDLE_SECONDS = 2.0  # well under the engine server's keep-alive timeout, so it never closes one first, even when
assert IDLE_SECONDS * 10 < KEEP_ALIVE_SECONDS  # this loop reads an answer's end seconds after the engine wrote it
READ_BUFFER = 2 * 65536  # the body that arrived unread beyond which the connection stops reading (as asyncio's streams)


@functools.lru_cache(maxsize=1024)
def _split(url: str) -> tuple[tuple[str, int], str, str]:
    """A URL's address, request target and Host header (once per URL: an engine's few endpoints)."""
    parts = urlsplit(url)
    return (parts.hostname or "127.0.0.1", parts.port or 80), parts.path + (f"?{parts.query}" if parts.query else ""), parts.netloc


def prepared(method: str, url: str, headers: dict[str, str]) -> tuple[tuple[str, int], bytes, bytes]:
    """A request's address, and its head before and after its Content-Length's value: for `EngineHTTP.send`, by a
    caller that sends many alike (the head's headers in C, no Python loop per header)."""
    address, target, host = _split(url)
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: "
    rest = "\r\n" + "".join(map("{}: {}\r\n".format, headers, headers.values())) + "\r\n"
    return address, head.encode("latin-1"), rest.encode("latin-1")


class EngineHTTPError(Exception):
    """The connection failed, timed out or the answer was not HTTP."""


def _error(message: str, cause: BaseException) -> EngineHTTPError:
    error = EngineHTTPError(message)
    error.__cause__ = cause
    return error


class _Connection(asyncio.Protocol):
    """One keep-alive connection: what arrives goes to the response being read on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False  # by either side
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is not None:
            self.response._received(data)
        else:  # bytes no request asked for: the connection is out of step
            self.close()

    def eof_received(self) -> bool:
        self._lost(None)
        return False  # the transport closes itself

    def connection_lost(self, error: Exception | None) -> None:
        self._lost(error)

    def _lost(self, error: Exception | None) -> None:
        self.closed = True
        if self.response is not None:
            self.response._lost(error)

    def close(self) -> None:
        self.closed = True
        self.transport.close()


class _Pool:
    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], collections.deque[_Connection]] = {}

    def take(self, address: tuple[str, int]) -> _Connection | None:
        idle = self.idle.get(address)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            fresh = now - connection.idle_since < IDLE_SECONDS
            if fresh and not connection.closed and not connection.transport.is_closing():
                return connection
            connection.close()
        return None

    def give(self, address: tuple[str, int], connection: _Connection) -> None:
        idle = self.idle.setdefault(address, collections.deque())
        if len(idle) >= MAX_IDLE_PER_ENGINE:
            connection.close()
        else:
            connection.idle_since = time.monotonic()
            idle.append(connection)


class Response:
    """An answer being read: `status` first (its headers are not kept: nothing reads them), then the body, whole (`aread`) or as lines (`lines`, split
    as they arrive, then `rest`; awaiting `arrival()` for more until `complete`)."""

    def __init__(self, pool: _Pool, address: tuple[str, int], connection: _Connection,
                 loop: asyncio.AbstractEventLoop, read_timeout: float):  # fmt: skip
        self._pool = pool
        self._address = address
        self._connection: _Connection | None = connection
        self._loop = loop
        self._read_timeout = read_timeout
        self.status = 0
        self.complete = False  # the whole answer arrived
        self.lines: collections.deque[bytes] = collections.deque()  # the body's lines not yet taken (popleft them)
        self.rest = b""  # the body after its last newline: its last line, once the answer is complete
        self._body: list[bytes] = []  # parsed from the last arrival
        self._unread = 0  # the body's bytes that arrived since the reader last waited for more
        self._headers_done = False
        self._keep_alive = False
        self._failure: EngineHTTPError | None = None
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits for the engine
        self._timer: asyncio.TimerHandle | None = None  # its read timeout, armed with it
        self._parser = httptools.HttpResponseParser(self)
        connection.response = self

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._headers_done = True
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()  # only valid while parsing

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # the connection's callbacks
    def _received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._body.clear()  # nothing of an arrival that is not HTTP is read
            self._fail(_error(f"the engine's answer is not HTTP: {error}", error))
            return
        if self._body:
            parts = (self.rest + b"".join(self._body)).split(b"\n")
            self._body.clear()
            self.rest = parts.pop()
            self.lines += parts
            self._unread += len(data)
        if self.complete:
            self._release()
        elif self._unread > READ_BUFFER:  # the reader is behind: the engine waits (TCP) until it catches up
            self._connection.transport.pause_reading()
        self._wake()

    def _lost(self, error: Exception | None) -> None:
        if error is None:
            self._fail(EngineHTTPError("the engine closed the connection before the answer ended"))
        else:
            self._fail(_error(f"reading from the engine failed: {error!r}", error))

    def _time_out(self) -> None:
        self._timer = None
        timeout = TimeoutError()
        self._fail(_error(f"reading from the engine failed: {timeout!r}", timeout))

    def _fail(self, failure: EngineHTTPError) -> None:
        self._failure = failure
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not waiter.done():  # else its reader was cancelled
            if self._failure is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(self._failure)

    # the reader's side
    def arrival(self) -> asyncio.Future:
        """A future done when more of the answer has arrived; EngineHTTPError (raised or set on it) when reading
        failed or nothing arrived for `read_timeout` seconds."""
        if self._failure is not None:
            raise self._failure
        assert self._connection is not None, "read on after close()"
        if self._unread > READ_BUFFER:  # the reader caught up
            self._connection.transport.resume_reading()
        self._unread = 0
        self._waiter = waiter = self._loop.create_future()
        self._timer = self._loop.call_later(self._read_timeout, self._time_out)
        return waiter

    async def aread(self) -> bytes:
        while not self.complete:
            await self.arrival()
        body = b"\n".join([*self.lines, self.rest])
        self.lines.clear()
        self.rest = b""
        return body

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.response = None
            if self._unread > READ_BUFFER:
                connection.transport.resume_reading()
            if self._keep_alive:
                self._pool.give(self._address, connection)
            else:
                connection.close()

    def close(self) -> None:
        """Ends the exchange: an answer not read to its end closes its connection."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.response = None
            connection.close()


class EngineHTTP:
    """One per event loop (made on it)."""

    def __init__(self, *, connect_timeout: float, read_timeout: float):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._loop = asyncio.get_running_loop()
        self._pool = _Pool()

    async def _open(self, address: tuple[str, int]) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):  # a new connection only, not one per request
                _, connection = await self._loop.create_connection(_Connection, *address)
        except (OSError, TimeoutError) as error:
            raise EngineHTTPError(f"connecting to the engine at {address[0]}:{address[1]} failed: {error!r}") from error
        return connection

    def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes = b"", read_timeout: float | None = None
    ) -> Awaitable[Response]:
        """Sends the request and reads the answer's status line and headers; the body is the caller's to read."""
        address, head, rest = prepared(method, url, headers)
        return self.send(address, b"%b%d%b%b" % (head, len(body), rest, body), read_timeout=read_timeout)

    async def send(self, address: tuple[str, int], message: bytes, *, read_timeout: float | None = None) -> Response:
        """`request` for a message made whole (`prepared`'s head around its body's length, then the body)."""
        timeout = self.read_timeout if read_timeout is None else read_timeout
        reused = self._pool.take(address)
        for connection in (reused, None) if reused is not None else (None,):
            connection = connection or await self._open(address)
            response = Response(self._pool, address, connection, self._loop, timeout)
            try:
                connection.transport.write(message)
                while not response._headers_done:
                    await response.arrival()
            except EngineHTTPError as error:
                response.close()
                if connection is reused and not response._headers_done:
                    continue  # the engine had closed this idle connection: send it on a new one
                raise EngineHTTPError(str(error)) from error
            except BaseException:
                response.close()  # cancelled: the engine aborts the request as its connection closes
                raise
            return response
        raise AssertionError("unreachable")
