"""The engine <-> gateway <-> metering contract: every message that crosses a process boundary, as one msgspec
Struct each, in torch-free, Django-free modules every side imports. Each message carries the contract's version
`v`; a message of another version is refused, naming it (WrongVersion), never read as if it were this one.

    usage.py         UsageEvent, sent as Celery task TASK_NAME ([events]), recorded at most once per request id
    fingerprints.py  prompt_fingerprints(): the gateway routes on them, the engine's heartbeat reports those it served
    keep-alive       the engine server keeps an idle connection open KEEP_ALIVE_SECONDS after an answer's end; a
                     client reuses one for less (the gateway: 2 s), so the engine never closes it under a request
    generate stream  NDJSON lines {"type": EVENT_DELTA, ...} then one {"type": EVENT_FINAL, "finish_reason",
                     "error", "error_type", "choices", "usage"}; finish_reason in FINISH_REASONS
    adapter          the generate request's "adapter": a digest, or {"digest", "path"} (a folder the engine reads), or
                     {"digest", "urls": {file name: signed GET URL}} (remote storage: the engine downloads the canonical
                     files, ADAPTER_FILES, into its disk cache and checks them)
    adapter fault    error_type ADAPTER_UNAVAILABLE: in the final event, or as the HTTP 503 answer's
                     {"error": {"type": ADAPTER_UNAVAILABLE, "message", "param": "adapter"}}; only that request
                     fails, the engine stays healthy
    /v1/state        {"model", "running", "waiting", "adapters": {tier: [{"digest", ...} | digest, ...]}, ...}
"""

from engine.contract.fingerprints import PREFIX_CHUNK_CHARS, prompt_fingerprints
from engine.contract.usage import (
    FINISH_REASONS,
    TASK_NAME,
    BadUsageEvent,
    PrefillShare,
    UsageEvent,
    UsageMetadata,
    billed_cached_tokens,
    now_utc,
    usage_event_read,
)
from engine.contract.version import VERSION, WrongVersion

__all__ = [
    "ADAPTER_FILES", "ADAPTER_UNAVAILABLE", "CONTEXT_LENGTH_EXCEEDED", "EVENT_DELTA", "EVENT_FINAL", "FINISH_REASONS",
    "KEEP_ALIVE_SECONDS", "PREFIX_CHUNK_CHARS", "TASK_NAME", "VERSION", "BadUsageEvent", "PrefillShare", "UsageEvent",
    "UsageMetadata", "WrongVersion", "billed_cached_tokens", "now_utc", "prompt_fingerprints", "state_load",
    "state_resident_digests", "usage_event_read",
]  # fmt: skip

ADAPTER_FILES = ("quilt_adapter.json", "adapter_model.safetensors")  # what an engine downloads of an adapter
EVENT_DELTA = "delta"
EVENT_FINAL = "final"
ADAPTER_UNAVAILABLE = "adapter_unavailable"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request past the model's context
KEEP_ALIVE_SECONDS = 75  # as the gateway's own server: longer than load balancers and clients keep idle connections


def state_resident_digests(state: dict) -> frozenset[str]:
    """Adapter digests in any tier of an engine's /v1/state answer."""
    found: set[str] = set()
    tiers = state.get("adapters") or state.get("resident_adapters") or {}
    for value in tiers.values() if isinstance(tiers, dict) else [tiers]:
        for item in value if isinstance(value, list) else []:
            digest = item.get("digest") if isinstance(item, dict) else item
            if isinstance(digest, str):
                found.add(digest)
    return frozenset(found)


def state_load(state: dict) -> int:
    """Requests running and waiting on the engine, from its /v1/state answer."""
    return int(state.get("running", 0) or 0) + int(state.get("waiting", 0) or 0)
