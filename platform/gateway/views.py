"""The OpenAI-compatible inference API: native async views (DRF's are synchronous). Thin: authenticate and
resolve (one blocking call), parse, then hand the request to the relay."""

import asyncio
import json
import logging
import time
import uuid

from asgiref.sync import sync_to_async
from django.http import HttpResponse
from django.views.decorators.csrf import csrf_exempt

from gateway import relay, request_reports
from gateway.admission import admission_peek
from gateway.caller import Caller, Target, cached_caller_and_target, caller_and_target, caller_models
from gateway.errors import ApiError
from gateway.openai_request import parse_body, parse_chat, parse_completion
from gateway.refusals import ratelimit_headers
from gateway.request_guard import json_content_type_check

log = logging.getLogger(__name__)

_lookup = sync_to_async(caller_and_target, thread_sensitive=False)
# Lookups running now, by what they look up. When a key's cache entry lapses or a change clears the cache, every
# request then in flight with that key would read the database at once (50 concurrent streams: 50 lookups of ~5 ms of
# CPU each); instead one reads it and the others wait for it, then take its result from the cache.
_looking_up: dict[tuple[str, object], asyncio.Future] = {}


async def _authorize(*, authorization: str, model: str | None) -> tuple[Caller, Target | None]:
    cached = cached_caller_and_target(authorization=authorization, model=model)
    if cached is not None:
        return cached
    loop, what = asyncio.get_running_loop(), (authorization, model if isinstance(model, str) else None)
    running = _looking_up.get(what)
    if running is not None and running.get_loop() is loop:
        await asyncio.shield(running)  # it never fails: its outcome is the cache's
        cached = cached_caller_and_target(authorization=authorization, model=model)
        return cached or await _lookup(authorization=authorization, model=model)  # refused (never cached) or changed
    done = _looking_up[what] = loop.create_future()
    try:
        return await _lookup(authorization=authorization, model=model)
    finally:
        if _looking_up.get(what) is done:
            del _looking_up[what]
        done.set_result(None)

_list_models = sync_to_async(caller_models, thread_sensitive=False)


def _model_object(target: Target, caller: Caller) -> dict:
    body = {"id": target.name, "object": "model", "created": target.created, "owned_by": "quilt"}
    if target.digest is not None:
        body |= {"owned_by": caller.tenant_slug, "parent": target.base_model, "version": target.adapter_version}
    return body


async def _with_ratelimit(response: HttpResponse, caller: Caller) -> HttpResponse:
    window = await admission_peek(tenant_id=caller.tenant_id, key_prefix=caller.limits.key_prefix)
    for name, value in ratelimit_headers(caller, window).items():
        response[name] = value
    return response


def _json(body: dict, status: int = 200) -> HttpResponse:
    return HttpResponse(json.dumps(body), status=status, content_type="application/json")


async def error_response(error: ApiError) -> HttpResponse:
    """A refusal's answer: with the caller's rate-limit headers once the caller is known."""
    if error.caller is not None and not any(name.startswith("x-ratelimit-") for name in error.headers):
        window = await admission_peek(tenant_id=error.caller.tenant_id, key_prefix=error.caller.limits.key_prefix)
        error.headers |= ratelimit_headers(error.caller, window)
    return error.response()


async def _answer(request, handle) -> HttpResponse:
    request_id = uuid.uuid4().hex
    try:
        response = await handle(request, request_id)
    except ApiError as error:
        response = await error_response(error)
    response["x-request-id"] = request_id
    return response


def _method(request, allowed: str) -> None:
    if request.method != allowed:
        raise ApiError(405, f"Method {request.method} is not allowed here; use {allowed}.", code="method_not_allowed",
                       headers={"Allow": allowed})  # fmt: skip


async def generation_admit(
    *, kind: str, raw: bytes, content_type: str, authorization: str, request_id: str, received: float
) -> tuple[relay.Exchange, dict]:
    """A POSTed chat or completion request, authenticated, parsed and admitted (the ASGI entry's fast path calls it
    too); an ApiError once the caller is known carries it, and goes to the caller's request log as a refusal.
    `received`: time.monotonic() when the gateway received the request (the log's times start there)."""
    try:
        json_content_type_check(content_type)
        body = parse_body(raw)
    except ApiError as error:  # the key is checked first, as OpenAI does: without one, any body is a 401
        try:
            error.caller, _ = await _authorize(authorization=authorization, model=None)
        except ApiError as refusal:
            request_reports.refused_anonymously(request_id=request_id, error=refusal, authorization=authorization)
            raise
        request_reports.refused(request_id=request_id, caller=error.caller, error=error, model=None, target=None)
        raise
    try:
        model = body.get("model")
        found = cached_caller_and_target(authorization=authorization, model=model)  # most requests: no coroutine
        caller, target = found if found is not None else await _authorize(authorization=authorization, model=model)
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


async def _generate(request, request_id: str, *, kind: str) -> HttpResponse:
    _method(request, "POST")
    exchange, headers = await generation_admit(
        kind=kind, raw=request.body, content_type=request.content_type,
        authorization=request.META.get("HTTP_AUTHORIZATION", ""), request_id=request_id,
        received=getattr(request, "received", None) or time.monotonic(),  # set by gateway.asgi; not in tests' client
    )  # fmt: skip
    return await relay.respond(exchange, headers)


@csrf_exempt
async def chat_completions(request) -> HttpResponse:
    return await _answer(request, lambda r, rid: _generate(r, rid, kind="chat"))


@csrf_exempt
async def completions(request) -> HttpResponse:
    return await _answer(request, lambda r, rid: _generate(r, rid, kind="completion"))


async def _models(request, request_id: str) -> HttpResponse:
    _method(request, "GET")
    caller, targets = await _list_models(authorization=request.headers.get("Authorization", ""))
    return await _with_ratelimit(_json({"object": "list", "data": [_model_object(t, caller) for t in targets]}), caller)


async def _model(request, request_id: str, *, name: str) -> HttpResponse:
    _method(request, "GET")
    caller, target = await _authorize(authorization=request.headers.get("Authorization", ""), model=name)
    return await _with_ratelimit(_json(_model_object(target, caller)), caller)


async def models(request) -> HttpResponse:
    return await _answer(request, _models)


async def model(request, name: str) -> HttpResponse:
    return await _answer(request, lambda r, rid: _model(r, rid, name=name))
