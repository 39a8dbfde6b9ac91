"""The engine stream's reading and relay as they were before one loop replaced them (main at e8fb5ad): GenerateStream's
`events`, the engine events' `event_read`, Exchange's `reads`/`_read`/`event_ready` and its `_try`'s first event,
relay's `_sse` and `_whole`, asgi's `_send_stream` and `_generate`'s stream part, as functions of the same
objects. The oracle of tests/gateway/test_stream_before.py; not used by the gateway.

One change since: the write that ends the stream ([DONE]) ends the response at once, before the settle, rather
than after it (`send_stream`, `stream_part`), and so leaves with the answer's last text when they come together
(`sse`: they were two writes, the text's before the settle); what the relay would write after it reaches no client."""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from django.http import HttpResponse

from engine.contract import ADAPTER_UNAVAILABLE, EVENT_FINAL, billed_cached_tokens
from gateway import metrics
from gateway.engine_client import AdapterUnavailable, EngineBroke, EngineUnavailable
from gateway.engine_events import USAGE_COUNTS, _logprobs
from gateway.engine_http import EngineHTTPError
from gateway.errors import ApiError, adapter_unavailable
from gateway.openai_response import DONE, Delta, Usage, error_event

_ZEROS = (0,) * len(USAGE_COUNTS)
_decode = json.JSONDecoder().raw_decode


class Read(NamedTuple):
    deltas: list[Delta]
    usage: dict | None = None
    error: str | None = None
    error_type: str | None = None
    kv_transfer: dict | None = None


def event_read(event: dict, *, vocabulary) -> Read:
    kind = event.get("type")
    if kind == "delta":
        prompt_logprobs, logprobs = event.get("prompt_logprobs"), event.get("logprobs")
        if prompt_logprobs or logprobs:
            logprobs = _logprobs(prompt_logprobs, vocabulary) + _logprobs(logprobs, vocabulary)
        delta = Delta(
            index=event.get("index", 0), text=event.get("text", ""), logprobs=logprobs or [], finish_reason=None,
            tokens=len(event.get("token_ids") or []), tool_calls=event.get("tool_calls") or [],
        )  # fmt: skip
        return Read([delta])
    if kind == "final":
        usage = event.get("usage") or {}
        deltas = [
            Delta(index=c.get("index", 0), text="", logprobs=[], finish_reason=c.get("finish_reason") or "stop")
            for c in event.get("choices") or []
        ]
        error = event.get("error") if event.get("finish_reason") == "error" else None
        counts = dict(zip(USAGE_COUNTS, map(usage.get, USAGE_COUNTS, _ZEROS), strict=True))
        if {*map(type, counts.values())} != {int}:
            counts = {name: int(usage.get(name) or 0) for name in USAGE_COUNTS}
        failed = event.get("finish_reason") == "error"
        transfer = usage.get("kv_transfer")
        return Read(deltas=deltas, usage=counts, error=error or ("the engine failed" if failed else None),
                    error_type=(event.get("error_type") or None) if failed else None,
                    kv_transfer=transfer if isinstance(transfer, dict) else None)  # fmt: skip
    return Read([])


async def events(stream) -> AsyncIterator[dict]:  # GenerateStream.events
    response = stream.response
    lines = response.lines
    try:
        while True:
            if lines:
                line = lines.popleft().decode()
            elif not response.complete:
                await response.arrival()
                continue
            elif response.rest:
                line, response.rest = response.rest.decode(), b""
            else:
                break
            if not line.strip():
                continue
            try:
                event, end = _decode(line)
            except ValueError:
                end = -1
            if end != len(line):
                event = json.loads(line)
            if event.get("type") == EVENT_FINAL:
                stream.finished = True
            yield event
    except (EngineHTTPError, ValueError) as error:
        raise EngineBroke(f"{stream.engine.name}: the stream broke: {error!r}") from error
    if not stream.finished:
        raise EngineBroke(f"{stream.engine.name}: the stream ended before the request finished")


def event_ready(exchange) -> bool:  # Exchange.event_ready, GenerateStream.event_ready, Response.line_ready
    return exchange.stream is not None and any(line.strip() for line in exchange.stream.response.lines)


