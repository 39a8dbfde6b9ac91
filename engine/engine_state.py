"""What an engine reports about itself in /v1/state: its memory split, queues, prefix-cache tiers and speculation."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def memory_split(engine: "LLMEngine") -> dict:
    """Bytes of base weights, KV pages, adapter pages and free pages (free includes prefix-cached blocks)."""
    bm, page = engine.block_manager, engine.memory.page_bytes
    return {
        "page_bytes": page,
        "pages_total": bm.num_blocks,
        "base_weights_bytes": engine.weight_bytes,
        "kv_pages_bytes": bm.num_used_blocks * page,
        "adapter_pages_bytes": len(bm.adapter_pages) * page,
        "free_bytes": bm.num_free_blocks * page,
        **engine.memory_report.as_dict(),
    }


def state(engine: "LLMEngine") -> dict:
    bm = engine.block_manager
    return {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "kv_blocks_used": bm.num_used_blocks,
        "kv_blocks_free": bm.num_free_blocks,
        "kv_blocks_total": bm.num_blocks,
        "adapter_pages": len(bm.adapter_pages),
        "memory": memory_split(engine),
        "prefix_cache_hit_rate": bm.hit_rate(),
        "kv_tiers": kv_tiers_state(engine),
        "adapters": engine.adapter_pool.state(),
        "busy_ms": engine.busy_ms,
        "steps": engine.num_steps,
        "preemptions": engine.num_preemptions,
        "tensor_parallel_size": engine.comm.size,
        "block_size": engine.config.block_size,
        "speculation": speculation_state(engine),
        "grammars": {**(engine.grammars.state() if engine.grammars else {}), **engine.guided.state()},
    }


def kv_tiers_state(engine: "LLMEngine") -> dict:
    """Prefix blocks looked up at first admission, hit and missed per tier (device, then host)."""
    counts = engine.scheduler.tier_counts
    tiers = {"device": {"hits": counts["device"][0], "misses": counts["device"][1],
                        "blocks": len(engine.block_manager.cached)}}
    if engine.host_tier is not None:
        tiers["host"] = {"hits": counts["host"][0], "misses": counts["host"][1], **engine.host_tier.state()}
    return tiers


def speculation_state(engine: "LLMEngine") -> dict:
    proposed = engine.speculator.num_proposed if engine.speculator else 0
    accepted = engine.speculator.num_accepted if engine.speculator else 0
    return {
        "method": engine.config.speculative_method,
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "tokens_per_step": engine.num_generated_tokens / engine.num_decode_seq_steps if engine.num_decode_seq_steps else 0.0,
    }
