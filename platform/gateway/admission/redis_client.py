"""The gateway's Redis client on its event loop: redis-py's asyncio client, one per loop (its connections belong to the
loop that opened them), with hiredis parsing the replies (redis-py uses it where it is installed) and packing the
commands (`HiredisConnection`). Admission's script calls go out one command or one pipeline at a time per loop
(`ScriptCalls`).

Why: a command through redis-py's client costs the gateway two to three times the CPU of the gateway's whole round
trip to Redis (its pool, retry and observability layers, and a Python loop per argument to pack a command), and a
request makes one or two. Admission's scripts have about 25 arguments each: hiredis packs them in C. A pipeline pays
the client's layers once for all its commands: the calls made while one is in flight share the next write and round
trip."""

import asyncio
from collections.abc import Sequence

import hiredis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
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
    """A client for the running loop (its pool holds a connection or two: `ScriptCalls` sends one command or pipeline
    at a time). A connection not made within `reply_seconds` fails with redis-py's TimeoutError (`ScriptCalls` bounds
    a command's reply by as much). A command whose connection failed (Redis restarted since its last command) is sent
    once more on a new one."""
    return redis.asyncio.Redis.from_url(
        url, socket_connect_timeout=reply_seconds, connection_class=HiredisConnection,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )  # fmt: skip


class ScriptCalls:
    """Script calls on one loop's client, one command or one pipeline in flight at a time. A call made while none is
    in flight is redis-py's `Script` call (EVALSHA, the script loaded once when the server answers NOSCRIPT); the
    calls made while one is wait their turn and go together in the next pipeline, each answered with its own reply
    or error (a NOSCRIPT one sent again alone). A call not answered within `reply_seconds` (a paused Redis, or one cut
    off without a reset) fails with redis-py's TimeoutError: one still waiting for its turn is not sent, one sent has
    its connection closed (a reply that came later would be the next command's). One timeout per call, rather than
    redis-py's socket_timeout: that is two, one a task of its own, per command."""

    def __init__(self, client: redis.asyncio.Redis, *, reply_seconds: float):
        self.client = client
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
                return await script(keys=keys, args=args)
        except TimeoutError:
            raise RedisTimeoutError(f"Redis did not answer within {self._reply_seconds:g} s") from None
        finally:
            self._next()

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
                replies = await self._replies(calls)
            for (script, keys, args, future), reply in zip(calls, replies, strict=True):
                if isinstance(reply, NoScriptError):
                    async with asyncio.timeout(self._reply_seconds):
                        reply = await _reply(script(keys=keys, args=args))
                if future.done():  # its caller gave up
                    continue
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except Exception as error:
            if isinstance(error, TimeoutError):
                error = RedisTimeoutError(f"Redis did not answer within {self._reply_seconds:g} s")
            for *_, future in calls:
                if not future.done():
                    future.set_exception(error)
        finally:
            self._next()

    async def _replies(self, calls: list) -> list:
        """The calls' replies, an error Redis answered in the place of its call's."""
        if len(calls) == 1:
            script, keys, args, _ = calls[0]
            return [await _reply(script(keys=keys, args=args))]
        async with self.client.pipeline(transaction=False) as pipe:
            for script, keys, args, _ in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            return await pipe.execute(raise_on_error=False)


async def _reply(call):
    """The call's reply, or the error Redis answered."""
    try:
        return await call
    except redis.exceptions.ResponseError as error:
        return error
