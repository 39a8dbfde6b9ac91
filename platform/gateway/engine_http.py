"""HTTP/1.1 to the engines, lean: keep-alive connections per engine address over asyncio streams, responses
parsed by httptools (uvicorn's parser). Written here rather than using httpx because httpx's per-request
machinery (pool scans, per-request socket checks, anyio wrappers) was a third of the gateway's CPU per streamed
request in a py-spy profile; the engine's internal API needs only POST/GET with a JSON body and a streamed
NDJSON answer.

A response not read to its end is closed with its connection (the engine then aborts the request); one read to
its end gives its connection back. A request on a reused connection that the engine had closed meanwhile is
sent once more on a new one (the engine never saw it)."""

import asyncio
import collections
import functools
import time
from urllib.parse import urlsplit

import httptools

from engine.contract import KEEP_ALIVE_SECONDS

MAX_IDLE_PER_ENGINE = 256
IDLE_SECONDS = 2.0  # well under the engine server's keep-alive timeout, so it never closes one first, even when
assert IDLE_SECONDS * 10 < KEEP_ALIVE_SECONDS  # this loop reads an answer's end seconds after the engine wrote it


@functools.lru_cache(maxsize=1024)
def _split(url: str) -> tuple[tuple[str, int], str, str]:
    """A URL's address, request target and Host header (once per URL: an engine's few endpoints)."""
    parts = urlsplit(url)
    return (parts.hostname or "127.0.0.1", parts.port or 80), parts.path + (f"?{parts.query}" if parts.query else ""), parts.netloc


class EngineHTTPError(Exception):
    """The connection failed, timed out or the answer was not HTTP."""


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def close(self) -> None:
        self.writer.close()


class _Pool:
    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], collections.deque[_Connection]] = {}

    def take(self, address: tuple[str, int]) -> _Connection | None:
        idle = self.idle.get(address)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            fresh = now - connection.idle_since < IDLE_SECONDS
            if fresh and not connection.reader.at_eof() and not connection.writer.is_closing():
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
    """An answer being read: `status` and `headers` first, then the body as lines or whole."""

    def __init__(self, pool: _Pool, address: tuple[str, int], connection: _Connection, read_timeout: float):
        self._pool = pool
        self._address = address
        self._connection: _Connection | None = connection
        self._read_timeout = read_timeout
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._chunks: collections.deque[bytes] = collections.deque()
        self._lines: list[bytes] = []  # split off the chunks, being yielded by aiter_lines
        self._line_at = 0  # how many of them it yielded
        self._headers_done = False
        self._keep_alive = False
        self._complete = False
        self._parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()  # only valid while parsing

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete = True

    async def _feed(self) -> bool:
        """Reads once from the socket into the parser; False at the end of the answer."""
        if self._complete:
            return False
        assert self._connection is not None
        try:
            async with asyncio.timeout(self._read_timeout):
                data = await self._connection.reader.read(65536)
        except (OSError, TimeoutError) as error:
            self.close()
            raise EngineHTTPError(f"reading from the engine failed: {error!r}") from error
        if not data:
            self.close()
            raise EngineHTTPError("the engine closed the connection before the answer ended")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self.close()
            raise EngineHTTPError(f"the engine's answer is not HTTP: {error}") from error
        if self._complete:
            self._release()
        return True

    async def _read_head(self) -> None:
        while not self._headers_done:
            await self._feed()

    def line_ready(self) -> bool:
        """Whether aiter_lines holds another non-blank line, so that the next one comes without waiting."""
        return any(line.strip() for line in self._lines[self._line_at:])

    async def aiter_lines(self):
        pending = b""
        while True:
            while self._chunks:
                pending += self._chunks.popleft()
                *self._lines, pending = pending.split(b"\n")
                self._line_at = 0
                while self._line_at < len(self._lines):
                    self._line_at += 1
                    yield self._lines[self._line_at - 1].decode()
                self._lines = []
            if not await self._feed() and not self._chunks:
                break
        if pending:
            yield pending.decode()

    async def aread(self) -> bytes:
        while await self._feed():
            pass
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            if self._keep_alive:
                self._pool.give(self._address, connection)
            else:
                connection.close()

    def close(self) -> None:
        """Ends the exchange: an answer not read to its end closes its connection."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class EngineHTTP:
    """One per event loop."""

    def __init__(self, *, connect_timeout: float, read_timeout: float):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._pool = _Pool()

    async def _open(self, address: tuple[str, int]) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(*address)
        except (OSError, TimeoutError) as error:
            raise EngineHTTPError(f"connecting to the engine at {address[0]}:{address[1]} failed: {error!r}") from error
        return _Connection(reader, writer)

    async def request(
        self, method: str, url: str, *, headers: dict[str, str], body: bytes = b"", read_timeout: float | None = None
    ) -> Response:
        """Sends the request and reads the answer's status and headers; the body is the caller's to read."""
        address, target, host = _split(url)
        head = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        timeout = self.read_timeout if read_timeout is None else read_timeout
        reused = self._pool.take(address)
        for connection in (reused, None) if reused is not None else (None,):
            connection = connection or await self._open(address)
            response = Response(self._pool, address, connection, timeout)
            try:
                connection.writer.write(message)
                await response._read_head()
            except (EngineHTTPError, OSError) as error:
                response.close()
                if connection is reused and not response._headers_done:
                    continue  # the engine had closed this idle connection: send it on a new one
                raise EngineHTTPError(str(error)) from error
            return response
        raise AssertionError("unreachable")
