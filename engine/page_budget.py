"""How the one page pool is sized: the values in a page's chunk and the number of pages (KV blocks and adapter
pages together); docs/engine-memory.md gives the rules. Under tensor parallelism every rank has the same
pages, each of its share of the KV heads."""

from dataclasses import dataclass

import torch

import adapters
from engine.adapter_plan import pages_for_rank
from engine.block_manager import blocks_to_run
from engine.config import EngineConfig
from engine.lora_modules import row_widths
from engine.models import ModelSpec
from engine.paged_memory import PagedMemory
from engine.speculative.build import draft_memory_bytes

CPU_KV_CACHE_BYTES = 1 << 30


DEFAULT_BLOCK_SIZE = 16  # tokens per page unless the adapter rows need more (see `fitting_block_size`)


@dataclass(frozen=True)
class PageShape:
    """A page of this rank: its tokens per KV block, the model-dtype values in its chunk, and the widths of the
    adapter rows (this rank's share of each projection) a chunk must hold."""

    block_size: int
    chunk: int
    widths: list[tuple[int, int]]


def page_shape(config: EngineConfig, spec: ModelSpec, hf_config: dict, *, dtype: torch.dtype,
               kv_dtype: torch.dtype) -> PageShape:
    """The configured block size, else the smallest that holds the widest adapter row; ValueError (page_chunk)
    when the configured one is too small."""
    size = config.tensor_parallel_size
    widths = row_widths(adapters.BaseShapes.from_config(hf_config), tensor_parallel_size=size)
    shape = {"kv_heads": spec.num_kv_heads // size, "head_dim": spec.head_dim, "dtype": dtype, "kv_dtype": kv_dtype}
    block_size = fitting_block_size(**shape, widths=widths) if config.block_size is None else config.block_size
    return PageShape(block_size=block_size, widths=widths,
                     chunk=page_chunk(block_size=block_size, **shape, widths=widths, tensor_parallel_size=size))


def page_chunk(*, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
               widths: list[tuple[int, int]], tensor_parallel_size: int) -> int:
    """Model-dtype values in a chunk; raises ValueError, naming a block size that works, when the widest adapter
    row does not fit in one."""
    shape = {"kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype, "kv_dtype": kv_dtype}
    chunk = PagedMemory.chunk_values(block_size=block_size, **shape)
    if chunk >= _widest(widths):
        return chunk
    fits = fitting_block_size(**shape, widths=widths, at_least=1)
    raise ValueError(f"block_size {block_size} is too small for this model's adapter pages: a page chunk "
                     f"(block_size * kv_heads{' per rank' if tensor_parallel_size > 1 else ''} * head_dim in the "
                     f"KV cache dtype = {chunk} model-dtype values) must hold a row of {_widest(widths)} values; "
                     f"use block_size {fits} or more (or leave block_size unset: the engine then picks it)")


def fitting_block_size(*, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
                       widths: list[tuple[int, int]], at_least: int = DEFAULT_BLOCK_SIZE) -> int:
    """The smallest power of two from `at_least` whose chunk holds the widest adapter row (a row never straddles
    two chunks: docs/engine-memory.md): 16 for most models, 64 for a Qwen2-7B shape, 32 for Llama-3-8B with an
    fp8 KV cache."""
    def holds_a_row(block_size: int) -> bool:
        try:
            chunk = PagedMemory.chunk_values(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                             kv_dtype=kv_dtype)  # fmt: skip
        except ValueError:  # not a whole number of model-dtype values: a larger block may be
            return False
        return chunk >= _widest(widths)

    block_size = 1 << (at_least - 1).bit_length()
    while not holds_a_row(block_size):
        block_size *= 2
    return block_size


def _widest(widths: list[tuple[int, int]]) -> int:
    return max(max(w) for w in widths)


def count_pages(config: EngineConfig, args: ModelSpec, *, device: torch.device, model_dtype: torch.dtype,
                kv_dtype: torch.dtype, widths: list[tuple[int, int]], chunk: int, max_model_len: int,
                tensor_parallel_size: int, workers_free: list[int]) -> int:
    """Pages of the pool: the configured KV blocks, else what the free device memory (the least of any
    rank's) holds beside a draft model and the NIXL landing area, else on CPU enough for max_num_seqs sequences
    of max_model_len (of a window and a chunk when blocks behind the window are given back); plus the adapter
    pages."""
    page_bytes = PagedMemory.bytes_per_page(num_layers=args.num_layers, block_size=config.block_size,
                                            kv_heads=args.num_kv_heads // tensor_parallel_size,
                                            head_dim=args.head_dim, itemsize=kv_dtype.itemsize,
                                            kv_scales=kv_dtype != model_dtype)
    adapter_pages = count_adapter_pages(config, args, page_bytes=page_bytes, widths=widths, chunk=chunk)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks + adapter_pages
    if device.type == "cuda":
        free = min([torch.cuda.mem_get_info(device)[0], *workers_free])
        draft_page, draft_weights = draft_memory_bytes(config, model_dtype.itemsize)
        taken = int(free * config.kv_cache_memory_fraction) - draft_weights - config.kv_landing_bytes
        return max(1, taken // (page_bytes + draft_page))
    per_sequence = blocks_to_run(max_model_len, config.max_num_batched_tokens, block_size=config.block_size,
                                 window=freed_window(config, args))
    return max(1, min(CPU_KV_CACHE_BYTES // page_bytes, config.max_num_seqs * per_sequence)) + adapter_pages


def count_adapter_pages(config: EngineConfig, args: ModelSpec, *, page_bytes: int, widths: list[tuple[int, int]],
                        chunk: int) -> int:
    """The pages the pool is given for adapters: pool_adapter_bytes, else pool_adapters_at_max_rank adapters of
    max_adapter_rank; also what device pins may hold in all."""
    if config.pool_adapter_bytes is not None:
        return -(-config.pool_adapter_bytes // page_bytes)
    return config.pool_adapters_at_max_rank * pages_for_rank(
        config.max_adapter_rank, num_layers=args.num_layers, widths=widths, chunk=chunk,
        num_experts=args.moe.num_experts if args.moe else 0)


def freed_window(config: EngineConfig, args: ModelSpec) -> int | None:
    """The window behind which KV blocks are given back: every layer's widest, when each has one and no
    draft model reads the same block tables through its own layers; else None."""
    if None in args.layer_windows or config.speculative_method == "draft":
        return None
    return args.sliding_window
