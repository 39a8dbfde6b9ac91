"""One rank's model stack, built the same way by rank 0 (LLMEngine) and by every tensor-parallel worker, so
that there is one place to change it: the rank's shard of the checkpoint, quantized as it loads; then, once
the pool's size is known, its page memory in the KV cache dtype, the LoRA layers reading adapter rows from it,
and attention reading and writing its KV pages."""

from pathlib import Path

import torch

from engine.lora_linear import swap_in_lora
from engine.models import CausalLM, load_model
from engine.paged_memory import PagedMemory
from engine.parallel.communicator import Communicator
from engine.quantization.memory import kv_dtype


def load_rank_model(model_dir: str | Path, *, dtype: torch.dtype, device: torch.device, comm: Communicator,
                    quantization: str | None) -> CausalLM:
    """Rank comm.rank's shard, its decoder projections quantized (int8, fp8 or None) as they are read."""
    return load_model(model_dir, dtype=dtype, device=device, comm=comm, quantization=quantization)


def attach_pages(model: CausalLM, *, num_pages: int, block_size: int, kv_cache_dtype: str,
                 device: torch.device) -> PagedMemory:
    """The rank's page memory (its share of the KV heads), with the model's LoRA layers and KV caches on it."""
    args, dtype = model.spec, model.lm_head.weight.dtype
    memory = PagedMemory(num_layers=args.num_layers, num_pages=num_pages, block_size=block_size,
                         kv_heads=args.num_kv_heads // model.comm.size, head_dim=args.head_dim, dtype=dtype,
                         device=device, kv_dtype=kv_dtype(kv_cache_dtype, dtype, device))
    swap_in_lora(model, memory)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = memory.kv_cache(i)  # [pages, bs, kv_heads, D] each
        layer.self_attn.k_scales, layer.self_attn.v_scales = memory.kv_scales(i)  # fp8 cache: [pages, bs, kv_heads]
    return memory
