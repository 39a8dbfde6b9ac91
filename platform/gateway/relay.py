"""One inference request from admission to the last byte: hold the budget (`admit`), pick an engine and open its
stream (`exchange`), relay its events as an OpenAI response or SSE stream, and settle the hold with the actual usage
whatever happens.

The hold is owned by exactly one `finally` here: `Exchange.settle` runs once, after the engine stream is closed (closing
it makes the engine abort the request), and is never cut short by the cancellation that a client's disconnect
delivers (a stream's settle is not cancelled at all, `exchange.settling`; the others are shielded)."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from django.http import HttpResponse, StreamingHttpResponse

from engine.contract import ADAPTER_UNAVAILABLE
from gateway import request_reports
from gateway.admit import admit
from gateway.engine_client import EngineBroke
from gateway.errors import ApiError, adapter_unavailable
from gateway.exchange import Exchange
from gateway.openai_response import DONE, error_event

__all__ = ["SSE_HEADERS", "Exchange", "admit", "open_stream", "respond"]

log = logging.getLogger(__name__)


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def open_stream(exchange: Exchange, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """Opens the engine stream of a streamed request: its SSE body, which owns the hold from here on (settled when
    the body ends or is closed). An ApiError carries the rate-limit `headers`."""
    try:
        await _opened(exchange)
    except ApiError as error:
        error.headers = headers | error.headers
        raise
    return _sse(exchange)


async def respond(exchange: Exchange, headers: dict[str, str]) -> HttpResponse:
    """Opens the engine stream and answers; owns the hold from here on."""
    if exchange.generation.stream:
        response = StreamingHttpResponse(await open_stream(exchange, headers))
        for name, value in SSE_HEADERS.items():
            response[name] = value
    else:
        try:
            await _opened(exchange)
            response = await _whole(exchange)
        except ApiError as error:
            error.headers = headers | error.headers
            raise
    for name, value in headers.items():
        response[name] = value
    return response


async def _opened(exchange: Exchange) -> None:
    try:
        await exchange.open()
    except BaseException as error:
        await asyncio.shield(exchange.settle())
        if isinstance(error, ApiError):  # no engine generated for it: the log keeps it as a refusal
            request_reports.refused(request_id=exchange.request_id, caller=exchange.caller, error=error,
                                    model=exchange.target.name, target=exchange.target)  # fmt: skip
        raise


async def _whole(exchange: Exchange) -> HttpResponse:
    try:
        async for _ in exchange.reads():
            pass
    except EngineBroke as broke:
        log.warning("engine stream broke for %s: %s", exchange.request_id, broke)
        if exchange.error_type == ADAPTER_UNAVAILABLE:
            failed = adapter_unavailable(exchange.target.name)
        else:
            failed = ApiError(502, "The engine failed while generating this response; please retry.", code="engine_error")
        exchange.answer_status = failed.status
        raise failed from None
    except asyncio.CancelledError:
        exchange.answer_status = 499  # the client went away before its answer (nginx's "client closed request")
        raise
    finally:
        await asyncio.shield(exchange.settle())
    return HttpResponse(_json(exchange.builder.body()), content_type="application/json")


async def _sse(exchange: Exchange) -> AsyncIterator[bytes]:
    include_usage = exchange.generation.include_usage
    builder = exchange.builder
    chunks: list[bytes] = []
    sent = False
    try:
        async for read in exchange.reads():
            # One write per arrival from the engine: the chunks of events that came together (a final event's, the
            # usage chunk and [DONE] too) leave together; nothing waits for an event that has not arrived.
            chunks += [chunk for delta in read.deltas if (chunk := builder.chunk(delta, with_usage_field=include_usage))]
            if read.usage is not None:
                if chunks and not sent:  # the whole answer came at once: its text leaves now, not after the settle
                    yield b"".join(chunks)
                    chunks, sent = [], True
                chunks += [builder.usage_chunk(), DONE] if include_usage else [DONE]
            if chunks and not exchange.event_ready():
                yield b"".join(chunks)
                chunks, sent = [], True
        if not exchange.usage_reported:
            chunks.append(DONE)
        if chunks:
            yield b"".join(chunks)
    except EngineBroke as broke:
        log.warning("engine stream broke for %s: %s", exchange.request_id, broke)
        if exchange.error_type == ADAPTER_UNAVAILABLE:
            chunks.append(error_event(message=adapter_unavailable(exchange.target.name).message, code=ADAPTER_UNAVAILABLE))
        else:
            chunks.append(error_event(message="The engine failed while generating this response.", code="engine_error"))
        yield b"".join(chunks)
    finally:
        await exchange.settle()  # not cancelled by the client's going meanwhile (`exchange.settling`)


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
