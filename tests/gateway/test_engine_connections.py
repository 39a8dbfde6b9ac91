"""The gateway's connections to an engine, against a tiny HTTP server that plays the engine: an answer read to its
end leaves its connection for the next request, one not read to its end closes it (the engine aborts the request);
a kept-alive connection the engine closed is replaced and the request sent again; an engine that cannot be reached
or says nothing is unavailable, one that falls silent or dies mid-stream breaks the stream. On asyncio's loop and on
uvloop's (the gateway's, under uvicorn)."""

import asyncio
import socket
import struct

import pytest

from engine.contract import Delta, Final
from engine.contract.channel import CHANNEL_PATH
from gateway import engine_client
from gateway.engine_client import EngineBroke, EngineRef, EngineUnavailable, GenerateStream
from tests.gateway.engine_streams import LOOPS, read_all, run

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
DELTA_LINE = b'{"type":"delta","request_id":"r","index":0,"text":" w","token_ids":[7]}\n'
FINAL = b'{"type":"final","request_id":"r","finish_reason":"stop"}\n'
DELTA, FINAL_EVENT = Delta(request_id="r", index=0, text=" w", token_ids=[7]), Final(request_id="r", finish_reason="stop")


def chunk(body: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(body), body)


class Engine:
    """A scripted engine: `answer(reader, writer)` per request (its head and body read first); counts the
    connections, the requests, and the connections the gateway closed."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head.split(b" ", 2)[1] + b" " + await reader.readexactly(length))
                if await self.answer(reader, writer) == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client += 1
        writer.close()

    async def __aenter__(self) -> EngineRef:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return EngineRef(name="e", url=url, token="t", pool="", gpu_price_per_hour="0", resident=frozenset(), load=0)

    async def __aexit__(self, *_):
        self.server.close()


async def until_closed(reader) -> None:
    """Waits, as a slow engine, until the gateway closes the connection."""
    assert await reader.read(1) == b""
    raise ConnectionResetError("the gateway closed the connection")


@pytest.mark.parametrize("loop", LOOPS)
def test_an_answer_read_to_its_end_leaves_its_connection_for_the_next_and_one_not_read_closes_it(loop):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(DELTA_LINE))
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(chunk(FINAL) + b"0\r\n\r\n")
            await writer.drain()

        engine = Engine(answer)
        async with engine as ref:
            for _ in range(3):
                stream = await GenerateStream(ref, {"prompt": "x"}).open()
                assert await read_all(stream) == [DELTA, FINAL_EVENT]
                await stream.close()
            after_three = engine.connections
            stream = await GenerateStream(ref, {"prompt": "x"}).open()
            await stream.close()  # not read to its end: its connection closes, and the engine aborts the request
            await asyncio.sleep(0.05)
            closed = engine.closed_by_client
            stream = await GenerateStream(ref, {"prompt": "x"}).open()
            await read_all(stream)
            return after_three, closed, engine.connections

    assert run(main, loop) == (1, 1, 2)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_closed_a_kept_connection_gets_the_request_again_on_a_new_one(loop):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(FINAL) + b"0\r\n\r\n")
            await writer.drain()
            return "close"  # without saying so (no `Connection: close`): the gateway keeps the connection

        engine = Engine(answer)
        async with engine as ref:
            first = await read_all(await GenerateStream(ref, {"prompt": "1"}).open())
            # at once: the loop has not read the engine's close yet, so the request goes out on the closed connection
            second = await read_all(await GenerateStream(ref, {"prompt": "2"}).open())
            return first == second, engine.connections, engine.requests

    same, connections, requests = run(main, loop)
    assert (same, connections) == (True, 2)
    assert requests == [b'/v1/generate {"prompt":"1"}', b'/v1/generate {"prompt":"2"}']


@pytest.mark.parametrize("channel", [None, CHANNEL_PATH], ids=["http", "channel"])
@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_cannot_be_reached_is_unavailable(loop, channel):
    async def main():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]  # nothing listens on it
        ref = EngineRef(name="e", url=f"http://127.0.0.1:{port}", token="t", pool="", gpu_price_per_hour="0",
                        resident=frozenset(), load=0, channel=channel)  # fmt: skip
        with pytest.raises(EngineUnavailable, match="^e: ClientConnectorError"):
            await GenerateStream(ref, {"request_id": "r", "prompt": "x"}).open()

    run(main, loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_says_nothing_is_unavailable_and_its_connection_closes(loop, settings):
    settings.QUILT_ENGINE_READ_TIMEOUT_SECONDS = 0.2

    async def main():
        async def answer(reader, writer):
            await until_closed(reader)

        engine = Engine(answer)
        async with engine as ref:
            with pytest.raises(EngineUnavailable, match="^e: SocketTimeoutError"):
                await GenerateStream(ref, {"prompt": "x"}).open()
            await asyncio.sleep(0.05)
            return engine.closed_by_client

    assert run(main, loop) == 1


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_falls_silent_mid_stream_breaks_it_after_what_arrived(loop, settings):
    settings.QUILT_ENGINE_READ_TIMEOUT_SECONDS = 0.2

    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(DELTA_LINE))
            await until_closed(reader)

        engine = Engine(answer)
        async with engine as ref:
            stream = await GenerateStream(ref, {"prompt": "x"}).open()
            first = await stream.events()
            with pytest.raises(EngineBroke, match="^e: the stream broke: SocketTimeoutError"):
                await stream.events()
            await stream.close()
            await asyncio.sleep(0.05)
            return first, engine.closed_by_client

    assert run(main, loop) == ([DELTA], 1)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("how", ["reset", "close"])
def test_an_engine_that_dies_mid_stream_breaks_it(loop, how):
    async def main():
        async def answer(reader, writer):
            writer.write(HEAD + chunk(DELTA_LINE))
            await writer.drain()
            await asyncio.sleep(0.05)
            if how == "reset":  # an RST, as from a killed engine
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            return "close"

        async with Engine(answer) as ref:
            stream = await GenerateStream(ref, {"prompt": "x"}).open()
            first = await stream.events()
            with pytest.raises(EngineBroke, match="^e: the stream broke: "):
                await stream.events()
            await stream.close()
            return first

    assert run(main, loop) == [DELTA]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_whole_answer_within_its_timeout_and_an_engine_too_slow_for_it(loop):
    async def main():
        async def answer(reader, writer):
            if len(engine.requests) == 2:
                await until_closed(reader)
            body = b'{"ok": true}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                         % (len(body), body))  # fmt: skip
            await writer.drain()

        engine = Engine(answer)
        async with engine as ref:
            whole = await engine_client.generate_whole(ref, {"stream": False}, timeout_s=5)
            with pytest.raises(EngineUnavailable, match="^e: TimeoutError"):
                await engine_client.generate_whole(ref, {"stream": False}, timeout_s=0.2)
            await asyncio.sleep(0.05)
            return whole, engine.closed_by_client

    assert run(main, loop) == ({"ok": True}, 1)
