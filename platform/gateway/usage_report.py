"""The usage events the gateway makes itself, under the engine's request id (metering keeps the first event per id):
the one it sends when an engine died mid-request and so could not send its own, and the one it keeps with every
served request's provisional settle (`served_usage_json`), billed if the engine's own event never arrives."""

import json
import time

from engine.contract import TASK_NAME, UsageEvent
from engine.usage.event import now_utc

_compact = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps's compact text, its encoder made once
REPORTED_BY_GATEWAY = "gateway"  # the event's `reported_by`: what the gateway relayed (no GPU or queue time)


def usage_event(
    *, request_id: str, tenant_id: int, api_key_id, digest: str | None, base_model: str, metadata: dict,
    prompt_tokens: int, completion_tokens: int, e2e_ms: float,
) -> dict:  # fmt: skip
    event = UsageEvent(
        request_id=request_id, tenant=str(tenant_id), api_key_id=str(api_key_id), adapter_digest=digest,
        base_model=base_model, prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=completion_tokens,
        gpu_ms=0.0, queue_ms=0.0, ttft_ms=None, e2e_ms=e2e_ms, finish_reason="error", finished_at=now_utc(),
        metadata=metadata,
    )  # fmt: skip
    return event.to_dict() | {"engine": metadata.get("engine"), "error": "The engine stopped answering mid-request."}


def usage_send(event: dict) -> None:
    """Blocking (the broker): call through sync_to_async."""
    from quilt.celery import app

    app.send_task(TASK_NAME, args=[[event]])


def served_usage_template(*, tenant_id: int, api_key_id, digest: str | None, base_model: str, metadata: dict) -> str:
    """`served_usage_json`'s text for these fields, with each request's own values left as %-fields, in order: the
    request id (JSON, %s), the prompt, cached and completion tokens (%d), TTFT (JSON: null or a float's repr, %s),
    e2e (%r), the finish reason (%s, a plain word) and `finished_at` (%r); a `%` of the fields' is doubled. Made
    once per caller, model and engine: a request then fills it in one step (`tests/gateway/test_settle_before.py`)."""
    fixed = _compact({
        "tenant": str(tenant_id), "api_key_id": str(api_key_id), "adapter_digest": digest, "base_model": base_model,
    })[1:-1].replace("%", "%%")  # fmt: skip
    last = _compact({"metadata": metadata, "engine": metadata.get("engine"), "reported_by": REPORTED_BY_GATEWAY})
    return (
        '{"request_id":%s,' + fixed + ',"prompt_tokens":%d,"cached_tokens":%d,"completion_tokens":%d,"ttft_ms":%s,'
        '"e2e_ms":%r,"finish_reason":"%s","finished_at":%r,' + last[1:].replace("%", "%%")
    )


def served_usage_json(
    *, request_id: str, tenant_id: int, api_key_id, digest: str | None, base_model: str, metadata: dict,
    prompt_tokens: int, cached_tokens: int, completion_tokens: int, finish_reason: str, e2e_ms: float,
    ttft_ms: float | None,
) -> str:  # fmt: skip
    """What the client was served, as the engine's final event counted it, in the usage event's fields that
    metering reads (metering.events.usage_record_parse: `finished_at` in epoch seconds; no GPU or queue time, only
    the engine knows them). Built as a plain dict: it is on every request's path, and billed on almost none."""
    return _compact({
        "request_id": request_id, "tenant": str(tenant_id), "api_key_id": str(api_key_id), "adapter_digest": digest,
        "base_model": base_model, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens, "ttft_ms": ttft_ms, "e2e_ms": e2e_ms, "finish_reason": finish_reason,
        "finished_at": time.time(), "metadata": metadata, "engine": metadata.get("engine"),
        "reported_by": REPORTED_BY_GATEWAY,
    })  # fmt: skip
