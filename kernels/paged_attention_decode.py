"""Paged attention for decode: one query token per sequence, GQA, optional split-KV with a reduction."""

import math

import torch
import triton
import triton.language as tl

from kernels.launch import (
    cdiv,
    dot_precision,
    multiprocessor_count,
    next_power_of_2,
    require,
    require_index,
    require_kv_scales,
    require_paged_attention,
    require_same_device,
    require_window_softcap,
    tanh,
)


def _config(batch: int, kv_heads: int, max_context: int, head_dim: int, device: torch.device) -> dict:
    """Tuning for one launch (the only place it is chosen): KV tile, warps and the split-KV partition.

    Split-KV is used when batch x kv_heads programs cannot fill the device and contexts are long:
    the largest partition (256..2048 tokens) that still gives two programs per multiprocessor.
    It depends only on shapes known without a device sync (max_blocks x block_size).
    """
    block_n = 64 if head_dim <= 128 else 32
    target = 2 * multiprocessor_count(device)
    programs = batch * kv_heads
    partition = 0
    if programs < target and max_context > 512:
        partition = 256
        for candidate in (2048, 1024, 512):
            if programs * cdiv(max_context, candidate) >= target:
                partition = candidate
                break
    return {"BLOCK_N": block_n, "PARTITION": partition, "num_warps": 4}


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, context_ptr, out_ptr, part_out_ptr, part_stats_ptr,
    k_scales_ptr, v_scales_ptr, scale, softcap, window, head_dim,
    q_stride_b, q_stride_h, cache_stride_blk, cache_stride_tok, cache_stride_h, table_stride,
    out_stride_b, out_stride_h, part_stride_b, part_stride_h, part_stride_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(context_ptr + b).to(tl.int32)
    lo = 0  # the first key the query sees: blocks before the window are never read
    if HAS_WINDOW:
        lo = tl.maximum(context - window, 0)
    if PARTITION > 0:  # with a window, the partitions count from the one the window starts in
        start = (lo // PARTITION + split) * PARTITION
        if start >= context:
            return
        end = tl.minimum(start + PARTITION, context)
        start = tl.maximum(start, lo)
    else:
        start = lo
        end = context
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + b * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(tables_ptr + b * table_stride + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = blocks * cache_stride_blk + (offs_n % BLOCK_SIZE) * cache_stride_tok + kv_head * cache_stride_h
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if FP8:  # one float32 scale per token and KV head: scales [blocks, bs, kv_heads] contiguous
            scale_rows = (blocks * BLOCK_SIZE + offs_n % BLOCK_SIZE) * cache_stride_tok // cache_stride_h + kv_head
            k = k.to(tl.float32) * tl.load(k_scales_ptr + scale_rows, mask=n_mask, other=0.0)[:, None]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        s = tl.where(n_mask[None, :], s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if FP8:
            v = v.to(tl.float32) * tl.load(v_scales_ptr + scale_rows, mask=n_mask, other=0.0)[:, None]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if PARTITION > 0:
        part = b * part_stride_b + heads * part_stride_h + split * part_stride_split
        tl.store(part_out_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_stats_ptr + part, m_i + tl.log2(l_i), mask=g_mask)
    else:
        tl.store(out_ptr + b * out_stride_b + heads[:, None] * out_stride_h + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_kernel(
    part_out_ptr, part_stats_ptr, context_ptr, out_ptr, window, head_dim,
    part_stride_b, part_stride_h, part_stride_split, out_stride_b, out_stride_h,
    BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, PARTITION: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context = tl.load(context_ptr + b).to(tl.int32)
    first = 0  # the key the first partition starts from: with a window, the start of the window's partition
    if HAS_WINDOW:
        first = tl.maximum(context - window, 0) // PARTITION * PARTITION
    num_splits = tl.cdiv(context - first, PARTITION)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    base = b * part_stride_b + head * part_stride_h
    offs_p = tl.arange(0, BLOCK_P)
    lse = tl.load(part_stats_ptr + base + offs_p * part_stride_split, mask=offs_p < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    total = tl.sum(tl.exp2(lse - lse_max), axis=0)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(0, num_splits):
        weight = tl.exp2(tl.load(part_stats_ptr + base + i * part_stride_split) - lse_max)
        part = tl.load(part_out_ptr + (base + i * part_stride_split) * head_dim + offs_d, mask=d_mask, other=0.0)
        acc += weight * part
    tl.store(out_ptr + b * out_stride_b + head * out_stride_h + offs_d, (acc / total).to(out_ptr.dtype.element_ty),
             mask=d_mask)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """out[b, h] = softmax(cap(scale * q[b, h] @ K_b.T)) @ V_b, K_b/V_b = the first context_lens[b] cached
    tokens of sequence b (token j at k_cache[block_tables[b, j // bs], j % bs, h // (heads // kv_heads)]),
    or with a window only its last `window` tokens (p - window < j <= p, p = context_lens[b] - 1: the
    blocks before are not read); cap(s) = softcap * tanh(s / softcap) with a softcap, else s.

    q [B, heads, D] (last dim contiguous); k_cache, v_cache [num_blocks, bs, kv_heads, D] contiguous,
    bs a power of two; block_tables [B, max_blocks] int; context_lens [B] int, each >= 1;
    returns out [B, heads, D] in q.dtype. An fp8 cache comes with k_scales, v_scales [num_blocks, bs, kv_heads]
    float32 and is read as cache * scales[..., None] (kernels.reference.store_kv). partition_size (tuning/tests
    only): tokens per split-KV partition, a multiple of the KV tile; 0 disables split-KV; None chooses from the
    shapes.
    """
    batch = q.shape[0]
    heads, head_dim, block_size, kv_heads = require_paged_attention(
        q, k_cache, v_cache, block_tables, batch=batch, rows="B"
    )
    require_index("context_lens", context_lens, batch)
    require_same_device(q=q, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)
    fp8 = require_kv_scales(k_cache, k_scales, v_scales)
    require_window_softcap(window, softcap)
    if not fp8:
        k_scales = v_scales = context_lens  # unused
    out = torch.empty(batch, heads, head_dim, dtype=q.dtype, device=q.device)  # [B, heads, D]
    if batch == 0:
        return out
    group = heads // kv_heads
    max_context = block_tables.shape[1] * block_size
    config = _config(batch, kv_heads, min(max_context, window or max_context), head_dim, q.device)
    if partition_size is not None:
        require(partition_size % config["BLOCK_N"] == 0, f"partition_size must be a multiple of {config['BLOCK_N']}")
        config["PARTITION"] = partition_size
    partition = config["PARTITION"]
    num_splits = 1
    if partition > 0:  # enough partitions for the longest context, or for a window from its partition's start
        num_splits = math.ceil(max_context / partition)
        if window is not None:
            num_splits = min(num_splits, math.ceil((window - 1) / partition) + 1)
    part_out = part_stats = out
    if partition > 0:
        part_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)  # [B,H,P,D]
        part_stats = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)  # [B, H, P]
    block_d = max(next_power_of_2(head_dim), 16)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_stats,
        k_scales, v_scales, scale, softcap or 1.0, window or 0, head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), heads * num_splits, num_splits, 1,
        GROUP=group, BLOCK_G=max(next_power_of_2(group), 16), BLOCK_D=block_d, BLOCK_N=config["BLOCK_N"],
        BLOCK_SIZE=block_size, PARTITION=partition, PRECISION=dot_precision(q.dtype), FP8=fp8,
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, num_warps=config["num_warps"],
    )
    if partition > 0:
        _reduce_kernel[(batch, heads)](
            part_out, part_stats, context_lens, out, window or 0, head_dim,
            heads * num_splits, num_splits, 1, out.stride(0), out.stride(1),
            BLOCK_D=block_d, BLOCK_P=next_power_of_2(num_splits), PARTITION=partition, HAS_WINDOW=window is not None,
            num_warps=4,
        )
    return out
