"""The gateway's lean Redis script runner against a real Redis: replies, uncached scripts, errors, a connection the
server closed, a cancelled command."""

import asyncio
import os
import socket
import uuid

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.admission.redis_wire import RedisWire, WireScript, pack

URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379") + "/13"
ECHO = WireScript("return {tonumber(ARGV[1]) + 1, ARGV[2], KEYS[1], redis.call('GET', KEYS[1])}")


@pytest.fixture
def key():
    name = f"quilt-wire-test-{uuid.uuid4().hex[:8]}"
    yield name
    redis.Redis.from_url(URL).delete(name)


def test_pack_is_resp():
    assert pack(b"GET", "k", 12) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$2\r\n12\r\n"
    assert pack("caf\u00e9", -1, "") == b"*3\r\n$5\r\ncaf\xc3\xa9\r\n$2\r\n-1\r\n$0\r\n\r\n"  # lengths in bytes


def test_a_script_runs_with_its_keys_and_arguments_as_sent(key):
    """What `run` sends is what `pack` would: every key and argument whole, non-ASCII ones counted in bytes."""
    script = WireScript("return {KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], #ARGV}")
    reply = asyncio.run(RedisWire(URL).run(script, [key, key + "\u00e9"], ["caf\u00e9", 7, ""]))
    assert reply == [key.encode(), (key + "\u00e9").encode(), "caf\u00e9".encode(), b"7", b"", 3]


def test_replies_uncached_scripts_and_server_errors(key):
    client = redis.Redis.from_url(URL)
    client.set(key, "v")

    async def main():
        wire = RedisWire(URL)
        client.script_flush()
        first = await wire.run(ECHO, [key], [41, "x"])  # not cached: NOSCRIPT, then EVAL
        assert client.script_exists(ECHO.sha.decode()) == [True]
        again = await wire.run(ECHO, [key], [1, ""])
        with pytest.raises(ResponseError, match="boom"):
            await wire.run(WireScript("return redis.error_reply('boom')"), [], [])
        after_error = await wire.run(ECHO, [key], [2, "y"])  # the connection is still in step
        return first, again, after_error

    assert asyncio.run(main()) == ([42, b"x", key.encode(), b"v"], [2, b"", key.encode(), b"v"],
                                   [3, b"y", key.encode(), b"v"])  # fmt: skip
    assert client.get(key) == b"v"


def test_the_database_number_of_the_url_is_used(key):
    asyncio.run(RedisWire(URL).run(WireScript("return redis.call('SET', KEYS[1], 'w')"), [key], []))
    assert redis.Redis.from_url(URL).get(key) == b"w"


def test_a_connection_the_server_closed_is_replaced(key):
    client = redis.Redis.from_url(URL)

    async def main():
        wire = RedisWire(URL)
        await wire.run(ECHO, [key], [0, "a"])
        host, port = wire._idle[0].get_extra_info("sockname")[:2]
        assert client.client_kill(f"{host}:{port}")  # the wire's idle connection only (Redis is shared)
        # no await in between: the loop has not seen the close yet, so the command goes out on the dead connection
        return await wire.run(ECHO, [key], [5, "b"])

    assert asyncio.run(main())[:2] == [6, b"b"]


def test_no_server_is_redis_connection_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RedisConnectionError):
        asyncio.run(RedisWire(f"redis://127.0.0.1:{port}/0").run(ECHO, ["k"], [1, ""]))


def test_a_cancelled_command_never_leaves_its_reply_to_the_next():
    async def main():
        answered = 0

        async def server(reader, writer):  # answers each command with its number, the first one late
            nonlocal answered
            while await reader.read(65536):
                answered += 1
                number = answered
                if number == 1:
                    await asyncio.sleep(0.3)
                writer.write(b":%d\r\n" % number)
            writer.close()

        fake = await asyncio.start_server(server, "127.0.0.1", 0)
        wire = RedisWire(f"redis://127.0.0.1:{fake.sockets[0].getsockname()[1]}/0", max_connections=1)
        slow = asyncio.create_task(wire.run(ECHO, ["k"], [0, ""]))
        await asyncio.sleep(0.1)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        second = await wire.run(ECHO, ["k"], [0, ""])
        fake.close()
        return second

    assert asyncio.run(main()) == 2


def test_waiting_for_a_connection_ends_in_a_connection_error():
    async def main():
        async def server(reader, writer):  # never answers
            await reader.read(65536)
            await asyncio.sleep(5)

        fake = await asyncio.start_server(server, "127.0.0.1", 0)
        wire = RedisWire(f"redis://127.0.0.1:{fake.sockets[0].getsockname()[1]}/0", max_connections=1, wait_seconds=0.2)
        stuck = asyncio.create_task(wire.run(ECHO, ["k"], [0, ""]))
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(RedisConnectionError, match="No connection available"):
                await wire.run(ECHO, ["k"], [0, ""])
        finally:
            stuck.cancel()
            fake.close()

    asyncio.run(main())


def test_only_plain_redis_urls_take_the_lean_path():
    from gateway.admission.redis_wire import wire_supports

    assert wire_supports("redis://127.0.0.1:6379/13") and wire_supports("redis://user:secret@redis:6379")
    assert not wire_supports("rediss://redis:6380/0")
    assert not wire_supports("unix:///run/redis.sock")
    assert not wire_supports("redis://redis:6379?db=3")


