"""The gateway's generate channel to an engine (engine.contract.channel), against a tiny websocket server that plays
the engine: requests share one channel and read their events as on HTTP; a refusal means what the same HTTP answer
means; an engine that closes the channel, or falls silent, breaks what it carried (unavailable before the first
message); the next request opens a new channel. On asyncio's loop and on uvloop's (the gateway's, under uvicorn)."""

import asyncio
import json

import pytest
from aiohttp import web

from engine.contract import Delta, Final
from engine.contract.channel import CHANNEL_PATH, ChannelHead, channel_message
from gateway.engine_client import (
    AdapterUnavailable,
    EngineBroke,
    EngineRef,
    EngineRejected,
    EngineUnavailable,
    GenerateStream,
)
from tests.gateway.engine_streams import LOOPS, read_all, run


def delta_line(request_id: str) -> bytes:
    return b'{"type":"delta","request_id":"%b","index":0,"text":" w","token_ids":[7]}\n' % request_id.encode()


def final_line(request_id: str) -> bytes:
    return b'{"type":"final","request_id":"%b","finish_reason":"stop"}\n' % request_id.encode()


def events_of(request_id: str) -> list:
    return [Delta(request_id=request_id, index=0, text=" w", token_ids=[7]),
            Final(request_id=request_id, finish_reason="stop")]  # fmt: skip


async def answered(ws, request: dict) -> None:
    """The common answer: a delta, then the final event in the request's last message."""
    request_id = request["request_id"]
    await ws.send_bytes(channel_message(ChannelHead(request_id), delta_line(request_id)))
    await asyncio.sleep(0.01)
    await ws.send_bytes(channel_message(ChannelHead(request_id, last=True), final_line(request_id)))


class ChannelEngine:
    """A scripted engine with a generate channel: `answer(ws, request)` per generate, each in a task of its own (a
    "close" answer closes the channel); counts the channels opened and keeps their Authorization headers."""

    def __init__(self, answer):
        self.answer = answer
        self.channels = 0
        self.authorizations: list[str] = []
        self.open: list[web.WebSocketResponse] = []

    async def _channel(self, request: web.Request) -> web.WebSocketResponse:
        self.channels += 1
        self.authorizations.append(request.headers.get("Authorization", ""))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.open.append(ws)

        async def serve(generate: dict) -> None:
            if await self.answer(ws, generate) == "close":
                await ws.close()

        tasks = set()
        async for message in ws:
            task = asyncio.create_task(serve(json.loads(message.data)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return ws

    async def __aenter__(self) -> EngineRef:
        app = web.Application()
        app.router.add_get(CHANNEL_PATH, self._channel)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        return EngineRef(name="e", url=f"http://{host}:{port}", token="t", pool="", gpu_price_per_hour="0",
                         resident=frozenset(), load=0, channel=CHANNEL_PATH)  # fmt: skip

    async def __aexit__(self, *_):
        for ws in self.open:  # the gateway keeps its channel: the server's shutdown would wait for it
            await ws.close()
        await self.runner.cleanup()


async def served(ref: EngineRef, request_id: str) -> list:
    stream = await GenerateStream(ref, {"request_id": request_id, "prompt": "x"}).open()
    try:
        return await read_all(stream)
    finally:
        await stream.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_requests_share_one_channel_and_read_their_events_as_on_http(loop):
    async def main():
        engine = ChannelEngine(answered)
        async with engine as ref:
            together = await asyncio.gather(*(served(ref, f"r{n}") for n in range(4)))
            later = await served(ref, "r9")
        return together, later, engine.channels, engine.authorizations

    together, later, channels, authorizations = run(main, loop)
    assert together == [events_of(f"r{n}") for n in range(4)]
    assert later == events_of("r9")
    assert (channels, authorizations) == (1, ["Bearer t"])


REFUSALS = [
    (
        400,
        {"type": "invalid_request_error", "message": "top_p must be in (0, 1]", "param": "sampling"},
        EngineRejected,
    ),
    (
        503,
        {"type": "unavailable_error", "message": "the engine is shutting down", "param": None},
        EngineUnavailable,
    ),
    (503, {"type": "adapter_unavailable", "message": "corrupt", "param": "adapter"}, AdapterUnavailable),
]


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("status", "error", "raised"), REFUSALS, ids=["invalid", "unavailable", "adapter"])
def test_a_refusal_on_the_channel_means_what_the_http_answer_means(loop, status, error, raised):
    async def main():
        async def refuse(ws, request):
            body = json.dumps({"error": error}).encode()
            await ws.send_bytes(channel_message(ChannelHead(request["request_id"], status, True), body))

        async with ChannelEngine(refuse) as ref:
            with pytest.raises(raised) as refused:
                await GenerateStream(ref, {"request_id": "r", "prompt": "x"}).open()
            return refused.value

    refused = run(main, loop)
    if raised is EngineRejected:
        assert (refused.status, refused.param, refused.message) == (
            400,
            "sampling",
            "top_p must be in (0, 1]",
        )


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_closes_the_channel_mid_stream_breaks_it_and_the_next_request_opens_another(loop):
    async def main():
        async def answer(ws, request):
            request_id = request["request_id"]
            if request_id == "doomed":
                await ws.send_bytes(channel_message(ChannelHead(request_id), delta_line(request_id)))
                await asyncio.sleep(0.05)
                return "close"
            await answered(ws, request)

        engine = ChannelEngine(answer)
        async with engine as ref:
            stream = await GenerateStream(ref, {"request_id": "doomed", "prompt": "x"}).open()
            first = await stream.events()
            with pytest.raises(EngineBroke, match="^e: the stream broke: ChannelLost"):
                await stream.events()
            await stream.close()
            return first, await served(ref, "next"), engine.channels

    first, after, channels = run(main, loop)
    assert first == events_of("doomed")[:1]
    assert (after, channels) == (events_of("next"), 2)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_that_closes_the_channel_before_answering_is_unavailable(loop):
    async def main():
        async def answer(ws, request):
            return "close"

        async with ChannelEngine(answer) as ref:
            with pytest.raises(EngineUnavailable, match="^e: ChannelLost"):
                await GenerateStream(ref, {"request_id": "r", "prompt": "x"}).open()

    run(main, loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_engine_silent_on_the_channel_is_unavailable_before_its_first_message_and_breaks_the_stream_after(
    loop, settings
):
    settings.QUILT_ENGINE_READ_TIMEOUT_SECONDS = 0.2

    async def main():
        async def answer(ws, request):
            request_id = request["request_id"]
            if request_id == "started":
                await ws.send_bytes(channel_message(ChannelHead(request_id), delta_line(request_id)))

        async with ChannelEngine(answer) as ref:
            with pytest.raises(EngineUnavailable, match="^e: TimeoutError"):
                await GenerateStream(ref, {"request_id": "silent", "prompt": "x"}).open()
            stream = await GenerateStream(ref, {"request_id": "started", "prompt": "x"}).open()
            first = await stream.events()
            with pytest.raises(EngineBroke, match="^e: the stream broke: TimeoutError"):
                await stream.events()
            await stream.close()
            return first

    assert run(main, loop) == events_of("started")[:1]
