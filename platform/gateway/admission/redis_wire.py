"""Admission's scripts run from the gateway's event loop, lean: EVALSHA over keep-alive asyncio connections, the
command packed in C loops (`map`, no Python loop per argument) and the reply (integers, bulk strings and arrays of
them: all a script returns) parsed by a few lines of RESP2 in the connection's protocol callback, from what has
arrived (no stream reader awaited line by line). Written here rather than through redis-py's asyncio client because its per-command machinery
(the blocking pool's lock and condition, a liveness read at every checkout, per-argument encoding, the general
reply parser, the retry wrapper) was about a quarter of the gateway's CPU per streamed request in a profile, and
admission runs two scripts per request. Only plain `redis://` URLs (host, port, optional user and password,
database number in the path; others run on redis-py as before); the blocking paths (metering's settles, totals, reconcile) stay on redis-py.

What it keeps from redis-py's behaviour: a script not yet cached by the server is sent once with EVAL (which caches
it); connection failures raise redis-py's ConnectionError, a server error its ResponseError; at most
`max_connections` at once, a request waiting up to `wait_seconds` for one; a command on a reused connection that
the server had closed meanwhile is sent once more on a new one (redis-py's default retry does as much). A command
interrupted (cancelled, failed) closes its connection, so no reply is ever read by the wrong command. A command not
answered within `reply_seconds` (a server paused, or cut off without a reset), and a connection not made within
them, fail with redis-py's TimeoutError: a watchdog looks at the open connections every `reply_seconds / 2` (at most
a second), so a command pays one clock read for it."""

import asyncio
import collections
import hashlib
import re
from collections.abc import Callable, Coroutine
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Reply = int | bytes | list | None


def wire_supports(url: str) -> bool:
    """Plain `redis://` URLs without options (a query string such as `?db=` or `?socket_timeout=`: redis-py's)."""
    parts = urlsplit(url)
    return parts.scheme == "redis" and not parts.query


_BULK = b"$%d\r\n%b\r\n".__mod__


def bulks(parts: tuple | list) -> bytes:
    """Each part as a RESP bulk string (str() of it, UTF-8, unless bytes), in C loops (`map`) rather than a Python
    loop per part."""
    if any(map(bytes.__instancecheck__, parts)):
        encoded = [part if isinstance(part, bytes) else str(part).encode() for part in parts]
    else:
        encoded = [*map(str.encode, map(str, parts))]
    return b"".join(map(_BULK, zip(map(len, encoded), encoded, strict=True)))


def pack(*parts: bytes | str | int) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return b"*%d\r\n" % len(parts) + bulks(parts)


# An array of integers and bulk strings without CR or LF in them, as all the per-request scripts' replies are: its
# items found by a regex, in C, rather than one by one (303 -> 175 bytecodes for the acquire's reply). A bulk string
# of another length than its data's (one with CR LF in it) and any other reply are read item by item.
_ITEM = rb":(-?\d+)\r\n|\$(\d+)\r\n([^\r\n]*)\r\n"
_ITEMS = re.compile(_ITEM)
_FLAT_SIZES = 9  # arrays of up to 8 items
_FLAT_ARRAYS = [re.compile(rb"(?:%b){%d}" % (_ITEM, size)) for size in range(_FLAT_SIZES)]  # by the array's size


class _ServerError(Exception):
    pass


class _Incomplete(Exception):
    pass


def _parse(buffer: bytearray, start: int) -> tuple[Reply | _ServerError, int]:
    """One RESP2 reply at `start` of `buffer`, and where it ends; _Incomplete when it has not all arrived. A server
    error (anywhere in it) is returned as a _ServerError, once the whole reply is read."""
    end = buffer.find(b"\r\n", start)
    if end < 0:
        raise _Incomplete
    kind = buffer[start]
    if kind == 58:  # ":"
        return int(buffer[start + 1 : end]), end + 2
    if kind == 36:  # "$"
        size = int(buffer[start + 1 : end])
        if size < 0:
            return None, end + 2
        stop = end + 2 + size
        if len(buffer) < stop + 2:
            raise _Incomplete
        return bytes(buffer[end + 2 : stop]), stop + 2
    if kind == 42:  # "*"
        size = int(buffer[start + 1 : end])
        if size < 0:
            return None, end + 2
        flat = _FLAT_ARRAYS[size].match(buffer, end + 2) if size < _FLAT_SIZES else None
        if flat is not None:
            items = []
            for number, length, data in _ITEMS.findall(buffer, end + 2, flat.end()):
                if number:
                    items.append(int(number))
                elif len(data) == int(length):
                    items.append(data)
                else:
                    break  # a bulk string with CR LF in it: read below
            else:
                return items, flat.end()
        items, position, error = [], end + 2, None
        for _ in range(size):
            item, position = _parse(buffer, position)
            if isinstance(item, _ServerError):
                error = item
            items.append(item)
        return (error or items), position
    if kind == 43:  # "+"
        return bytes(buffer[start + 1 : end]), end + 2
    if kind == 45:  # "-"
        return _ServerError(buffer[start + 1 : end].decode(errors="replace")), end + 2
    raise RedisConnectionError(f"Redis answered something that is not RESP: {bytes(buffer[start : start + 40])!r}")


