"""One inference request from admission to the last byte: hold the budget (`admit`), pick an engine and open its
stream (`exchange`), relay its events as an OpenAI response or SSE stream, and settle the hold with the actual usage
whatever happens.

The hold is settled once (`Exchange.settle`, after the engine stream is closed: closing it makes the engine abort the
request): by `_whole`'s `finally`, or by `sse`'s when a stream's body ends or is closed: after the stream's end
([DONE]) has been written, so that no client waits on the settle's stores. It is never cut short by the cancellation
that a client's disconnect delivers (a stream's settle is not cancelled at all, `exchange.settling`; the others are
shielded)."""

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from django.http import HttpResponse

from engine.contract import ADAPTER_UNAVAILABLE
from engine.contract.events import Delta
from gateway import request_reports
from gateway.admit import admit
from gateway.engine_client import EngineBroke
from gateway.errors import ApiError, adapter_unavailable
from gateway.exchange import Exchange
from gateway.openai_response import DONE, error_event

__all__ = ["SSE_HEADERS", "Exchange", "SseBody", "admit", "open_stream", "respond", "sse"]

log = logging.getLogger(__name__)


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def open_stream(exchange: Exchange, headers: dict[str, str]) -> "SseBody":
    """Opens the engine stream of a streamed request: its SSE body, which owns the hold from here on (settled when
    the body ends, or by its owner when it is left unread). An ApiError carries the rate-limit `headers`."""
    try:
        await _opened(exchange)
    except ApiError as error:
        error.headers = headers | error.headers
        raise
    return SseBody(exchange)


async def respond(exchange: Exchange, headers: dict[str, str]) -> HttpResponse:
    """Opens the engine stream of a request answered whole, and answers with the rate-limit `headers`; owns the hold
    from here on."""
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
        await _read_whole(exchange)
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


async def _read_whole(exchange: Exchange) -> None:
    """Reads the engine's events to the answer's end, applied to the response; EngineBroke if the engine fails the
    request."""
    stream = exchange.stream
    events, exchange.first = exchange.first, []
    try:
        while events is not None:
            for event in events:
                if event.__class__ is Delta:
                    exchange.apply_delta(event)
                else:
                    exchange.final(event)
            events = await stream.events()
    except EngineBroke:
        exchange.broke = True
        raise




class SseBody:
    """A streamed request's SSE body, written as the engine's events arrive. `take()` applies what has arrived to the
    response and gives the writes it makes: one per arrival from the engine (the chunks of events that came together
    leave together; nothing waits for an event that has not arrived). Then the body has `ended` (its last write
    made), or is `waiting`: await `arrival()` before taking more. Its owner settles the hold when it ends."""

    ended = False
    waiting = False

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.arrival = exchange.stream.arrival
        self._parts = (exchange, exchange.builder, exchange.stream, exchange.stream.response.lines,
                       exchange.generation.include_usage, not exchange.generation.continuous_usage)  # fmt: skip
        self._events, exchange.first = iter(exchange.first), []  # the first take's: those read at the open

    def take(self) -> list[bytes]:
        exchange, builder, stream, lines, usage_field, plain = self._parts
        events = self._events  # what is left of the events being applied (the first take's; exhausted after it)
        writes: list[bytes] = []
        chunks: list[bytes] = []
        try:
            if self.waiting:  # the engine's next arrival, or its failure
                self.waiting = False
                events = iter(stream.arrived())
            while True:
                for event in events:
                    if event.__class__ is Delta:
                        # the engine's common delta: text and tokens alone (a choice's first with its prompt's
                        # count, which only continuous usage shows: with it, every delta takes the long way)
                        if plain and event.logprobs is None and event.tool_calls is None \
                                and event.prompt_logprobs is None:  # fmt: skip
                            tokens = len(event.token_ids)
                            chunk = builder.text_chunk(event.index, event.text, tokens, usage_field)
                            if tokens and exchange.first_token_at is None:
                                exchange.first_token()
                            if chunk is not None:
                                chunks.append(chunk)
                        elif chunk := builder.chunk(exchange.apply_delta(event), with_usage_field=usage_field):
                            chunks.append(chunk)  # with log-probabilities or tool calls
                    else:
                        chunks += builder.finish_chunks(exchange.final(event), usage_field)
                        chunks += [builder.usage_chunk(), DONE] if usage_field else [DONE]
                if lines:  # arrived meanwhile, or a line that broke off the events before it (breaking the stream)
                    events = iter(stream.arrived())
                    continue
                if chunks:
                    writes.append(b"".join(chunks))
                    chunks = []
                if not stream.response.complete:
                    self.waiting = True
                    break
                if exchange.usage_reported and not stream.response.rest:
                    self.ended = True
                    break
                if writes:  # what follows reads on once they have left
                    break
                if stream.response.rest:  # the answer's last line, unterminated: a write of its own
                    events = iter(stream.arrived())
                    continue
                stream.ended()  # no final event: EngineBroke if the request did not finish
                writes.append(DONE)
                self.ended = True
                break
        except EngineBroke as broke:
            exchange.broke = True
            self.ended = True
            log.warning("engine stream broke for %s: %s", exchange.request_id, broke)
            if exchange.error_type == ADAPTER_UNAVAILABLE:
                chunks.append(error_event(message=adapter_unavailable(exchange.target.name).message, code=ADAPTER_UNAVAILABLE))
            else:
                chunks.append(error_event(message="The engine failed while generating this response.", code="engine_error"))
            writes.append(b"".join(chunks))
        return writes


async def sse(body: SseBody) -> AsyncIterator[bytes]:
    """The SSE body's writes, each as the engine's events arrive; the hold is settled when it ends or is closed."""
    try:
        while not body.ended:
            if body.waiting:
                await body.arrival()
            for chunk in body.take():
                yield chunk
    finally:
        await body.exchange.settle()  # not cancelled by the client's going meanwhile (`exchange.settling`)


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
