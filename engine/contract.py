"""The engine <-> gateway contract, in one torch-free module both sides import (the platform may import it; it
imports neither torch nor Django): the usage event, the generate stream's event kinds and error types, and how
to read an engine's /v1/state.

    usage event      engine.usage.event.UsageEvent, sent as Celery task TASK_NAME ([event dicts]), at most once
                     recorded per request id
    generate stream  NDJSON lines {"type": EVENT_DELTA, ...} then one {"type": EVENT_FINAL, "finish_reason",
                     "error", "error_type", "choices", "usage"}; finish_reason in FINISH_REASONS
    adapter fault    error_type ADAPTER_UNAVAILABLE: in the final event, or as the HTTP 503 answer's
                     {"error": {"type": ADAPTER_UNAVAILABLE, "message", "param": "adapter"}}; only that request
                     fails, the engine stays healthy
    /v1/state        {"model", "running", "waiting", "adapters": {tier: [{"digest", ...} | digest, ...]}, ...}
    keep-alive       the engine server keeps an idle connection open KEEP_ALIVE_SECONDS after an answer's end; a
                     client reuses one for less (the gateway: 2 s), so the engine never closes it under a request
"""

from engine.usage.event import FINISH_REASONS, SCHEMA_VERSION, TASK_NAME, UsageEvent

__all__ = [
    "ADAPTER_UNAVAILABLE", "CONTEXT_LENGTH_EXCEEDED", "EVENT_DELTA", "EVENT_FINAL", "FINISH_REASONS", "KEEP_ALIVE_SECONDS", "SCHEMA_VERSION", "TASK_NAME",
    "UsageEvent", "state_load", "state_resident_digests",
]  # fmt: skip

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
