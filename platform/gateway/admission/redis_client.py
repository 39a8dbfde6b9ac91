"""The gateway's Redis client on its event loop, redis-py's: admission's script calls on one connection per loop
(`ScriptCalls`), the rare other commands (a month's start) on a `redis.asyncio.Redis` per loop (`loop_client`).
Connections belong to the loop that opened them. hiredis parses the replies (redis-py uses it where it is installed)
and packs the commands (`HiredisConnection`).

Why not every command through `redis.asyncio.Redis`: through it a command costs about twice the CPU it costs on its
connection (the client's pool, retry and observability layers), and a request makes one or two. Admission's scripts
have about 25 arguments each: hiredis packs them in C, not a Python loop per argument. One connection in step per
loop needs no pool, and the calls made while one is in flight share the next write and round trip (a pipeline).
Measured: benchmarks/redis_client_libs.py, docs/gateway-performance.md ("Redis through redis-py")."""

import asyncio
from collections.abc import Sequence

import hiredis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


class HiredisConnection(redis.asyncio.Connection):
    """redis-py's connection, its commands packed by hiredis rather than by redis-py's Python."""

    def pack_command(self, *args) -> list[bytes]:
        command = args[0]
        if isinstance(command, str):
            command = command.encode()
        if b" " in command:  # a command of two words, as redis-py writes some ("SCRIPT LOAD"): two arguments
            args = (*command.split(), *args[1:])
        return [hiredis.pack_command(args)]


def loop_client(url: str, *, reply_seconds: float) -> redis.asyncio.Redis:
    """A client for the running loop's other commands. A command not answered within `reply_seconds`, and a
    connection not made within them, fail with redis-py's TimeoutError (a URL's own socket_timeout and
    socket_connect_timeout win); a command whose connection failed (Redis restarted since its last command) is sent
    once more on a new one."""
    return redis.asyncio.Redis.from_url(
        url, socket_timeout=reply_seconds, socket_connect_timeout=reply_seconds, connection_class=HiredisConnection,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )  # fmt: skip


class ScriptCalls:
    """Admission's script calls from one loop, on one connection of redis-py's (`HiredisConnection`: its packing,
    hiredis's parsing), one command or one pipeline of commands in flight at a time: a call made while none is in
    flight is sent alone; the calls made while one is wait their turn and go together in the next write, each
    answered with its own reply or error. The calls of a loop never need more than this one connection, so none goes
    through a pool's checkout and return, nor the client's retry and observability layers: about half of a command's
    CPU through `redis.asyncio.Redis`.

    Each call is EVALSHA; one Redis answers NOSCRIPT (a restart, SCRIPT FLUSH) is sent again after SCRIPT LOAD, as
    redis-py's `Script` does. A call whose connection failed (Redis restarted since the last call) is sent once more
    on a new connection. A call not answered within `reply_seconds` (a paused Redis, or one cut off without a reset)
    fails with redis-py's TimeoutError: one still waiting for its turn is not sent, one sent has its connection closed
    (a reply that came later would be the next command's)."""

    def __init__(self, url: str, *, reply_seconds: float):
        # no socket timeout (redis-py's is a task per write and a timeout per read): each call has its own, below
        pool = redis.asyncio.ConnectionPool.from_url(url, socket_timeout=None, socket_connect_timeout=reply_seconds,
                                                     connection_class=HiredisConnection)  # fmt: skip
        self._connection = pool.make_connection()  # the URL's options (database, password) applied
        self._reply_seconds = reply_seconds
        self._in_flight = False
        self._waiting: list[tuple] = []
        self._sending: set[asyncio.Task] = set()

    async def __call__(self, script: AsyncScript, keys: Sequence, args: Sequence):
        if self._in_flight:
            future = asyncio.get_running_loop().create_future()
            self._waiting.append((script, keys, args, future))
            try:
                async with asyncio.timeout(self._reply_seconds):
                    return await future
            except TimeoutError:
                raise RedisTimeoutError(f"no turn to send a command to Redis within {self._reply_seconds:g} s") from None
        self._in_flight = True
        try:
            async with asyncio.timeout(self._reply_seconds):
                [reply] = await self._replies([(script, keys, args)])
        except TimeoutError:
            raise RedisTimeoutError(f"Redis did not answer within {self._reply_seconds:g} s") from None
        finally:
            self._next()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _next(self) -> None:
        """The calls that waited, sent by a task of their own (none of their callers' cancellation cuts the others
        off); or none in flight."""
        calls = [call for call in self._waiting if not call[3].done()]  # not given up
        self._waiting = []
        if not calls:
            self._in_flight = False
            return
        task = asyncio.get_running_loop().create_task(self._send(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list) -> None:
        try:
            async with asyncio.timeout(self._reply_seconds):
                replies = await self._replies([call[:3] for call in calls])
        except Exception as error:
            if isinstance(error, TimeoutError):
                error = RedisTimeoutError(f"Redis did not answer within {self._reply_seconds:g} s")
            replies = [error] * len(calls)
        finally:
            self._next()
        for (*_, future), reply in zip(calls, replies, strict=True):
            if future.done():  # its caller gave up
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _replies(self, calls: list) -> list:
        """The calls' replies, an error Redis answered in its call's place; the NOSCRIPT ones sent again once their
        scripts are loaded."""
        replies = await self._ask([("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls])
        again = [number for number, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if again:
            scripts = {calls[number][0].sha: calls[number][0].script for number in again}
            loaded = await self._ask([("SCRIPT LOAD", source) for source in scripts.values()])
            for reply in loaded:
                if isinstance(reply, Exception):
                    raise reply
            for number, reply in zip(again, await self._ask([
                ("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in (calls[n] for n in again)
            ]), strict=True):  # fmt: skip
                replies[number] = reply
        return replies

    async def _ask(self, commands: list[tuple]) -> list:
        """The commands written at once, and their replies read in order (an error reply in its command's place);
        once more on a new connection if the connection failed."""
        connection = self._connection
        for attempt in (1, 2):
            try:
                await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
                replies = []
                for _ in commands:
                    try:
                        replies.append(await connection.read_response())
                    except ResponseError as error:
                        replies.append(error)
                return replies
            except RedisConnectionError:
                await connection.disconnect()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")