async def opened(exchange) -> str:  # Exchange._try, from its first event
    stream = exchange.stream
    exchange._events = events(stream)
    try:
        first = await anext(exchange._events)
    except (EngineBroke, StopAsyncIteration):
        exchange.stream = None
        return EngineUnavailable.__name__
    if first.get("type") == EVENT_FINAL and first.get("error_type") == ADAPTER_UNAVAILABLE:
        exchange.stream = None
        return AdapterUnavailable.__name__
    exchange.first = [first]
    return "ok"


async def reads(exchange) -> AsyncIterator[Read]:
    try:
        first, exchange.first = exchange.first, []
        for event in first:
            yield read(exchange, event)
        async for event in exchange._events:
            yield read(exchange, event)
    except EngineBroke:
        exchange.broke = True
        raise


def read(self, event: dict) -> Read:  # Exchange._read
    read = event_read(event, vocabulary=self.vocabulary)
    for delta in read.deltas:
        self.builder.apply(delta)
        if self.first_token_at is None and delta.tokens:
            self.first_token_at = time.monotonic()
            metrics.ttft.labels(*self.labels).observe(self.first_token_at - self.started)
    if read.usage is not None:
        self.builder.usage = Usage(**read.usage)
        self.usage_reported = True
        if self.prefill is not None:
            self._count_transfer(read.kv_transfer)
            self.builder.usage.cached_tokens = billed_cached_tokens(
                decode_cached=self.builder.usage.cached_tokens, prefill_cached=self.prefill.cached_tokens)
    if read.error is not None:
        self.error_type = read.error_type
        raise EngineBroke(read.error)
    return read


async def whole(exchange) -> HttpResponse:  # relay._whole
    try:
        async for _ in reads(exchange):
            pass
    except EngineBroke:
        if exchange.error_type == ADAPTER_UNAVAILABLE:
            failed = adapter_unavailable(exchange.target.name)
        else:
            failed = ApiError(502, "The engine failed while generating this response; please retry.", code="engine_error")
        exchange.answer_status = failed.status
        raise failed from None
    except asyncio.CancelledError:
        exchange.answer_status = 499
        raise
    finally:
        await asyncio.shield(exchange.settle())
    return HttpResponse(json.dumps(exchange.builder.body(), separators=(",", ":")).encode(),
                        content_type="application/json")  # fmt: skip


async def sse(exchange) -> AsyncIterator[bytes]:  # relay._sse
    include_usage = exchange.generation.include_usage
    builder = exchange.builder
    chunks: list[bytes] = []
    try:
        async for got in reads(exchange):
            chunks += [chunk for delta in got.deltas if (chunk := builder.chunk(delta, with_usage_field=include_usage))]
            if got.usage is not None:
                chunks += [builder.usage_chunk(), DONE] if include_usage else [DONE]
            if chunks and not event_ready(exchange):
                yield b"".join(chunks)
                chunks = []
        if not exchange.usage_reported:
            chunks.append(DONE)
        if chunks:
            yield b"".join(chunks)
    except EngineBroke:
        if exchange.error_type == ADAPTER_UNAVAILABLE:
            chunks.append(error_event(message=adapter_unavailable(exchange.target.name).message, code=ADAPTER_UNAVAILABLE))
        else:
            chunks.append(error_event(message="The engine failed while generating this response.", code="engine_error"))
        yield b"".join(chunks)
    finally:
        await exchange.settle()


async def send_stream(chunks: AsyncIterator[bytes], send) -> None:  # asgi._send_stream
    ended = False
    async for chunk in chunks:
        if ended:
            continue
        ended = chunk.endswith(DONE)
        await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
    if not ended:
        await send({"type": "http.response.body", "body": b""})


async def stream_part(exchange, body, send, cycle, start) -> None:  # asgi._generate, after open_stream
    try:
        if cycle is None:
            await send(start)
        else:
            try:
                first = await anext(body, None)
            except BaseException:
                await send(start)
                raise
            if first is None:
                await send(start)
            else:
                ended = first.endswith(DONE)
                await cycle.start_with_body(start, {"type": "http.response.body", "body": first, "more_body": not ended})
                if ended:  # read on to the body's end (its settle); nothing more is sent
                    async for _ in body:
                        pass
                    return
        await send_stream(body, send)
    finally:
        if not exchange.settled:
            await asyncio.shield(exchange.settle())
