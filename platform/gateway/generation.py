"""The one way into generation: a chat or completion request's bytes and headers, parsed, authenticated, admitted,
routed to an engine, relayed and settled. The ASGI entry (`gateway.asgi`) and the Django views (`gateway.views`, the
URLconf's and Django's test client's way in) both call `generate`; they differ only in how the bytes reach it and how
its answer is written.

`generate` answers with a Django response (a refusal, a failure or a whole answer, its hold settled) or a `Stream`,
whose SSE body owns the hold from then on: whoever writes it settles it (`relay.sse` does when it ends or is closed)."""

import asyncio
import logging
import uuid
from dataclasses import dataclass

from django.http import HttpResponse

from gateway import relay, request_reports
from gateway.admission import admission_peek
from gateway.caller import authorize, cached_caller_and_target
from gateway.connections import STORE_DOWN
from gateway.errors import ApiError, service_unavailable
from gateway.openai_request import parse_body, parse_chat, parse_completion
from gateway.refusals import ratelimit_headers
from gateway.request_guard import json_content_type_check

log = logging.getLogger(__name__)

ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}  # by the chain's `kind`


@dataclass(slots=True)
class Stream:
    """A streamed answer: its SSE body (the engine's stream opened, its first events read) and the head's own
    headers (the rate-limit headers); the SSE headers and x-request-id are the writer's to add."""

    body: relay.SseBody
    headers: dict[str, str]
    request_id: str


async def generate(
    *, kind: str, raw: bytes, content_type: str, authorization: str, received: float
) -> HttpResponse | Stream:
    """A POSTed chat (`kind` "chat") or completion ("completion") request, answered. `content_type`: the request's
    media type; `received`: time.monotonic() when the gateway received the request (the request log's times start
    there). Every answer carries the request's id (x-request-id, and the completion's own id)."""
    request_id = uuid.uuid4().hex
    try:
        try:
            exchange, headers = await admit(kind=kind, raw=raw, content_type=content_type,
                                            authorization=authorization, request_id=request_id, received=received)  # fmt: skip
            if exchange.generation.stream:
                return Stream(await relay.open_stream(exchange, headers), headers, request_id)
            response = await relay.respond(exchange, headers)
        except ApiError as error:
            response = await error_response(error)
    except asyncio.CancelledError:
        raise
    except Exception as error:
        response = failed(error, method="POST", path=ROUTES[kind], request_id=request_id)
    response["x-request-id"] = request_id
    return response


async def admit(
    *, kind: str, raw: bytes, content_type: str, authorization: str, request_id: str, received: float
) -> tuple[relay.Exchange, dict]:
    """The request parsed, its caller authenticated and its budget held: the exchange and the rate-limit headers. An
    ApiError once the caller is known carries it, and goes to the caller's request log as a refusal."""
    try:
        json_content_type_check(content_type)
        body = parse_body(raw)
    except ApiError as error:  # the key is checked first, as OpenAI does: without one, any body is a 401
        try:
            error.caller, _ = await authorize(authorization=authorization, model=None)
        except ApiError as refusal:
            request_reports.refused_anonymously(request_id=request_id, error=refusal, authorization=authorization)
            raise
        request_reports.refused(request_id=request_id, caller=error.caller, error=error, model=None, target=None)
        raise
    try:
        model = body.get("model")
        found = cached_caller_and_target(authorization=authorization, model=model)  # most requests: no coroutine
        caller, target = found if found is not None else await authorize(authorization=authorization, model=model)
    except ApiError as error:  # a model this key may not use, or none by that name; or the key refused
        if error.caller is not None:
            request_reports.refused(request_id=request_id, caller=error.caller, error=error, model=body.get("model"),
                                    target=None)  # fmt: skip
        else:
            request_reports.refused_anonymously(request_id=request_id, error=error, authorization=authorization,
                                                model=body.get("model"))  # fmt: skip
        raise
    try:
        generation = parse_chat(body) if kind == "chat" else parse_completion(body)
        return await relay.admit(request_id=request_id, caller=caller, target=target, generation=generation,
                                 received=received)  # fmt: skip
    except ApiError as error:
        error.caller = caller
        request_reports.refused(request_id=request_id, caller=caller, error=error, model=body.get("model"),
                                target=target)  # fmt: skip
        raise


async def error_response(error: ApiError) -> HttpResponse:
    """A refusal's answer: with the caller's rate-limit headers once the caller is known."""
    if error.caller is not None and not any(name.startswith("x-ratelimit-") for name in error.headers):
        window = await admission_peek(tenant_id=error.caller.tenant_id, key_prefix=error.caller.limits.key_prefix)
        error.headers |= ratelimit_headers(error.caller, window)
    return error.response()


def failed(error: Exception, *, method: str, path: str, request_id: str) -> HttpResponse:
    """An unexpected failure of the inference API, logged, as its answer: 503 when a store is down, else 500."""
    if isinstance(error, STORE_DOWN):
        log.warning("the inference API could not reach a store on %s %s (request %s): %r", method, path, request_id,
                    error)  # fmt: skip
        return service_unavailable().response()
    log.error("the inference API failed on %s %s (request %s)", method, path, request_id, exc_info=error)
    return ApiError(500, "The server failed to handle this request.", code="internal_error").response()
