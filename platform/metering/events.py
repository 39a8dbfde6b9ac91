"""Reading one usage event dict (the engine's schema, see notes/interfaces) into typed fields.

The gateway's `metadata` (echoed back by the engine) names what the engine can't know: the model as requested,
the adapter version id, the API key id, the tenant id and the engine's name as the gateway knows it.
"""

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation

from django.utils.dateparse import parse_datetime

from engine.contract import billed_cached_tokens


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


MAX_TOKENS = 2**31 - 1  # the columns are 32-bit: a larger count is a broken event, not a big request
MAX_GPU_MS = Decimal(10**10)


def _count(event: dict, name: str) -> int:
    value = event.get(name, 0) or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise BadEvent(f"{name} must be an integer from 0 to {MAX_TOKENS}, got {value!r}")
    return value


def _millis(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise BadEvent(f"a duration in ms must be a non-negative number, got {value!r}")
    return float(value)


def _gpu_ms(value) -> Decimal:
    if value is None:
        return Decimal(0)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise BadEvent(f"gpu_ms must be a number, got {value!r}")
    try:
        number = Decimal(str(value))
    except InvalidOperation as error:
        raise BadEvent(f"gpu_ms is not a number: {value!r}") from error
    if not number.is_finite() or not 0 <= number < MAX_GPU_MS:
        raise BadEvent(f"gpu_ms must be a number from 0 to {MAX_GPU_MS}, got {value!r}")
    return number.quantize(Decimal("0.001"))


def _timestamp(value) -> datetime:
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return datetime.fromtimestamp(value, tz=UTC)
        parsed = parse_datetime(value) if isinstance(value, str) else None
    except (ValueError, OverflowError, OSError):
        parsed = None
    if parsed is None:
        raise BadEvent(f"finished_at must be an ISO 8601 time or epoch seconds, got {value!r}")
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _prefill(metadata: dict, cached_tokens: int) -> tuple[str, Decimal, int]:
    """The gateway's `"prefill": {"engine", "gpu_ms", "cached_tokens"}` (disaggregated serving): the prefill
    engine, its GPU time, and the cached tokens the request is billed for (the prefill engine's hits, not the
    blocks the decode engine pulled: engine.contract.billed_cached_tokens)."""
    prefill = metadata.get("prefill")
    if prefill is None:
        return "", Decimal(0), cached_tokens
    if not isinstance(prefill, dict) or not isinstance(prefill.get("engine"), str) or not prefill["engine"]:
        raise BadEvent(f"metadata.prefill must name its engine, got {prefill!r}")
    if "cached_tokens" in prefill:
        cached_tokens = billed_cached_tokens(decode_cached=cached_tokens,
                                             prefill_cached=_count(prefill, "cached_tokens"))
    return prefill["engine"][:100], _gpu_ms(prefill.get("gpu_ms")), cached_tokens


def usage_record_parse(event: dict) -> UsageRecord:
    if not isinstance(event, dict):
        raise BadEvent(f"an event must be an object, got {type(event).__name__}")
    metadata = event.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise BadEvent(f"metadata must be an object, got {type(metadata).__name__}")
    request_id = str(event.get("request_id") or "")
    if not request_id or len(request_id) > 100:
        raise BadEvent(f"request_id must be 1 to 100 characters, got {request_id!r}")
    tenant_ref = str(metadata.get("tenant_id") or event.get("tenant") or "")
    if not tenant_ref:
        raise BadEvent("the event names no tenant")
    prompt_tokens, cached_tokens = _count(event, "prompt_tokens"), _count(event, "cached_tokens")
    if cached_tokens > prompt_tokens:
        raise BadEvent(f"cached_tokens ({cached_tokens}) exceeds prompt_tokens ({prompt_tokens})")
    base_model = str(event.get("base_model") or metadata.get("base_model") or "")
    if not base_model:
        raise BadEvent("the event names no base_model")
    version = metadata.get("adapter_version_id")
    if version is not None and (isinstance(version, bool) or not str(version).isdigit()):
        raise BadEvent(f"adapter_version_id must be an integer, got {version!r}")
    prefill_engine, prefill_gpu_ms, cached_tokens = _prefill(metadata, cached_tokens)
    return UsageRecord(
        request_id=request_id,
        tenant_ref=tenant_ref,
        api_key_ref=str(event.get("api_key_id") or metadata.get("api_key_id") or ""),
        model=str(metadata.get("model") or "")[:250],
        base_model=base_model[:200],
        adapter_version_id=int(version) if version is not None else None,
        adapter_digest=str(event.get("adapter_digest") or event.get("adapter") or "")[:64],
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        completion_tokens=_count(event, "completion_tokens"),
        image_count=_count(event, "image_count"),
        image_tokens=min(_count(event, "image_tokens"), prompt_tokens),
        gpu_ms=_gpu_ms(event.get("gpu_ms")),
        queue_ms=_millis(event.get("queue_ms")),
        ttft_ms=_millis(event.get("ttft_ms")),
        e2e_ms=_millis(event.get("e2e_ms")),
        finish_reason=str(event.get("finish_reason") or "")[:32],
        engine=str(metadata.get("engine") or event.get("engine") or "")[:100],
        finished_at=_timestamp(event.get("finished_at")),
        error=str(event.get("error") or metadata.get("error") or "")[:500],
        prefill_engine=prefill_engine,
        prefill_gpu_ms=prefill_gpu_ms,
    )
