"""Admission's scripts run from the gateway's event loop, lean: EVALSHA over keep-alive asyncio connections, the
command packed in one join and the reply (integers, bulk strings and arrays of them: all a script returns) read by
a few lines of RESP2. Written here rather than through redis-py's asyncio client because its per-command machinery
(the blocking pool's lock and condition, a liveness read at every checkout, per-argument encoding, the general
reply parser, the retry wrapper) was about a quarter of the gateway's CPU per streamed request in a profile, and
admission runs two scripts per request. Only plain `redis://` URLs (host, port, optional user and password,
database number in the path; others run on redis-py as before); the blocking paths (metering's settles, totals, reconcile) stay on redis-py.

What it keeps from redis-py's behaviour: a script not yet cached by the server is sent once with EVAL (which caches
it); connection failures raise redis-py's ConnectionError, a server error its ResponseError; at most
`max_connections` at once, a request waiting up to `wait_seconds` for one; a command on a reused connection that
the server had closed meanwhile is sent once more on a new one (redis-py's default retry does as much). A command
interrupted (cancelled, failed) closes its connection, so no reply is ever read by the wrong command."""

import asyncio
import collections
import hashlib
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

Reply = int | bytes | list | None


def wire_supports(url: str) -> bool:
    """Plain `redis://` URLs without options (a query string such as `?db=` or `?socket_timeout=`: redis-py's)."""
    parts = urlsplit(url)
    return parts.scheme == "redis" and not parts.query


def pack(*parts: bytes | str | int) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


class _ServerError(Exception):
    pass


async def _reply(reader: asyncio.StreamReader) -> Reply:
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else (await reader.readexactly(size + 2))[:-2]
    if kind == b"*":
        size = int(rest)
        return None if size < 0 else [await _reply(reader) for _ in range(size)]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise _ServerError(rest.decode(errors="replace"))
    raise RedisConnectionError(f"Redis answered something that is not RESP: {line[:40]!r}")


class WireScript:
    def __init__(self, source: str):
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()


class RedisWire:
    """One per event loop."""

    def __init__(self, url: str, *, max_connections: int = 64, wait_seconds: float = 10.0):
        parts = urlsplit(url)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 6379)
        hello = []
        if parts.password is not None:
            user = [unquote(parts.username)] if parts.username else []
            hello.append(pack(b"AUTH", *user, unquote(parts.password)))
        database = parts.path.strip("/")
        if database and database != "0":
            hello.append(pack(b"SELECT", int(database)))
        self._hello = hello
        self._idle: collections.deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = collections.deque()
        self._slots = asyncio.Semaphore(max_connections)
        self._wait = wait_seconds

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(*self._address)
        try:
            if self._hello:
                writer.write(b"".join(self._hello))
                for _ in self._hello:
                    await _reply(reader)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    async def _command(self, message: bytes) -> Reply:
        if self._slots.locked():  # all connections busy: wait for one, not forever
            try:
                async with asyncio.timeout(self._wait):
                    await self._slots.acquire()
            except TimeoutError:
                raise RedisConnectionError("No connection available.") from None
        else:
            await self._slots.acquire()  # returns at once (no timer to arm)
        try:
            reused = self._take()
            for connection in (reused, None) if reused is not None else (None,):
                try:
                    reader, writer = connection or await self._open()
                except _ServerError as error:
                    raise ResponseError(str(error)) from None
                except (OSError, asyncio.IncompleteReadError) as error:
                    raise RedisConnectionError(f"Error connecting to Redis at {self._address}: {error!r}") from error
                try:
                    writer.write(message)
                    reply = await _reply(reader)
                except _ServerError as error:
                    self._idle.append((reader, writer))  # the reply was read whole: the connection is in step
                    raise error
                except (OSError, asyncio.IncompleteReadError) as error:
                    writer.close()
                    if connection is reused:
                        continue  # Redis had closed this idle connection: send it on a new one
                    raise RedisConnectionError(f"Redis connection failed: {error!r}") from error
                except BaseException:
                    writer.close()  # cancelled mid-command: its reply would be read by the next one
                    raise
                self._idle.append((reader, writer))
                return reply
            raise AssertionError("unreachable")
        finally:
            self._slots.release()

    async def run(self, script: WireScript, keys: list[str], args: list) -> Reply:
        """The script's reply, by SHA; by source the first time the server has not cached it."""
        try:
            return await self._command(pack(b"EVALSHA", script.sha, len(keys), *keys, *args))
        except _ServerError as error:
            if not str(error).startswith("NOSCRIPT"):
                raise ResponseError(str(error)) from None
        try:
            return await self._command(pack(b"EVAL", script.source, len(keys), *keys, *args))
        except _ServerError as error:
            raise ResponseError(str(error)) from None