class _Connection(asyncio.Protocol):
    """One connection: a command is written whole and its reply parsed from what arrived, in the loop's callback
    (no stream reader, no read per line)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop  # its futures made on it: asyncio's lookup of the running loop is a getpid() syscall
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None
        self._quick: QuickReply | None = None  # the command's script's, with its waiter
        self.asked = 0.0  # the loop's time when the command now waiting for its reply was sent
        self.lost = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is not None and self._quick is not None and not self._buffer and not waiter.done():
            whole = self._quick.pattern.fullmatch(data)  # the reply, whole in one arrival, of its usual shape
            if whole is not None and (reply := self._quick.read(whole)) is not None:
                self._waiter = None
                waiter.set_result(reply)
                return
        self._buffer += data
        if waiter is None or waiter.done():
            return
        try:
            reply, end = _parse(self._buffer, 0)
        except _Incomplete:
            return
        except RedisConnectionError as error:
            waiter.set_exception(error)
            return
        del self._buffer[:end]
        self._waiter = None
        waiter.set_result(reply)

    def eof_received(self) -> bool:
        self._lose(ConnectionResetError("Redis closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc or ConnectionResetError("the connection to Redis was closed"))

    def _lose(self, error: Exception) -> None:
        self.lost = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(error)

    def close(self) -> None:
        self.lost = True
        self.transport.close()

    def get_extra_info(self, name: str):
        return self.transport.get_extra_info(name)

    def ask(self, message: bytes) -> "asyncio.Future[Reply | _ServerError]":
        """Sends `message`; the future is its reply (a _ServerError is a result, not raised: the connection stays in
        step). A plain call, not a coroutine: one frame less per command."""
        self._waiter = waiter = self.loop.create_future()
        self._quick = None
        self.asked = self.loop.time()
        self.transport.write(message)
        return waiter

    def overdue(self, now: float, limit: float) -> bool:
        """Whether a command has waited for its reply more than `limit` seconds: then it fails with a TimeoutError,
        and the connection is closed (a reply that came later would be the next command's)."""
        waiter = self._waiter
        if self.lost or waiter is None or waiter.done() or now - self.asked <= limit:
            return False
        self._lose(RedisTimeoutError(f"Redis did not answer within {limit:g} s"))
        self.close()
        return True


class QuickReply(NamedTuple):
    """A script's usual reply, read without RESP's parse item by item: a reply that arrives whole in one piece and
    fullmatches `pattern` is answered as `read(match)`, unless that is None; any other (an error reply, a reply of
    another shape or split across arrivals) as parsed."""

    pattern: re.Pattern[bytes]
    read: Callable[[re.Match[bytes]], object]


class WireScript:
    def __init__(self, source: str, *, quick: QuickReply | None = None):
        self.quick = quick
        self.source = source.encode()
        self.sha = hashlib.sha1(self.source).hexdigest().encode()
        self.by_sha = bulks([b"EVALSHA", self.sha])  # the command's first two parts, packed once
        self.by_source = bulks([b"EVAL", self.source])  # the same for a server that has not cached it


class RedisWire:
    """One per event loop."""

    def __init__(self, url: str, *, max_connections: int = 64, wait_seconds: float = 10.0, reply_seconds: float = 5.0):
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
        self._idle: collections.deque[_Connection] = collections.deque()
        # At most max_connections commands at once, the rest waiting in turn: counted here, not by asyncio.Semaphore,
        # whose uncontended acquire and release are five Python calls per command.
        self._free = max_connections
        self._turns: collections.deque[asyncio.Future] = collections.deque()
        self._wait = wait_seconds
        self._reply = reply_seconds
        self._connections: set[_Connection] = set()  # open ones, for the watchdog
        self._watchdog: asyncio.TimerHandle | None = None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()  # once per connection
        try:
            async with asyncio.timeout(self._reply):
                _, connection = await loop.create_connection(lambda: _Connection(loop), *self._address)
        except TimeoutError:
            raise RedisTimeoutError(f"no connection to Redis at {self._address} within {self._reply:g} s") from None
        self._connections.add(connection)
        if self._watchdog is None:
            self._watchdog = loop.call_later(self._watch_every(), self._watch, loop)
        try:
            for hello in self._hello:
                reply = await connection.ask(hello)
                if isinstance(reply, _ServerError):
                    raise reply
        except BaseException:
            connection.close()
            raise
        return connection

    def _watch_every(self) -> float:
        return min(1.0, self._reply / 2)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fails the commands overdue for their reply (`_Connection.overdue`) and forgets closed connections; again
        in a while, as long as connections are open."""
        now = loop.time()
        for connection in [*self._connections]:
            if connection.lost or connection.overdue(now, self._reply):
                self._connections.discard(connection)
        self._watchdog = loop.call_later(self._watch_every(), self._watch, loop) if self._connections else None

    def _take(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if not connection.lost and not connection.transport.is_closing():  # still open
                return connection
            connection.close()
        return None

    async def _wait_turn(self) -> None:
        """All connections busy: waits for one, in turn, up to `wait_seconds`."""
        turn = asyncio.get_running_loop().create_future()
        self._turns.append(turn)
        try:
            async with asyncio.timeout(self._wait):
                await turn
        except BaseException as error:
            if turn.done() and not turn.cancelled():
                self._pass_on()  # handed a connection just as it gave up: the next in line takes it
            elif turn in self._turns:
                self._turns.remove(turn)
            if isinstance(error, TimeoutError):
                raise RedisConnectionError("No connection available.") from None
            raise

    def _pass_on(self) -> None:
        """A command is done with its connection: the first still waiting takes its turn, or one more is free."""
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1

    async def run(self, script: WireScript, keys: list[str], args: list) -> Reply:
        """The script's reply, by SHA; by source the first time the server has not cached it."""
        return await self.run_packed(script, 3 + len(keys) + len(args), bulks([len(keys), *keys, *args]))

    def run_packed(self, script: WireScript, parts: int, packed: bytes) -> "Coroutine[None, None, Reply]":
        """`run` for keys and arguments already packed: `packed` is `bulks([len(keys), *keys, *args])`, `parts`
        3 + len(keys) + len(args). For a caller that packs what its commands share once."""
        return self.run_message(script, b"*%d\r\n%b%b" % (parts, script.by_sha, packed))

    async def run_message(self, script: WireScript, message: bytes) -> Reply:
        """`run` for a command packed whole: `message` is `pack(b"EVALSHA", sha, len(keys), *keys, *args)`, its
        start `b"*%d\r\n" % parts + script.by_sha`. Sent by source (EVAL) if the server answers NOSCRIPT. One
        coroutine per command: the slot, the connection, the command's write and its reply handled here."""
        if self._free:  # a connection to spare (so no one is waiting for one)
            self._free -= 1
        else:
            await self._wait_turn()
        try:
            idle = self._idle  # the most recently used idle connection, if open (`_take` without its call):
            connection = reused = idle.pop() if idle else None
            if reused is not None and (reused.lost or reused.transport.is_closing()):
                reused.close()
                connection = reused = self._take()
            while True:
                if connection is None:
                    connection = await self._connect()
                try:  # `connection.ask(message)` without its call
                    waiter = connection._waiter = connection.loop.create_future()
                    connection._quick = script.quick
                    connection.asked = connection.loop.time()
                    connection.transport.write(message)
                    reply = await waiter
                except OSError as error:
                    connection.close()
                    if connection is reused:
                        connection = reused = None  # Redis had closed this idle connection: send it on a new one
                        continue
                    raise RedisConnectionError(f"Redis connection failed: {error!r}") from error
                except BaseException:
                    connection.close()  # cancelled mid-command: its reply would be read by the next one
                    raise
                idle.append(connection)  # the reply was read whole (an error reply too): in step
                break
        finally:
            if self._turns:
                self._pass_on()
            else:  # no one waiting (`_pass_on` without its call)
                self._free += 1
        if type(reply) is _ServerError:
            if str(reply).startswith("NOSCRIPT") and message.startswith(script.by_sha, message.index(b"\n") + 1):
                start = message.index(b"\n") + 1  # after `*<parts>\r\n`: the same command by source
                by_source = message[:start] + script.by_source + message[start + len(script.by_sha) :]
                return await self.run_message(script, by_source)
            raise ResponseError(str(reply))
        return reply

    async def _connect(self) -> _Connection:
        """A new connection (`_open`), its failures as redis-py raises them."""
        try:
            return await self._open()
        except _ServerError as error:
            raise ResponseError(str(error)) from None
        except OSError as error:
            raise RedisConnectionError(f"Error connecting to Redis at {self._address}: {error!r}") from error
