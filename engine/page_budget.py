"""How the one page pool is sized: the values in a page's chunk and the number of pages (KV blocks and adapter
pages together); docs/engine-memory.md gives the rules. Under tensor parallelism every rank has the same
pages, each of its share of the KV heads."""

import torch

from engine.adapter_plan import pages_for_rank
from engine.config import EngineConfig
from engine.models import ModelArgs
from engine.paged_memory import PagedMemory
from engine.speculative.build import draft_memory_bytes

CPU_KV_CACHE_BYTES = 1 << 30


def page_chunk(*, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
               widths: list[tuple[int, int]], tensor_parallel_size: int) -> int:
    """Model-dtype values in a chunk; raises ValueError when the widest adapter row does not fit in one."""
    chunk = PagedMemory.chunk_values(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                                     dtype=dtype, kv_dtype=kv_dtype)
    widest = max(max(w) for w in widths)
    if widest > chunk:  # a row of adapter weights never straddles two chunks (docs/engine-memory.md)
        per_token = chunk // block_size  # adapter values per token of a chunk
        fits = 1 << (-(-widest // per_token) - 1).bit_length()
        raise ValueError(f"block_size {block_size} is too small for this model's adapter pages: a page "
                         f"chunk (block_size * kv_heads{' per rank' if tensor_parallel_size > 1 else ''} * "
                         f"head_dim in the KV cache dtype = {chunk} model-dtype values) must hold a row of "
                         f"{widest} values; use block_size {fits} or more")
    return chunk


def count_pages(config: EngineConfig, args: ModelArgs, *, device: torch.device, model_dtype: torch.dtype,
                kv_dtype: torch.dtype, widths: list[tuple[int, int]], chunk: int, max_model_len: int,
                tensor_parallel_size: int, workers_free: list[int]) -> int:
    """Pages of the pool: the configured KV blocks, else what the free device memory (the least of any
    rank's) holds, else on CPU enough for max_num_seqs sequences of max_model_len; plus the adapter pages."""
    page_bytes = PagedMemory.bytes_per_page(num_layers=args.num_layers, block_size=config.block_size,
                                            kv_heads=args.num_kv_heads // tensor_parallel_size,
                                            head_dim=args.head_dim, itemsize=kv_dtype.itemsize,
                                            kv_scales=kv_dtype != model_dtype)
    if config.adapter_memory_bytes is not None:
        adapter_pages = -(-config.adapter_memory_bytes // page_bytes)
    else:
        adapter_pages = config.max_adapter_slots * pages_for_rank(
            config.max_adapter_rank, num_layers=args.num_layers, widths=widths, chunk=chunk)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + adapter_pages
    if device.type == "cuda":
        free = min([torch.cuda.mem_get_info(device)[0], *workers_free])
        draft_page, draft_weights = draft_memory_bytes(config, model_dtype.itemsize)
        return max(1, (int(free * config.kv_cache_memory_fraction) - draft_weights) // (page_bytes + draft_page))
    needed = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(CPU_KV_CACHE_BYTES // page_bytes, needed)) + adapter_pages
