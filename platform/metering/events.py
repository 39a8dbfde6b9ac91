"""One usage event (engine.contract.UsageEvent, decoded and validated by its struct) as metering's rows see it.

The event's own fields are what the engine knows; its `metadata` is what the gateway knows: the model as
requested, the adapter version, the engine's name in the fleet and a prefill hop's share.
"""

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from engine.contract import BadUsageEvent, UsageEvent, WrongVersion, billed_cached_tokens, usage_event_read


class BadEvent(ValueError):
    pass


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    tenant_ref: str
    api_key_ref: str
    model: str
    base_model: str
    adapter_version_id: int | None
    adapter_digest: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_ms: Decimal
    queue_ms: float | None
    ttft_ms: float | None
    e2e_ms: float | None
    finish_reason: str
    engine: str
    finished_at: datetime
    error: str = ""  # why it failed (the gateway's report of a broken stream says; the engine's events don't)
    # disaggregated serving: the prefill engine's share, which the gateway put in the metadata (gpu_ms is the
    # decode engine's, as the engine reported it)
    prefill_engine: str = ""
    prefill_gpu_ms: Decimal = Decimal(0)
    image_count: int = 0  # the prompt's images and their tokens (part of prompt_tokens)
    image_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def _millis(value: float) -> Decimal:
    return Decimal(repr(value)).quantize(Decimal("0.001"))


def usage_record_parse(data: object) -> UsageRecord:
    """The record of one usage event as delivered (decoded JSON); BadEvent naming the field or the version."""
    if not isinstance(data, dict):
        raise BadEvent(f"an event must be an object, got {type(data).__name__}")
    try:
        event = usage_event_read(data)
    except (BadUsageEvent, WrongVersion) as error:
        raise BadEvent(str(error)) from None
    return usage_record(event)


def usage_record(event: UsageEvent) -> UsageRecord:
    metadata, cached_tokens = event.metadata, event.cached_tokens
    prefill = metadata.prefill
    if prefill is not None and prefill.cached_tokens is not None:
        cached_tokens = billed_cached_tokens(decode_cached=cached_tokens, prefill_cached=prefill.cached_tokens)
    return UsageRecord(
        request_id=event.request_id,
        tenant_ref=event.tenant,
        api_key_ref=event.api_key_id or "",
        model=metadata.model[:250],
        base_model=event.base_model[:200],
        adapter_version_id=metadata.adapter_version_id,
        adapter_digest=(event.adapter_digest or "")[:64],
        prompt_tokens=event.prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=event.completion_tokens,
        image_count=event.image_count,
        image_tokens=event.image_tokens,
        gpu_ms=_millis(event.gpu_ms),
        queue_ms=event.queue_ms,
        ttft_ms=event.ttft_ms,
        e2e_ms=event.e2e_ms,
        finish_reason=event.finish_reason,
        engine=metadata.engine[:100],
        finished_at=event.finished_at,
        error=event.error[:500],
        prefill_engine=prefill.engine[:100] if prefill is not None else "",
        prefill_gpu_ms=_millis(prefill.gpu_ms) if prefill is not None else Decimal(0),
    )
