"""Engine states for tests of what reads them (routing, the control plane, the console): the contract's EngineState,
whole, with the few fields a test cares about changed."""

import msgspec

from engine.contract.state import Adapters, EngineState, LoadSeconds, Memory, PoolCounts

MIB = 1 << 20


def memory(**changes) -> Memory:
    fields = dict(
        page_bytes=MIB, pages_total=64, base_weights_bytes=192 * MIB, kv_pages_bytes=0, adapter_pages_bytes=0,
        free_bytes=64 * MIB, quantization="none", kv_cache_dtype="auto", base_weights_full_precision_bytes=192 * MIB,
        kv_bytes_per_token=4096.0, kv_bytes_per_token_full_precision=4096.0, kv_capacity_tokens=1024,
        kv_capacity_tokens_full_precision=1024,
    )  # fmt: skip
    return Memory(**{**fields, **changes})


def adapters(**changes) -> Adapters:
    fields = dict(gpu=[], host=[], loading=[], placing=[], in_use=[], pinned={}, residency=[],
                  load_seconds=LoadSeconds(), failed={}, registered=0, host_bytes=0, device_pages=0)  # fmt: skip
    return Adapters(**{**fields, **changes})


def engine_state(**changes) -> EngineState:
    """An idle engine of 64 free pages; `changes` replace fields (`adapters=adapters(gpu=[...])`)."""
    total = changes.get("kv_blocks_total", 64)
    fields = dict(
        model="tiny", role="both", accepting=True, capacity=16, running=0, waiting=0, kv_blocks_used=0,
        kv_blocks_free=total, kv_blocks_total=total,
        kv_pool=PoolCounts(total=total, free=total, evictable=0, in_use=0, held=0, adapter_pages=0),
        prefix_cache_hit_rate=0.0, busy_ms=0.0, steps=0, preemptions=0, tokens_per_second=0.0, memory=memory(),
        adapters=adapters(), prefixes=[],
    )  # fmt: skip
    return EngineState(**{**fields, **changes})


def engine_state_json(**changes) -> dict:
    """engine_state(**changes) as the JSON an engine sends (and the control plane stores)."""
    return msgspec.to_builtins(engine_state(**changes))
