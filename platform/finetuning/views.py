"""The Files and Fine-tuning APIs (/v1/files, /v1/fine_tuning/jobs) in OpenAI's shapes, for the `openai` package.

The gateway serves /v1/ with async views (gateway.asgi), so these are async too: the caller is resolved by the
gateway's own key authentication (the tenant comes from the key, never from the request), then one blocking
call runs the operation in a worker thread. Thin: parse, call one service or selector, shape the answer.
"""

import json
import uuid
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import HttpResponse
from django.http.multipartparser import MultiPartParserError
from django.views.decorators.csrf import csrf_exempt

from finetuning import selectors, services, wire
from finetuning.errors import FineTuningRefusal, not_found
from finetuning.storage import file_read
from gateway.admission import admission_acquire, admission_settle
from gateway.caller import Caller, cached_caller_and_target, caller_and_target
from gateway.errors import ApiError, invalid
from gateway.openai_request import parse_body
from gateway.refusals import ratelimit_headers, refusal
from tenancy.models import Tenant

_lookup = sync_to_async(caller_and_target, thread_sensitive=False)
MAX_PAGE = 100
# The purposes OpenAI's Files API knows: listing by one of them is fine (only fine-tune files are kept here).
OPENAI_PURPOSES = ("assistants", "assistants_output", "batch", "batch_output", "evals", "fine-tune",
                   "fine-tune-results", "user_data", "vision")  # fmt: skip


def _json(body: dict, status: int = 200) -> HttpResponse:
    return HttpResponse(json.dumps(body), status=status, content_type="application/json")


async def _caller(request) -> Caller:
    authorization = request.headers.get("Authorization", "")
    cached = cached_caller_and_target(authorization=authorization, model=None)
    caller, _ = cached or await _lookup(authorization=authorization, model=None)
    return caller


def _in_thread(operation: Callable, request, caller: Caller, kwargs: dict) -> HttpResponse:
    close_old_connections()  # these threads live outside Django's request cycle
    try:
        tenant = Tenant.objects.select_related("plan").get(pk=caller.tenant_id)
        return operation(request, tenant=tenant, key_id=caller.key_id, **kwargs)
    except FineTuningRefusal as refusal:
        return ApiError(refusal.status, refusal.message, code=refusal.code, param=refusal.param).response()
    finally:
        close_old_connections()


def _refuse_nul(kwargs: dict, query) -> None:
    """No id or parameter holds a NUL character (and PostgreSQL refuses one in a query: a 500, not a 400). The
    platform's RefuseNulInUrlMiddleware does not run here: /v1/ is served without middleware (gateway/asgi.py)."""
    for name, values in query.lists():
        if "\x00" in name or any("\x00" in value for value in values):
            raise invalid(f"{name} holds a NUL character, which no parameter can hold.", param=name)
    if any("\x00" in value for value in kwargs.values() if isinstance(value, str)):
        raise invalid("The URL holds a NUL character, which no id can hold.")


def _endpoint(**operations: Callable) -> Callable:
    """A view for one path: each HTTP method to its operation, run in a thread once the caller is known."""
    run = sync_to_async(_in_thread, thread_sensitive=False)

    @csrf_exempt
    async def view(request, **kwargs) -> HttpResponse:
        try:
            operation = operations.get(request.method.lower())
            if operation is None:
                allowed = ", ".join(m.upper() for m in operations)
                raise ApiError(405, f"Method {request.method} is not allowed here; use {allowed}.",
                               code="method_not_allowed", headers={"Allow": allowed})  # fmt: skip
            _refuse_nul(kwargs, request.GET)
            caller = await _caller(request)
            request_id = f"files-{uuid.uuid4().hex}"  # a request of no tokens: it counts against RPM and concurrency
            decision = await admission_acquire(tenant_id=caller.tenant_id, request_id=request_id, tokens=0,
                                               spend_micros=0, limits=caller.limits)  # fmt: skip
            if not decision.admitted:
                raise refusal(decision, ratelimit_headers(caller, decision), tokens=0, limits=caller.limits)
            try:
                return await run(operation, request, caller, kwargs)
            finally:
                await admission_settle(tenant_id=caller.tenant_id, request_id=request_id, tokens=0, spend_micros=0)
        except ApiError as error:
            return error.response()

    return view


def _limit(request, default: int = 20) -> int:
    raw = request.GET.get("limit")
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()):
        raise invalid("limit must be a whole number.", param="limit")
    if not 1 <= int(raw) <= MAX_PAGE:
        raise invalid(f"limit must be between 1 and {MAX_PAGE}.", param="limit")
    return int(raw)


def _cursor(request, anchors) -> int | None:
    """The row `after` names, looked up among `anchors` (which keep a row deleted since the last page was read)."""
    after = request.GET.get("after")
    if after is None:
        return None
    anchor = anchors.filter(public_id=after).values_list("id", flat=True).first() if after else None
    if anchor is None:
        raise invalid(f"after must be the id of an object in this list; '{after}' is not.", param="after")
    return anchor


def _listing(request, queryset, shape: Callable, *, ascending: bool = False, anchors=None) -> HttpResponse:
    after = _cursor(request, queryset if anchors is None else anchors)
    rows, more = selectors.page(queryset, after=after, limit=_limit(request), ascending=ascending)
    return _json(wire.page([shape(row) for row in rows], more))


# -- files --------------------------------------------------------------------------------------------------------