def test_a_new_connection_authenticates_and_selects_the_database_first():
    async def main():
        received = []

        async def server(reader, writer):
            while b"EVALSHA" not in b"".join(received) and (data := await reader.read(65536)):
                received.append(data)
                for command in data.split(b"*")[1:]:
                    writer.write(b"+OK\r\n" if b"AUTH" in command or b"SELECT" in command else b":7\r\n")
            await writer.drain()
            writer.close()

        fake = await asyncio.start_server(server, "127.0.0.1", 0)
        port = fake.sockets[0].getsockname()[1]
        reply = await RedisWire(f"redis://quilt:p%40ss@127.0.0.1:{port}/5").run(ECHO, ["k"], [1, ""])
        fake.close()
        return reply, b"".join(received)

    reply, sent = asyncio.run(main())
    assert reply == 7
    assert sent == pack(b"AUTH", "quilt", "p@ss") + pack(b"SELECT", 5) + pack(b"EVALSHA", ECHO.sha, 1, "k", 1, "")


def test_a_reply_that_arrives_in_pieces_is_read_whole():
    """The reply is parsed from what has arrived: one split anywhere (inside a line, a bulk string, an array) waits for
    the rest, and a server error inside an array is raised once the whole reply is read (the next one in step)."""
    reply = b"*5\r\n:1\r\n$2\r\nok\r\n:-3\r\n*2\r\n$-1\r\n+x\r\n$0\r\n\r\n"
    failed = b"*2\r\n-ERR inside\r\n:1\r\n"

    async def main():
        async def server(reader, writer):  # each reply a byte at a time
            while data := await reader.read(65536):
                for _ in range(data.count(b"EVALSHA")):
                    for byte in (failed if b"fail" in data else reply):
                        writer.write(bytes([byte]))
                        await writer.drain()
                        await asyncio.sleep(0)

        fake = await asyncio.start_server(server, "127.0.0.1", 0)
        wire = RedisWire(f"redis://127.0.0.1:{fake.sockets[0].getsockname()[1]}/0", max_connections=1)
        first = await wire.run(ECHO, ["k"], [0, ""])
        with pytest.raises(ResponseError, match="ERR inside"):
            await wire.run(ECHO, ["k"], [0, "fail"])
        again = await wire.run(ECHO, ["k"], [0, ""])
        fake.close()
        return first, again

    first, again = asyncio.run(main())
    assert first == again == [1, b"ok", -3, [None, b"x"], b""]


def test_commands_past_max_connections_wait_their_turn_in_order():
    """At most `max_connections` at once: the others wait, first come first served; one that gives up (cancelled, or
    past `wait_seconds`) while waiting takes no connection from the rest."""

    async def main():
        open_now, most, order = 0, 0, []

        async def server(reader, writer):  # answers each command with the number it carries, after a while
            nonlocal open_now, most
            open_now += 1
            most = max(most, open_now)
            while data := await reader.read(65536):
                await asyncio.sleep(0.02)
                number = int(data.rsplit(b"\r\n", 2)[-2])
                order.append(number)
                writer.write(b":%d\r\n" % number)
            open_now -= 1

        fake = await asyncio.start_server(server, "127.0.0.1", 0)
        url = f"redis://127.0.0.1:{fake.sockets[0].getsockname()[1]}/0"
        results = {}
        for connections in (1, 2):
            wire, commands = RedisWire(url, max_connections=connections, wait_seconds=5), []
            for number in range(6):
                commands.append(asyncio.create_task(wire.run(ECHO, ["k"], ["", number])))
                await asyncio.sleep(0.001)  # in this order
            commands[3].cancel()  # waiting for its turn
            replies = await asyncio.gather(*commands, return_exceptions=True)
            results[connections] = replies, most, list(order), wire._free
            for connection in wire._idle:
                connection.close()
            await asyncio.sleep(0.01)
            most, order[:] = 0, []
        impatient = RedisWire(url, max_connections=1, wait_seconds=0.005)
        first = asyncio.create_task(impatient.run(ECHO, ["k"], ["", 100]))
        await asyncio.sleep(0)
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await impatient.run(ECHO, ["k"], ["", 101])
        assert await first == 100
        assert await impatient.run(ECHO, ["k"], ["", 102]) == 102  # the one that timed out took no turn
        fake.close()
        return results, impatient._free

    results, impatient_free = asyncio.run(main())
    for connections, (replies, most, order, free) in results.items():
        assert isinstance(replies[3], asyncio.CancelledError)
        assert replies[:3] + replies[4:] == [0, 1, 2, 4, 5]
        assert most == connections and free == connections
        if connections == 1:  # strictly in turn
            assert order == [0, 1, 2, 4, 5]
    assert impatient_free == 1


def test_a_server_that_stops_answering_is_a_timeout_not_a_wait_forever():
    """A Redis that accepts and never answers (paused, or cut off without a reset) fails the command with
    redis-py's TimeoutError once `reply_seconds` pass, its connection closed; the wire waited for ever before, and
    with it every request whose admission or settle was on that connection. A quick server after it is answered."""
    async def main():
        async def silent(reader, writer):
            while await reader.read(65536):
                pass

        fake = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = fake.sockets[0].getsockname()[1]
        wire = RedisWire(f"redis://127.0.0.1:{port}/0", reply_seconds=0.3)
        started = asyncio.get_running_loop().time()
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(wire.run(ECHO, ["k"], [1, ""]), 10)
        waited = asyncio.get_running_loop().time() - started
        assert not wire._idle  # the silent connection is not used again
        fake.close()
        return waited

    assert 0.3 <= asyncio.run(main()) < 2.0
    assert asyncio.run(RedisWire(URL, reply_seconds=0.3).run(ECHO, ["k"], [1, ""]))[0] == 2
