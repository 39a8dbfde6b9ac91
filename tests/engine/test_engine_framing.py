"""How the engine frames a streamed generate's answer (`engine.server.event_stream`): events already waiting leave in
one chunk and the final event with the response's end. Each segment the engine saves is one read and often one
wake-up fewer in the gateway that reads it (docs/gateway-cpu.md)."""

import asyncio

from engine.outputs import RequestOutput, Usage
from engine.server.engine_loop import RequestEnd, RequestHandle
from engine.server.event_stream import EventStream, LastChunk, ndjson_events
from engine.server.protocol import parse_generate


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
    handle = RequestHandle(request=parse_generate(b'{"request_id": "framed", "prompt": "x", "stream": true}'),
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
    handle = RequestHandle(request=parse_generate(b'{"request_id": "gone", "prompt": "x", "stream": true}'),
                           prompts=[[1, 2]], arrival=0.0)  # fmt: skip
    abandoned: list[str] = []

    async def run():
        stream = ndjson_events(handle, ("output", _output("a", [5])), abandoned.append)
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(run())
    assert abandoned == ["gone"]
