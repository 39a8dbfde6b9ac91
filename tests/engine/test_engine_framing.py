"""How the engine frames its answers on the wire: a response's head leaves with its first body part
(`engine.server.http_protocol`), a streamed generate's events already waiting leave in one chunk and its final event
with the response's end (`engine.server.event_stream`). Each segment the engine saves is one
read and often one wake-up fewer in the gateway that reads it (docs/gateway-cpu.md)."""

import asyncio
import socket
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.outputs import RequestOutput, Usage
from engine.server.engine_loop import RequestEnd, RequestHandle
from engine.server.event_stream import EventStream, LastChunk, ndjson_events
from engine.server.http_protocol import EngineHttpProtocol
from engine.server.protocol import parse_generate

PAUSE_S = 0.4  # between the response's start and its first body part


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/slow":  # a stream whose first part comes a while after its start (a generate's first token)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await asyncio.sleep(PAUSE_S)
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await send({"type": "http.response.body", "body": b"last", "more_body": False})
    elif path == "/empty":  # a head and an end with no body part between
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    elif path == "/json":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"{}"})
    else:
        raise RuntimeError("fails before its start: uvicorn answers 500")


def serve(protocol) -> tuple[uvicorn.Server, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="critical", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, sock.getsockname()[1]


@pytest.fixture(scope="module", params=[EngineHttpProtocol, HttpToolsProtocol], ids=["engine", "uvicorn"])
def server(request):
    server, port = serve(request.param)
    yield request.param, port
    server.should_exit = True


def ask(port: int, path: str, method: str = "GET") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"{method} {path} HTTP/1.1\r\nhost: engine\r\n\r\n".encode())
    return sock


def read_all(sock: socket.socket, ending: bytes) -> bytes:
    data = b""
    sock.settimeout(5)
    while not data.endswith(ending):
        part = sock.recv(65536)
        assert part, data
        data += part
    return data


def without_date(response: bytes) -> bytes:
    return b"\r\n".join(line for line in response.split(b"\r\n") if not line.startswith(b"date: "))


@pytest.fixture(scope="module")
def uvicorn_answers():
    """What uvicorn's own protocol writes for each path (the bytes the engine's must match)."""
    server, port = serve(HttpToolsProtocol)
    try:
        yield {path: without_date(read_all(ask(port, path), ending))
               for path, ending in (("/slow", b"0\r\n\r\n"), ("/empty", b"\r\n\r\n"), ("/json", b"{}"))}
    finally:
        server.should_exit = True


def test_the_head_waits_for_the_first_body_part_and_leaves_with_it():
    server, port = serve(EngineHttpProtocol)
    try:
        sock = ask(port, "/slow")
        sock.settimeout(PAUSE_S / 2)
        with pytest.raises(TimeoutError):  # uvicorn's own protocol writes the head at once, alone
            sock.recv(65536)
        sock.settimeout(5)
        first = sock.recv(65536)  # one write: the head and the first part
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\n\r\n5\r\nfirst\r\n" in first
    finally:
        server.should_exit = True


@pytest.mark.parametrize("path, ending", [("/slow", b"0\r\n\r\n"), ("/empty", b"\r\n\r\n"), ("/json", b"{}")])
def test_the_bytes_are_uvicorns_own(server, uvicorn_answers, path, ending):
    _, port = server
    assert without_date(read_all(ask(port, path), ending)) == uvicorn_answers[path]


def test_a_kept_connection_serves_the_next_request_and_a_head_request(server):
    _, port = server
    sock = ask(port, "/json")
    assert read_all(sock, b"{}").startswith(b"HTTP/1.1 200 OK")
    sock.sendall(b"HEAD /json HTTP/1.1\r\nhost: engine\r\n\r\n")  # a head with no body part after it
    assert read_all(sock, b"\r\n\r\n").startswith(b"HTTP/1.1 200 OK")
    sock.sendall(b"GET /json HTTP/1.1\r\nhost: engine\r\n\r\n")
    assert read_all(sock, b"{}").endswith(b"\r\n\r\n{}")


def test_a_failure_before_the_start_is_uvicorns_500(server):
    _, port = server
    answer = read_all(ask(port, "/fails"), b"Internal Server Error")
    assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")


def _messages(chunks: list[bytes]) -> list[dict]:
    async def body():
        for chunk in chunks:
            yield chunk

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.sleep(60)

    response = EventStream(body(), media_type="application/x-ndjson")
    asyncio.run(response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send))
    return sent


def test_the_last_chunk_leaves_with_the_responses_end():
    sent = _messages([b"a\n", LastChunk(b"b\nfinal\n")])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"a\n", True), (b"b\nfinal\n", False)]


def test_a_stream_without_its_last_chunk_ends_as_starlettes():
    sent = _messages([b"a\n"])
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [(b"a\n", True), (b"", False)]


def _output(text: str, tokens: list[int], *, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="framed", index=0, prompt_token_ids=[1, 2], token_ids=tokens,
                         new_token_ids=tokens[-1:], text=text, finished=finished,
                         finish_reason="length" if finished else None, usage=Usage(prompt_tokens=2))  # fmt: skip


def _chunks(queued: list[tuple], *, later: list[tuple] = ()) -> tuple[list[bytes], list[str]]:
    """What `ndjson_events` yields for a handle whose first item is `queued[0]`, the rest of `queued` already
    waiting, and `later` put once the generator has asked for more."""
    handle = RequestHandle(request=parse_generate({"request_id": "framed", "prompt": "x", "stream": True}),
                           prompts=[[1, 2]], arrival=0.0)  # fmt: skip
    abandoned: list[str] = []

    async def run():
        for item in queued[1:]:
            handle.events.put_nowait(item)
        chunks = []
        stream = ndjson_events(handle, queued[0], abandoned.append)
        async for chunk in stream:
            chunks.append(chunk)
            if handle.events.empty():
                for item in later:
                    handle.events.put_nowait(item)
        return chunks

    return asyncio.run(run()), abandoned


def test_events_already_waiting_leave_in_one_chunk_the_final_one_last():
    one, two = _output("a", [5]), _output("ab", [5, 6])
    end = ("end", RequestEnd(finish_reason="length", usage=Usage(prompt_tokens=2, completion_tokens=2), e2e_ms=1.0,
                             outputs=[_output("ab", [5, 6], finished=True)]))  # fmt: skip
    chunks, abandoned = _chunks([("output", one), ("output", two), end])
    assert len(chunks) == 1 and type(chunks[0]) is LastChunk and not abandoned
    lines = chunks[0].decode().splitlines()
    assert [line.split('"type":"')[1].split('"')[0] for line in lines] == ["delta", "delta", "final"]
    assert '"text":"a"' in lines[0] and '"text":"b"' in lines[1]  # each delta only what is new

    chunks, _ = _chunks([("output", one)], later=[("output", two), end])  # nothing waits for what has not come
    assert [type(chunk) for chunk in chunks] == [bytes, LastChunk]
    assert chunks[0].count(b"\n") == 1 and chunks[1].count(b"\n") == 2


def test_a_stream_closed_before_its_end_is_abandoned():
    handle = RequestHandle(request=parse_generate({"request_id": "gone", "prompt": "x", "stream": True}),
                           prompts=[[1, 2]], arrival=0.0)  # fmt: skip
    abandoned: list[str] = []

    async def run():
        stream = ndjson_events(handle, ("output", _output("a", [5])), abandoned.append)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(run())
    assert abandoned == ["gone"]