def _file(tenant: Tenant, file_id: str):
    uploaded = selectors.file_get(tenant=tenant, public_id=file_id)
    if uploaded is None:
        raise not_found("file", file_id)
    return uploaded


def file_create(request, *, tenant, key_id) -> HttpResponse:
    try:
        upload = request.FILES.get("file")
    except MultiPartParserError as error:  # no boundary, a bad one, a body cut short: the client's, not a 500
        raise FineTuningRefusal(f"The body is not valid multipart/form-data ({error}): attach the JSONL file as "
                                f"'file' in a multipart/form-data body with its boundary.", code="invalid_multipart",
                                param="file") from None  # fmt: skip
    if upload is None:
        raise FineTuningRefusal("Attach the JSONL file as 'file' (multipart/form-data).", code="file_missing",
                                param="file")  # fmt: skip
    uploaded = services.file_create(tenant=tenant, key_id=key_id, filename=upload.name or "upload.jsonl",
                                    content=upload.read(), purpose=request.POST.get("purpose", ""))  # fmt: skip
    return _json(wire.file_object(uploaded))


def file_list(request, *, tenant, key_id) -> HttpResponse:
    files = selectors.files_of(tenant=tenant)
    purpose = request.GET.get("purpose")
    if purpose is not None:
        if purpose not in OPENAI_PURPOSES:
            raise invalid(f"purpose must be one of {', '.join(OPENAI_PURPOSES)}.", param="purpose")
        files = files.filter(purpose=purpose)
    order = request.GET.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order must be 'asc' or 'desc'.", param="order")
    anchors = selectors.files_ever_of(tenant=tenant)
    return _listing(request, files, wire.file_object, ascending=order == "asc", anchors=anchors)


def file_retrieve(request, *, tenant, key_id, file_id) -> HttpResponse:
    return _json(wire.file_object(_file(tenant, file_id)))


def file_delete(request, *, tenant, key_id, file_id) -> HttpResponse:
    return _json(wire.file_deleted(services.file_delete(tenant=tenant, key_id=key_id, public_id=file_id)))


def file_content(request, *, tenant, key_id, file_id) -> HttpResponse:
    uploaded = _file(tenant, file_id)
    return HttpResponse(file_read(key=uploaded.storage_key), content_type="application/jsonl")


# -- jobs ---------------------------------------------------------------------------------------------------------

def _job(tenant: Tenant, job_id: str):
    job = selectors.job_get(tenant=tenant, public_id=job_id)
    if job is None:
        raise not_found("fine-tuning job", job_id)
    return job


def job_create(request, *, tenant, key_id) -> HttpResponse:
    body = parse_body(request.body)
    if not isinstance(body.get("model"), str):
        raise invalid("model is required: the name of the base model to fine-tune.", param="model")
    if not isinstance(body.get("training_file"), str):
        raise invalid("training_file is required: the id of a file uploaded with purpose 'fine-tune'.",
                      param="training_file")  # fmt: skip
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 and "\x00" not in k + v
        for k, v in metadata.items()
    ) and len(metadata) <= 16):  # a NUL can't be stored (PostgreSQL's jsonb refuses \u0000)
        raise invalid("metadata must map at most 16 keys (<= 64 characters) to strings (<= 512) with no NUL "
                      "characters.", param="metadata")  # fmt: skip
    job = services.job_create(
        tenant=tenant, key_id=key_id, model=body.get("model"), training_file=body["training_file"],
        validation_file=body.get("validation_file"), method=body.get("method"),
        hyperparameters=body.get("hyperparameters"), suffix=body.get("suffix"), seed=body.get("seed"),
        metadata=metadata,
    )  # fmt: skip
    return _json(wire.job_object(selectors.job_get(tenant=tenant, public_id=job.public_id)))


def job_list(request, *, tenant, key_id) -> HttpResponse:
    """?metadata[key]=value (as the `openai` package sends metadata={...}) keeps the jobs with that metadata."""
    metadata = {name[len("metadata["):-1]: value for name, value in request.GET.items()
                if name.startswith("metadata[") and name.endswith("]")}  # fmt: skip
    return _listing(request, selectors.jobs_of(tenant=tenant, metadata=metadata), wire.job_object)


def job_retrieve(request, *, tenant, key_id, job_id) -> HttpResponse:
    return _json(wire.job_object(_job(tenant, job_id)))


def job_cancel(request, *, tenant, key_id, job_id) -> HttpResponse:
    services.job_cancel(tenant=tenant, key_id=key_id, public_id=job_id)
    return _json(wire.job_object(_job(tenant, job_id)))


def job_events(request, *, tenant, key_id, job_id) -> HttpResponse:
    return _listing(request, selectors.events_of(job=_job(tenant, job_id)), wire.event_object)


def job_checkpoints(request, *, tenant, key_id, job_id) -> HttpResponse:
    job = _job(tenant, job_id)
    return _listing(request, selectors.checkpoints_of(job=job), lambda row: wire.checkpoint_object(row, job))


files = _endpoint(get=file_list, post=file_create)
file = _endpoint(get=file_retrieve, delete=file_delete)
file_contents = _endpoint(get=file_content)
jobs = _endpoint(get=job_list, post=job_create)
job = _endpoint(get=job_retrieve)
job_cancellation = _endpoint(post=job_cancel)
job_event_list = _endpoint(get=job_events)
job_checkpoint_list = _endpoint(get=job_checkpoints)
