"""The benchmarks' lean client (benchmarks/lean_client.py) sends what httpx sends and reads a streamed response as
it arrives: checked against a real asyncio server that records each request's bytes and answers in pieces."""

import asyncio
import time

import httpx
import pytest

from benchmarks.lean_client import BODY_GAP_SECONDS, LeanClient, ResponseFailed, _Connection, raw_request

BODY = {"model": "bench", "prompt": "w10 w11 w12", "max_tokens": 2, "stream": True}
HEADERS = {"Authorization": "Bearer qk-test"}
CHUNKED = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Server:
    """Reads one request (head and Content-Length body) at a time and answers with `pieces`, each a write of its
    own `pause` seconds apart; records the requests' bytes and the times the pieces left."""

    def __init__(self, pieces: list[bytes], pause: float = 0.0):
        self.pieces, self.pause = pieces, pause
        self.requests: list[bytes] = []
        self.sent: list[float] = []
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))  # fmt: skip
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.pieces:
                    await asyncio.sleep(self.pause)
                    self.sent.append(time.perf_counter())
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):  # the client left, or the test ended
            writer.close()


async def _serving(server: _Server):
    listening = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    return listening, f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"


def test_it_sends_httpx_bytes_and_times_the_first_event_and_the_end():
    events = [b"data: {\"a\":1}\n\n", b"data: {\"b\":2}\n\n" + b"data: [DONE]\n\n"]
    pieces = [CHUNKED + _chunk(b": comment\n\n")[:5], _chunk(b": comment\n\n")[5:] + _chunk(events[0])[:7],
              _chunk(events[0])[7:], _chunk(events[1]) + b"0\r\n\r\n"]  # split inside size lines and data

    async def run():
        server = _Server(pieces, pause=0.02)
        listening, url = await _serving(server)
        async with listening:
            client = LeanClient()
            raw = raw_request("POST", f"{url}/v1/completions", json=BODY, headers=HEADERS)
            firsts = [await client.post(url, raw, b"data: {") for _ in range(2)]
            ended = time.perf_counter()
            async with httpx.AsyncClient() as reference:
                async with reference.stream("POST", f"{url}/v1/completions", json=BODY, headers=HEADERS) as response:
                    assert [line async for line in response.aiter_lines() if line] == \
                        [": comment", 'data: {"a":1}', 'data: {"b":2}', "data: [DONE]"]  # fmt: skip
            client.close()
        return server, raw, firsts, ended

    server, raw, firsts, ended = asyncio.run(run())
    assert server.connections == 2  # the lean client's two requests on one kept connection, httpx's on its own
    assert server.requests == [raw, raw, raw]  # httpx's own bytes, the same
    for number, first in enumerate(firsts):  # the first chunk with the marker is the third piece of its response
        assert server.sent[4 * number + 2] <= first < server.sent[4 * number + 3]
    assert firsts[1] < ended


def test_a_refusal_or_an_unstreamed_answer_is_a_failure_not_a_time():
    refusal = b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    whole = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

    async def run(answer: bytes):
        server = _Server([answer])
        listening, url = await _serving(server)
        async with listening:
            with pytest.raises(ResponseFailed) as failed:
                await LeanClient().post(url, raw_request("POST", f"{url}/v1/completions", json=BODY, headers=HEADERS),
                                        b"data: {")  # fmt: skip
        return str(failed.value)

    assert asyncio.run(run(refusal)) == "HTTP/1.1 429 Too Many Requests"
    assert asyncio.run(run(whole)) == "HTTP/1.1 200 OK"


class _Recorded:
    """A transport that keeps what is written to it, each write apart, with its time."""

    def __init__(self):
        self.writes: list[tuple[float, bytes]] = []

    def write(self, data: bytes) -> None:
        self.writes.append((time.perf_counter(), data))


def test_the_head_and_the_body_leave_in_two_writes_apart_as_httpx_sends_them():
    raw = raw_request("POST", "http://127.0.0.1:9/v1/completions", json=BODY, headers=HEADERS)
    connection = _Connection(asyncio.new_event_loop())
    connection.transport = _Recorded()
    connection.send(raw, b"data: {")
    (head_at, head), (body_at, body) = connection.transport.writes
    assert body_at - head_at >= BODY_GAP_SECONDS  # apart, as httpx's arrive
    assert head.endswith(b"\r\n\r\n") and b"\r\n\r\n" not in head[:-4]
    assert body == httpx.Request("POST", "http://127.0.0.1:9/", json=BODY).read()
    connection.loop.close()
