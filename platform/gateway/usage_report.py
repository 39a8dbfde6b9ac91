"""The usage event the gateway sends itself when an engine died mid-request and so could not send its own:
what the client was served, under the same request id (metering keeps the first event per id)."""

from engine.contract import TASK_NAME, UsageEvent
from engine.usage.event import now_utc


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
