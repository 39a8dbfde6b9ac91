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

from engine.contract import ADAPTER_UNAVAILABLE, EVENT_DELTA, EVENT_FINAL
from gateway import request_reports
from gateway.admit import admit
from gateway.engine_client import EngineBroke
from gateway.engine_events import delta_of
from gateway.errors import ApiError, adapter_unavailable
from gateway.exchange import Exchange
from gateway.openai_response import DONE, error_event

__all__ = ["SSE_HEADERS", "Exchange", "admit", "open_stream", "respond"]

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
    """Opens the engine stream and answers; owns the hold from here on."""
    if exchange.generation.stream:
        response = StreamingHttpResponse(_sse(await open_stream(exchange, headers)))
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
        await exchange.read_whole()
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


PLAIN_DELTA = frozenset(("type", "index", "text", "token_ids"))  # the engine's common event: text and tokens alone


class SseBody:
    """A streamed request's SSE body, written as the engine's events arrive. `take()` applies what has arrived to the
    response, up to the next write: one write per arrival from the engine (the chunks of events that came together
    leave together; nothing waits for an event that has not arrived), b"" when there is none. Then `ended` (its
    last write made), or `waiting`: await `arrival()` before taking more. Its owner settles the hold when it ends."""

    ended = False
    waiting = False
    _sent = False  # a write was made

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.arrival = exchange.stream.arrival
        self._parts = (exchange, exchange.builder, exchange.stream, exchange.generation.include_usage)
        self._events = iter(exchange.first)  # what is left of the events being applied: first, those read at the open
        exchange.first = []
        self._chunks: list[bytes] = []  # for the next write: the stream's end, when the text before it left alone

    def take(self) -> bytes:
        exchange, builder, stream, usage_field = self._parts
        chunks, self._chunks = self._chunks, []
        events = self._events
        lines = stream.response.lines
        try:
            if self.waiting:  # the engine's next arrival, or its failure
                self.waiting = False
                events = iter(stream.arrived())
            while True:
                for event in events:
                    kind = event.get("type")
                    if kind == EVENT_DELTA and event.keys() <= PLAIN_DELTA:
                        tokens = len(event.get("token_ids") or ())
                        chunk = builder.text_chunk(event.get("index", 0), event.get("text", ""), tokens, usage_field)
                        if tokens and exchange.first_token_at is None:
                            exchange.first_token()
                        if chunk is not None:
                            chunks.append(chunk)
                    elif kind == EVENT_DELTA:  # with log-probabilities or tool calls
                        delta = delta_of(event, vocabulary=exchange.vocabulary)
                        builder.apply(delta)
                        if exchange.first_token_at is None and delta.tokens:
                            exchange.first_token()
                        if chunk := builder.chunk(delta, with_usage_field=usage_field):
                            chunks.append(chunk)
                    elif kind == EVENT_FINAL:
                        for index, reason in exchange.final(event):
                            chunks.append(builder.finish_chunk(index, reason, usage_field))
                        end = [builder.usage_chunk(), DONE] if usage_field else [DONE]
                        if chunks and not self._sent:  # the whole answer came at once: its text leaves now, not
                            self._chunks = end  # with the stream's end, after the settle
                            self._events = events
                            self._sent = True
                            return b"".join(chunks)
                        chunks += end
                if lines:  # arrived meanwhile, or a line that broke off the events before it (breaking the stream)
                    events = iter(stream.arrived())
                    continue
                response = stream.response
                if not response.complete:
                    self.waiting = True
                    break
                if response.rest:  # the answer's last line, unterminated: a write of its own
                    if chunks:
                        break
                    events = iter(stream.arrived())
                    continue
                if not exchange.usage_reported:  # no final event: the stream's end comes in a write of its own
                    if chunks:
                        break
                    stream.ended()  # EngineBroke if the request did not finish
                    chunks.append(DONE)
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
        self._events = events
        if not chunks:
            return b""
        self._sent = True
        return b"".join(chunks)


async def _sse(body: SseBody) -> AsyncIterator[bytes]:
    """The SSE body as an iterator (Django's StreamingHttpResponse): settled when it ends or is closed."""
    try:
        while not body.ended:
            if body.waiting:
                await body.arrival()
            chunk = body.take()
            if chunk:
                yield chunk
    finally:
        await body.exchange.settle()  # not cancelled by the client's going meanwhile (`exchange.settling`)


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()
