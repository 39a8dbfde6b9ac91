"""The usage event: one per request end, made by the engine (or by the gateway, for a request whose engine never
sent its own) and read by metering. Sent as Celery task TASK_NAME with a list of events (msgspec.to_builtins);
the request id is the idempotency key: metering records each request id at most once.

Each fact has one place: the engine's fields say what the engine knows (the tenant and key it was asked for, the
tokens, its times); `metadata` is what the gateway knows and the engine echoes untouched (the model as requested,
the adapter version, the engine's name in the fleet, the prefill hop's share)."""

from datetime import UTC, datetime
from typing import Annotated, Literal

import msgspec

from engine.contract.version import VERSION, WrongVersion, check_version, version_of

TASK_NAME = "metering.ingest_usage"
FINISH_REASONS = ("stop", "length", "abort", "error")
MAX_TOKENS = 2**31 - 1  # a larger count is a broken event, not a big request
MAX_MS = 1e10

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Millis = Annotated[float, msgspec.Meta(ge=0, lt=MAX_MS)]
FinishReason = Literal["stop", "length", "abort", "error"]


class PrefillShare(msgspec.Struct):
    """A disaggregated request's prefill hop: its engine (costed at that engine's price), its GPU time, and its
    prefix hits (what the request's cached tokens are billed as: billed_cached_tokens)."""

    engine: Annotated[str, msgspec.Meta(min_length=1)]
    gpu_ms: Millis = 0.0
    cached_tokens: Count | None = None


class UsageMetadata(msgspec.Struct, omit_defaults=True):
    """What the gateway knows of a request and the engine cannot: sent in the generate request, echoed untouched."""

    model: str = ""  # the model as the caller named it
    adapter_version_id: int | None = None
    engine: str = ""  # the serving engine's name in the fleet
    prefill: PrefillShare | None = None


class UsageEvent(msgspec.Struct, kw_only=True):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
    tenant: Annotated[str, msgspec.Meta(min_length=1)]
    api_key_id: str | None
    adapter_digest: str | None  # None: the base model
    base_model: Annotated[str, msgspec.Meta(min_length=1)]
    prompt_tokens: Count
    cached_tokens: Count
    completion_tokens: Count
    gpu_ms: Millis = 0.0  # the engine's; 0 in the gateway's own events
    queue_ms: Millis = 0.0
    ttft_ms: Millis | None  # None: no token was produced
    e2e_ms: Millis
    finish_reason: FinishReason
    finished_at: Annotated[datetime, msgspec.Meta(tz=True)]
    metadata: UsageMetadata = msgspec.field(default_factory=UsageMetadata)
    spec_proposed_tokens: Count = 0  # speculative decoding: tokens proposed, and accepted
    spec_accepted_tokens: Count = 0
    sampling_steps: Count = 0  # engine steps that gave the request tokens (completion_tokens / this: tokens per step)
    image_count: Count = 0  # the prompt's images, and the prompt tokens they took (part of prompt_tokens)
    image_tokens: Count = 0
    error: str = ""  # why it failed, where the gateway knows (an engine that stopped answering)
    v: int = VERSION

    def __post_init__(self) -> None:
        check_version("usage event", self.v)
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        if self.image_tokens > self.prompt_tokens:
            raise ValueError("image_tokens cannot exceed prompt_tokens")
        if self.spec_accepted_tokens > self.spec_proposed_tokens:
            raise ValueError("spec_accepted_tokens cannot exceed spec_proposed_tokens")


class BadUsageEvent(ValueError):
    """An event metering cannot read: the message names the field (or the version)."""


def usage_event_read(data: dict) -> UsageEvent:
    """A usage event from its decoded JSON (what Celery delivers); BadUsageEvent (a WrongVersion for another
    version) naming what is wrong."""
    try:
        return msgspec.convert(data, UsageEvent)
    except msgspec.ValidationError as error:
        version = version_of(data)
        if version != VERSION:
            raise WrongVersion("usage event", version) from None
        raise BadUsageEvent(str(error)) from None


def billed_cached_tokens(*, decode_cached: int, prefill_cached: int) -> int:
    """A disaggregated request is billed as if one engine had served it: the blocks the decode engine pulled from
    the lease were computed for this very request, so they are no cache hit for the tenant. Its cached tokens are
    the prefill engine's prefix hits, never more than the decode engine counted (if the pull failed and it
    recomputed, its own hits)."""
    return min(decode_cached, prefill_cached)


def now_utc() -> datetime:
    return datetime.now(UTC)
