"""The OpenAI-compatible inference API as Django views (the URLconf's; native async, DRF's are synchronous). Chat
and completions reach the one generation chain (`gateway.generation`) with the request's body and headers; the
models' views authenticate (one blocking call, cached) and list."""

import json
import time
import uuid

from asgiref.sync import sync_to_async
from django.http import HttpResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from gateway import relay
from gateway.admission import admission_peek
from gateway.caller import Caller, Target, authorize, caller_models
from gateway.errors import ApiError
from gateway.generation import Stream, error_response, generate
from gateway.refusals import ratelimit_headers

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


async def _refused_method(request, request_id: str) -> HttpResponse:
    _method(request, "POST")  # raises: called for the generation routes' other methods
    raise AssertionError(request.method)


async def _generation(request, kind: str) -> HttpResponse:
    if request.method != "POST":
        return await _answer(request, _refused_method)
    answer = await generate(
        kind=kind, raw=request.body, content_type=request.content_type,
        authorization=request.META.get("HTTP_AUTHORIZATION", ""),
        received=getattr(request, "received", None) or time.monotonic(),  # set by gateway.asgi; not in tests' client
    )  # fmt: skip
    if not isinstance(answer, Stream):
        return answer
    response = StreamingHttpResponse(relay.sse(answer.body))
    for name, value in (relay.SSE_HEADERS | answer.headers).items():
        response[name] = value
    response["x-request-id"] = answer.request_id
    return response


@csrf_exempt
async def chat_completions(request) -> HttpResponse:
    return await _generation(request, "chat")


@csrf_exempt
async def completions(request) -> HttpResponse:
    return await _generation(request, "completion")


async def _models(request, request_id: str) -> HttpResponse:
    _method(request, "GET")
    caller, targets = await _list_models(authorization=request.headers.get("Authorization", ""))
    return await _with_ratelimit(_json({"object": "list", "data": [_model_object(t, caller) for t in targets]}), caller)


async def _model(request, request_id: str, *, name: str) -> HttpResponse:
    _method(request, "GET")
    caller, target = await authorize(authorization=request.headers.get("Authorization", ""), model=name)
    return await _with_ratelimit(_json(_model_object(target, caller)), caller)


async def models(request) -> HttpResponse:
    return await _answer(request, _models)


async def model(request, name: str) -> HttpResponse:
    return await _answer(request, lambda r, rid: _model(r, rid, name=name))
