"""GenerateStream against a scripted engine: its events are the engine's lines as JSON reads them, odd spacing too,
and a line that is not JSON breaks the stream; the request is one HTTP/1.1 POST with the engine's token and the
payload as JSON."""

import asyncio
import json

import pytest

from gateway.engine_client import EngineBroke, EngineRef, GenerateStream

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"


def events_of(lines: list[bytes], requests: list[bytes] | None = None, payload: dict | None = None) -> list[dict] | str:
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
                stream.finished = stream.finished or any(event.get("type") == "final" for event in events)  # the exchange's
        except EngineBroke as broke:
            return str(broke)
        finally:
            await stream.close()
            server.close()
        return seen

    return asyncio.run(main())


FINAL = b'{"type":"final","usage":{}}'


@pytest.mark.parametrize("line", [
    b'{"type":"delta","text":" w","token_ids":[7]}', b'{"type": "delta", "text": "\\u00e9\\n"}',
    b' {"type":"delta"}', b'{"type":"delta"}\r', b'\t{"type":"delta"} ', '{"type":"delta","text":"é"}'.encode(),
], ids=["compact", "spaced", "leading-space", "carriage-return", "tab-and-space", "utf-8"])  # fmt: skip
def test_each_event_is_its_line_as_json_reads_it(line):
    assert events_of([line, b"", FINAL]) == [json.loads(line), json.loads(FINAL)]
    assert events_of([line, FINAL + b"\n"]) == [json.loads(line), json.loads(FINAL)]


@pytest.mark.parametrize("line", [b'{"type":"delta"} x', b'{"type":"delta"', b"\xef\xbb\xbf{}", b"nope", b"{}{}"],
                         ids=["extra-data", "cut", "bom", "not-json", "two"])  # fmt: skip
def test_a_line_that_is_not_json_breaks_the_stream(line):
    with pytest.raises(ValueError):
        json.loads(line.decode())
    assert events_of([line, FINAL]).startswith("e: the stream broke: DecodeError(")


def test_the_events_before_a_line_that_is_not_json_are_read_first():
    seen = []

    async def main():
        async def engine(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = b'{"type":"delta","n":1}\n{"type":"delta","n":2}\nnope\n'
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
    assert seen == [[{"type": "delta", "n": 1}, {"type": "delta", "n": 2}]]


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
    assert events_of([b'{"type":"delta"}']) == "e: the stream ended before the request finished"


@pytest.mark.parametrize("payload", [
    {"prompt": "w1 w2", "sampling": {"max_tokens": 4, "temperature": 0.7, "top_p": 1.0, "stop": ["\n"]}, "stream": True,
     "adapter": None, "weight": 1, "metadata": {"tenant_id": 3, "model": "m"}},
    {"messages": [{"role": "user", "content": "é \u2028 \U0001f600 \"q\" \\ \x00"}], "n": [1e100, -0.0, 2**70]},
], ids=["completion", "odd-text-and-numbers"])  # fmt: skip
def test_the_payload_is_sent_as_json_that_reads_back_as_itself(payload):
    requests = []
    events_of([FINAL], requests, payload)
    assert json.loads(requests[0].split(b"\r\n\r\n", 1)[1]) == payload
