"""The gateway's HTTP client to engines, against scripted servers: the events of lines that arrived together come
together (the relay sends their chunks in one write), a line still on its way later; every way an engine can fail a
request (silence, a reset, broken framing, an idle connection it closed) and a reader that goes away end in
EngineHTTPError or a closed connection, never a hang or a connection handed to the next request out of step."""

import asyncio
import socket
import struct

import pytest
import uvloop

from gateway.engine_client import EngineRef, GenerateStream
from gateway.engine_http import EngineHTTP, EngineHTTPError

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


def run(main, loop: str = "asyncio"):
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(main())


class Engine:
    """A scripted engine: `answer(reader, writer)` per request; counts connections and what ended them."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.closed_by_client = 0

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if await self.answer(reader, writer) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/generate"

    async def __aexit__(self, *_):
        self.server.close()


async def until_closed(reader) -> None:
    """Waits, as a slow engine, until the client closes the connection."""
    assert await reader.read(1) == b""
    raise ConnectionResetError("the client closed the connection")


async def lines_of(response) -> list[bytes]:
    """The body's lines, read as GenerateStream.arrived reads them."""
    seen = []
    while True:
        if response.lines:
            seen.append(response.lines.popleft())
        elif not response.complete:
            await response.arrival()
        else:
            return seen + ([response.rest] if response.rest else [])


def test_the_events_that_arrived_together_come_together():
    """GenerateStream.arrived gives the events of the lines that arrived together at once (blank lines skipped), and
    a line still on its way after it has arrived: the relay writes each arrival's chunks in one write."""

    async def main():
        more = asyncio.Event()

        async def answer(reader, writer):
            await reader.readexactly(2)
            writer.write(HEAD + chunk(b'{"n": 1}\n{"n": 2}\n\n'))  # two lines and a blank one, in one write
            await writer.drain()
            await more.wait()
            writer.write(chunk(b'{"n": 3}\n') + b"0\r\n\r\n")
            await writer.drain()

        async with Engine(answer) as url:
            ref = EngineRef(name="e", url=url.removesuffix("/v1/generate"), token="t", pool="", gpu_price_per_hour="0",
                            resident=frozenset(), load=0)  # fmt: skip
            stream = GenerateStream(ref, {})
            stream.response = await EngineHTTP(connect_timeout=5, read_timeout=5).request("POST", url, headers={},
                                                                                          body=b"{}")  # fmt: skip
            seen = [stream.arrived(), stream.arrived()]
            more.set()
            await stream.arrival()
            seen.append(stream.arrived())
            stream.finished = True  # the scripted answer has no final event
            return seen, stream.ended()

    assert run(main) == ([[{"n": 1}, {"n": 2}], [], [{"n": 3}]], True)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_read_to_its_end_serves_the_next_request_and_aread_gives_the_exact_body(loop):
    bodies = [b'{"a": 1}\n{"b"', b"\n\n", b'{"c": [1, 2]}']

    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + b"".join(map(chunk, bodies)) + b"0\r\n\r\n")
            await writer.drain()

        async with Engine(answer) as url, Engine(answer) as other:
            client = EngineHTTP(connect_timeout=5, read_timeout=5)
            whole = await (await client.request("POST", url, headers={"X-A": "b"})).aread()
            lines = await lines_of(await client.request("GET", url, headers={}))
            await (await client.request("GET", other, headers={})).aread()
            return whole, lines

    whole, lines = run(main, loop)
    assert whole == b"".join(bodies)
    assert lines == b"".join(bodies).split(b"\n")


@pytest.mark.parametrize("loop", LOOPS)
def test_keep_alive_reuses_one_connection_and_one_not_read_to_its_end_closes(loop):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(b"{}\n"))
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        engine = Engine(answer)
        async with engine as url:
            client = EngineHTTP(connect_timeout=5, read_timeout=5)
            for _ in range(3):
                assert await (await client.request("POST", url, headers={})).aread() == b"{}\n"
            connections_after_three = engine.connections
            response = await client.request("POST", url, headers={})
            response.close()  # not read to its end: its connection closes (the engine aborts the request)
            await asyncio.sleep(0.05)
            closed = engine.closed_by_client
            assert await (await client.request("POST", url, headers={})).aread() == b"{}\n"
            return connections_after_three, closed, engine.connections

    assert run(main, loop) == (1, 1, 2)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_closes_an_idle_connection_gets_the_request_again_on_a_new_one(loop):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(b"{}\n") + b"0\r\n\r\n")
            await writer.drain()
            return "close"

        engine = Engine(answer)
        async with engine as url:
            client = EngineHTTP(connect_timeout=5, read_timeout=5)
            await (await client.request("POST", url, headers={})).aread()
            # no wait: the loop has not seen the engine's close yet, so the request goes out on the dead connection
            body = await (await client.request("POST", url, headers={})).aread()
            return body, engine.connections

    assert run(main, loop) == (b"{}\n", 2)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("when", ["head", "body"])
