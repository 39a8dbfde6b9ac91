"""Test data for the console: a tiny random Llama base, PEFT adapters made for it by PEFT, usage events.

torch, transformers and PEFT are imported where used, so page tests that need no model start fast.
"""

from datetime import UTC, datetime
from itertools import count
from pathlib import Path

from tests.tiny_llama import save_peft_adapter, zipped

BASE_NAME = "tiny-llama"
_request_ids = count(1)


def peft_adapter_zip(directory: Path, *, seed: int, rank: int = 4) -> bytes:
    """A PEFT LoRA for the tiny base (q, v and down projections), zipped as a user would upload it."""
    return zipped(save_peft_adapter(directory, seed=seed, rank=rank))


def usage_event(tenant, *, model: str = BASE_NAME, api_key=None, finished_at: datetime | None = None, **fields) -> dict:
    """One usage event as the engine sends it to `metering.ingest_usage` (engine.contract.UsageEvent, as decoded JSON)."""
    return {
        "request_id": f"console-req-{next(_request_ids):08d}",
        "tenant": str(tenant.pk),
        "api_key_id": str(api_key.pk) if api_key else None,
        "adapter_digest": None,
        "base_model": BASE_NAME,
        "prompt_tokens": 1200,
        "cached_tokens": 200,
        "completion_tokens": 300,
        "gpu_ms": 80.0,
        "queue_ms": 2.0,
        "ttft_ms": 12.0,
        "e2e_ms": 90.0,
        "finish_reason": "stop",
        "finished_at": (finished_at or datetime.now(UTC)).isoformat(),
        "metadata": {"model": model, "engine": "engine-1"},
        **fields,
    }
