"""The benchmarks' lean client (benchmarks/lean_client.py) sends the request it was given, its head and body apart as
httpx sends them, and reads a streamed response as it arrives: checked against a real aiohttp server that records
each request and answers in pieces, and a plain socket that records each arrival."""

import asyncio
import json
import socket
import threading
import time

import pytest
from aiohttp import web

from benchmarks.lean_client import BODY_GAP_SECONDS, LeanClient, ResponseFailed, prepared_request

BODY = {"model": "bench", "prompt": "w10 w11 w12", "max_tokens": 2, "stream": True}
HEADERS = {"Authorization": "Bearer qk-test"}


class Server:
    """Answers each POST with `pieces`, each a write of its own `pause` seconds apart (streamed: chunked), or with
    `whole` (status, body) unstreamed; records the requests, their connections and the times the pieces left."""

    def __init__(self, pieces: list[bytes] = (), pause: float = 0.0, whole: tuple[int, bytes] | None = None):
        self.pieces, self.pause, self.whole = pieces, pause, whole
        self.requests: list[tuple[dict, bytes]] = []
        self.connections: set[int] = set()
        self.sent: list[float] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.connections.add(id(request.transport))
        self.requests.append((dict(request.headers), await request.read()))
        if self.whole is not None:
            return web.Response(status=self.whole[0], body=self.whole[1], content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for piece in self.pieces:
            await asyncio.sleep(self.pause)
            self.sent.append(time.perf_counter())
            await response.write(piece)
        await response.write_eof()
        return response

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


def test_it_sends_the_request_and_times_the_first_event_on_one_kept_connection():
    pieces = [b": comment\n\n", b'data: {"a":1}\n\n', b'data: {"b":2}\n\n' + b"data: [DONE]\n\n"]

    async def run():
        server = Server(pieces, pause=0.02)
        async with server as url:
            client = LeanClient()
            request = prepared_request(f"{url}/v1/completions", json_body=BODY, headers=HEADERS)
            firsts = [await client.post(request, b"data: {") for _ in range(2)]
            ended = time.perf_counter()
            other = dict(BODY, prompt="w13")
            await client.post(request, b"data: {", body=json.dumps(other).encode())
            await client.close()
        return server, firsts, ended

    server, firsts, ended = asyncio.run(run())
    assert len(server.connections) == 1  # three requests on one kept connection
    assert [json.loads(body) for _, body in server.requests] == [BODY, BODY, dict(BODY, prompt="w13")]
    assert all(headers["Authorization"] == "Bearer qk-test" for headers, _ in server.requests)
    for number, first in enumerate(firsts):  # the first piece with the marker is the second of its response
        assert server.sent[3 * number + 1] <= first < server.sent[3 * number + 2]
    assert firsts[1] < ended


def test_a_refusal_or_an_unstreamed_answer_is_a_failure_not_a_time():
    async def run(whole: tuple[int, bytes]) -> str:
        async with Server(whole=whole) as url:
            client = LeanClient()
            with pytest.raises(ResponseFailed) as failed:
                await client.post(prepared_request(f"{url}/v1/completions", json_body=BODY, headers=HEADERS),
                                  b"data: {")  # fmt: skip
            await client.close()
        return str(failed.value)

    assert asyncio.run(run((429, b"{}"))) == "HTTP/1.1 429 Too Many Requests"
    assert asyncio.run(run((200, b"{}"))) == "HTTP/1.1 200 OK"


def test_a_server_that_is_not_there_is_a_failure():
    async def run() -> None:
        client = LeanClient()
        try:
            await client.post(prepared_request("http://127.0.0.1:9/v1/completions", json_body=BODY, headers=HEADERS),
                              b"data: {")  # fmt: skip
        finally:
            await client.close()

    with pytest.raises(ResponseFailed, match="the connection broke"):
        asyncio.run(run())


def test_the_head_and_the_body_leave_in_two_writes_apart_as_httpx_sends_them():
    """What a server reads: the head alone, then the body the gap later (a plain socket records each arrival), so
    the gateway reads a request twice, as it does from httpx and the openai SDK. The gap is BODY_GAP_SECONDS in the
    benchmark; a longer one here, so that a loaded machine's slow wake-up of this server does not merge the two."""
    gap = 1000 * BODY_GAP_SECONDS
    listening = socket.create_server(("127.0.0.1", 0))
    arrivals: list[tuple[float, bytes]] = []

    def serve() -> None:
        connection, _ = listening.accept()
        with connection:
            received = b""
            while b'"stream":true}' not in received:
                data = connection.recv(65536)
                arrivals.append((time.perf_counter(), data))
                received += data
            connection.sendall(b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\n\r\n")

    thread = threading.Thread(target=serve)
    thread.start()
    url = f"http://127.0.0.1:{listening.getsockname()[1]}/v1/completions"

    async def run() -> None:
        client = LeanClient(body_gap_s=gap)
        with pytest.raises(ResponseFailed):
            await client.post(prepared_request(url, json_body=BODY, headers=HEADERS), b"data: {")
        await client.close()

    asyncio.run(run())
    thread.join(10)
    listening.close()
    (head_at, head), (body_at, body) = arrivals
    assert body_at - head_at >= gap / 2  # apart, as httpx's arrive
    assert head.endswith(b"\r\n\r\n") and b"content-length: %d" % len(body) in head.lower()
    assert b"transfer-encoding" not in head.lower() and json.loads(body) == BODY
