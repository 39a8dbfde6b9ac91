"""The usage event: one per request end, shared by the engine (producer) and the platform (consumer).

Plain Python (no torch, no Django) so the platform can import it. The request id is the
idempotency key: the consumer must record each request id at most once, however many times it
is delivered.
"""

from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any

TASK_NAME = "metering.ingest_usage"
SCHEMA_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort", "error")
OPTIONAL = ("metadata", "spec_proposed_tokens", "spec_accepted_tokens", "sampling_steps", "image_count",
            "image_tokens")  # fields an event may leave out


@dataclass(frozen=True)
class UsageEvent:
    request_id: str
    tenant: str
    api_key_id: str | None
    adapter_digest: str | None  # None: the base model
    base_model: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    gpu_ms: float
    queue_ms: float
    ttft_ms: float | None  # None: no token was produced
    e2e_ms: float
    finish_reason: str  # one of FINISH_REASONS
    finished_at: datetime  # timezone-aware UTC
    metadata: dict[str, Any] = field(default_factory=dict)  # the caller's, echoed back untouched
    spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed, and accepted (optional: older events
    spec_accepted_tokens: int = 0  # have none of the three)
    sampling_steps: int = 0  # engine steps that gave the request tokens (completion_tokens / this: tokens per step)
    image_count: int = 0  # the prompt's images, and the prompt tokens they took (part of prompt_tokens)
    image_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("usage event needs a request_id")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        counts = ("prompt_tokens", "cached_tokens", "completion_tokens", "spec_proposed_tokens", "spec_accepted_tokens",
                  "sampling_steps", "image_count", "image_tokens")
        for name in counts:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        if self.image_tokens > self.prompt_tokens:
            raise ValueError("image_tokens cannot exceed prompt_tokens")
        if self.spec_accepted_tokens > self.spec_proposed_tokens:
            raise ValueError("spec_accepted_tokens cannot exceed spec_proposed_tokens")
        if self.finished_at.tzinfo is None:
            raise ValueError("finished_at must be timezone-aware")
        if not isinstance(self.metadata, dict):
            raise ValueError("metadata must be a dict")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; `finished_at` as an ISO 8601 UTC string, plus the schema version."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["finished_at"] = self.finished_at.astimezone(UTC).isoformat()
        out["schema_version"] = SCHEMA_VERSION
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "UsageEvent":
        """Inverse of `to_dict`. Missing fields raise ValueError; unknown extra keys are ignored."""
        version = data.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"unsupported usage event schema_version {version!r}")
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in data and name not in OPTIONAL]
        if missing:
            raise ValueError(f"usage event is missing {', '.join(missing)}")
        values = {name: data[name] for name in names if name in data}
        finished_at = values["finished_at"]
        if isinstance(finished_at, str):
            values["finished_at"] = datetime.fromisoformat(finished_at)
        for name in ("gpu_ms", "queue_ms", "e2e_ms"):
            values[name] = float(values[name])
        if values["ttft_ms"] is not None:
            values["ttft_ms"] = float(values["ttft_ms"])
        return cls(**values)


def now_utc() -> datetime:
    return datetime.now(UTC)