def test_an_engine_that_says_nothing_times_out_and_its_connection_closes(loop, when):
    async def main():
        async def answer(reader, writer):
            if when == "body":
                writer.write(HEAD + chunk(b'{"n": 1}\n'))
            await until_closed(reader)

        engine = Engine(answer)
        async with engine as url:
            client = EngineHTTP(connect_timeout=5, read_timeout=0.2)
            with pytest.raises(EngineHTTPError) as caught:
                response = await client.request("POST", url, headers={})
                assert await lines_of(response) == [b'{"n": 1}']  # what arrived is read before the failure
            await asyncio.sleep(0.05)
            cause = caught.value.__cause__
            while isinstance(cause, EngineHTTPError):
                cause = cause.__cause__
            return str(caught.value), type(cause), engine.closed_by_client

    assert run(main, loop) == ("reading from the engine failed: TimeoutError()", TimeoutError, 1)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_reset_mid_answer_fails_the_read_with_the_reset(loop):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(b'{"n": 1}\n'))
            await writer.drain()
            await asyncio.sleep(0.1)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # an RST, as from a killed engine
            return "close"

        async with Engine(answer) as url:
            response = await EngineHTTP(connect_timeout=5, read_timeout=5).request("POST", url, headers={})
            with pytest.raises(EngineHTTPError) as caught:
                await lines_of(response)
            return str(caught.value)

    message = run(main, loop)
    assert message.startswith("reading from the engine failed: ConnectionResetError(") or message == (
        "the engine closed the connection before the answer ended")


@pytest.mark.parametrize("loop", LOOPS)
def test_broken_chunked_framing_is_not_http_and_nothing_of_its_arrival_is_read(loop):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(b'{"n": 1}\n'))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.write(chunk(b'{"n": 2}\n') + b"zz\r\n")
            await writer.drain()
            await until_closed(reader)

        engine = Engine(answer)
        async with engine as url:
            response = await EngineHTTP(connect_timeout=5, read_timeout=5).request("POST", url, headers={})
            seen = []
            with pytest.raises(EngineHTTPError) as caught:
                while True:
                    while response.lines:
                        seen.append(response.lines.popleft())
                    await response.arrival()
            await asyncio.sleep(0.05)
            return seen, str(caught.value).startswith("the engine's answer is not HTTP"), engine.closed_by_client

    assert run(main, loop) == ([b'{"n": 1}'], True, 1)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("when", ["head", "body"])
def test_a_cancelled_reader_closes_its_connection(loop, when):
    async def main():
        async def answer(reader, writer):
            if when == "body":
                writer.write(HEAD + chunk(b'{"n": 1}\n'))
            await until_closed(reader)

        engine = Engine(answer)
        async with engine as url:
            client = EngineHTTP(connect_timeout=5, read_timeout=5)

            async def read():
                response = await client.request("POST", url, headers={})
                try:
                    await response.aread()
                finally:
                    response.close()  # as GenerateStream.close does

            task = asyncio.get_running_loop().create_task(read())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.05)
            return engine.closed_by_client, client._pool.idle.get(next(iter(client._pool.idle), None))

    assert run(main, loop) == (1, None)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reader_behind_stops_the_connection_reading_until_it_catches_up(loop):
    line = b'{"text": "%s"}\n' % (b"w" * 1000)

    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(line * 1000) + b"0\r\n\r\n")
            await writer.drain()

        async with Engine(answer) as url:
            client = EngineHTTP(connect_timeout=5, read_timeout=5)
            response = await client.request("POST", url, headers={})
            await asyncio.sleep(0.2)
            transport = response._connection.transport
            paused = not transport.is_reading()
            lines = await lines_of(response)
            return paused, len(lines), set(lines), transport.is_reading()

    assert run(main, loop) == (True, 1000, {line[:-1]}, True)


def test_reading_on_after_close_fails_at_once_instead_of_waiting_for_the_timeout():
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(b'{"n": 1}\n'))
            await until_closed(reader)

        async with Engine(answer) as url:
            response = await EngineHTTP(connect_timeout=5, read_timeout=5).request("POST", url, headers={})
            response.close()
            with pytest.raises(AssertionError):
                await asyncio.wait_for(response.aread(), 1)

    run(main)
