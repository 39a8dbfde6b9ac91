"""GenerateStream against a scripted engine: its events are the engine's lines as the contract's structs read them,
odd spacing too, and a line that is not JSON, or not an event, breaks the stream; the request is one HTTP/1.1 POST with the engine's token and the
payload as JSON."""

import asyncio
import json

import pytest

from engine.contract import Delta, Final
from gateway.engine_client import EngineBroke, EngineRef, GenerateStream

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"


def events_of(lines: list[bytes], requests: list[bytes] | None = None, payload: dict | None = None) -> list | str:
    """The events GenerateStream yields for an answer of these lines, or the EngineBroke that ended them; the
    request's bytes go to `requests`."""
    requests = [] if requests is None else requests

    async def main():
        async def engine(reader, writer):
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            requests.append(head + body)
            body = b"\n".join(lines)
            writer.write(HEAD + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        ref = EngineRef(name="e", url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", token="t", pool="",
                        gpu_price_per_hour="0", resident=frozenset(), load=0)  # fmt: skip
        stream = await GenerateStream(ref, payload or {"prompt": "x"}).open()
        seen = []
        try:
            while (events := await stream.events()) is not None:
                seen += events
                stream.finished = stream.finished or any(isinstance(event, Final) for event in events)  # the exchange's
        except EngineBroke as broke:
            return str(broke)
        finally:
            await stream.close()
            server.close()
        return seen

    return asyncio.run(main())


FINAL = b'{"type":"final","request_id":"r","finish_reason":"stop"}'
DELTA = b'{"type":"delta","request_id":"r","index":0,"text":" w","token_ids":[7]}'


def delta(text: str = " w", token_ids=(7,)) -> Delta:
    return Delta(request_id="r", index=0, text=text, token_ids=list(token_ids))


@pytest.mark.parametrize(("line", "event"), [
    (DELTA, delta()),
    (b'{"type": "delta", "request_id": "r", "index": 0, "text": "\\u00e9\\n", "token_ids": []}', delta("\u00e9\n", ())),
    (b" " + DELTA, delta()), (DELTA + b"\r", delta()), (b"\t" + DELTA + b" ", delta()),
    (DELTA.replace(b" w", "é".encode()), delta("é")),
], ids=["compact", "spaced", "leading-space", "carriage-return", "tab-and-space", "utf-8"])  # fmt: skip
def test_each_event_is_its_line_as_the_contract_reads_it(line, event):
    final = Final(request_id="r", finish_reason="stop")
    assert events_of([line, b"", FINAL]) == [event, final]
    assert events_of([line, FINAL + b"\n"]) == [event, final]


@pytest.mark.parametrize("line", [DELTA + b" x", DELTA[:-1], b"\xef\xbb\xbf" + DELTA, b"nope", DELTA + DELTA],
                         ids=["extra-data", "cut", "bom", "not-json", "two"])  # fmt: skip
def test_a_line_that_is_not_json_breaks_the_stream(line):
    with pytest.raises(ValueError):
        json.loads(line.decode())
    assert events_of([line, FINAL]).startswith("e: the stream broke: DecodeError(")


@pytest.mark.parametrize(("line", "field"), [
    (b'{"type":"delta"}', "missing required field `request_id`"),
    (DELTA.replace(b'"index":0', b'"index":"0"'), "at `$.index`"),
    (b'{"type":"usage","request_id":"r"}', "at `$.type`"),
    (FINAL.replace(b"}", b',"v":2}'), "generate stream version 2"),
], ids=["missing-field", "wrong-type", "unknown-type", "another-version"])  # fmt: skip
def test_a_line_that_is_not_an_event_of_this_contract_breaks_the_stream_naming_why(line, field):
    broke = events_of([line, FINAL])
    assert broke.startswith("e: the stream broke: ValidationError(") and field in broke, broke


def test_the_events_before_a_line_that_is_not_json_are_read_first():
    seen = []

    async def main():
        async def engine(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = DELTA.replace(b" w", b"1") + b"\n" + DELTA.replace(b" w", b"2") + b"\nnope\n"
            writer.write(HEAD + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
            await writer.drain()

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        ref = EngineRef(name="e", url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", token="t", pool="",
                        gpu_price_per_hour="0", resident=frozenset(), load=0)  # fmt: skip
        stream = await GenerateStream(ref, {"prompt": "x"}).open()
        try:
            seen.append(await stream.events())
            await stream.events()
        finally:
            await stream.close()
            server.close()

    with pytest.raises(EngineBroke, match="the stream broke"):
        asyncio.run(main())
    assert seen == [[delta("1"), delta("2")]]


def test_the_request_is_one_http_11_post_with_the_engines_token_and_its_json():
    requests = []
    events_of([FINAL], requests)
    head, body = requests[0].split(b"\r\n\r\n", 1)
    request_line, *fields = head.decode().split("\r\n")
    headers = {name.lower(): value for name, value in (field.split(": ", 1) for field in fields)}
    assert request_line == "POST /v1/generate HTTP/1.1"
    assert headers["host"].startswith("127.0.0.1:")
    assert headers["authorization"] == "Bearer t"
    assert headers["content-type"] == "application/json"
    assert (int(headers["content-length"]), json.loads(body)) == (len(body), {"prompt": "x"})


def test_a_stream_without_its_final_event_breaks():
    assert events_of([DELTA]) == "e: the stream ended before the request finished"


@pytest.mark.parametrize("payload", [
    {"prompt": "w1 w2", "sampling": {"max_tokens": 4, "temperature": 0.7, "top_p": 1.0, "stop": ["\n"]}, "stream": True,
     "adapter": None, "weight": 1, "metadata": {"tenant_id": 3, "model": "m"}},
    {"messages": [{"role": "user", "content": "é \u2028 \U0001f600 \"q\" \\ \x00"}], "n": [1e100, -0.0, 2**70]},
], ids=["completion", "odd-text-and-numbers"])  # fmt: skip
def test_the_payload_is_sent_as_json_that_reads_back_as_itself(payload):
    requests = []
    events_of([FINAL], requests, payload)
    assert json.loads(requests[0].split(b"\r\n\r\n", 1)[1]) == payload
