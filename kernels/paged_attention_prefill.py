"""Paged attention for prefill: a ragged batch of new tokens attending causally to cached prefix
blocks and to themselves, flash-style (online softmax), through block tables."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    cdiv,
    dot_precision,
    next_power_of_2,
    require_index,
    require_kv_scales,
    require_paged_attention,
    require_same_device,
    require_window_softcap,
    tanh,
)


def _config(head_dim: int) -> dict:
    """Tuning (the only place it is chosen): query tile, KV tile and warps."""
    if head_dim <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 32 if head_dim > 128 else 64, "num_warps": 4}


def _tile_map(cu_seqlens_q: torch.Tensor, block_m: int, num_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of num_tiles query tiles: its sequence (B = unused tile) and tile index within it.

    Device ops only (no host sync): num_tiles = cdiv(T, BLOCK_M) + B bounds the true tile count.
    """
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [B]
    tiles = (q_lens + block_m - 1) // block_m  # [B]
    cu_tiles = torch.cumsum(tiles, 0)  # [B]
    ids = torch.arange(num_tiles, device=cu_seqlens_q.device)  # [num_tiles]
    tile_seq = torch.searchsorted(cu_tiles, ids, right=True)  # [num_tiles], in [0, B]
    first = (cu_tiles - tiles)[tile_seq.clamp(max=q_lens.shape[0] - 1)]  # [num_tiles]
    return tile_seq.to(torch.int32), (ids - first).to(torch.int32)


LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = exp2(x * log2(e))


@triton.jit(do_not_specialize=["batch"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, cu_ptr, tables_ptr, context_ptr, tile_seq_ptr, tile_idx_ptr, out_ptr,
    k_scales_ptr, v_scales_ptr, limits_ptr, scale, softcap, window, head_dim, batch,
    q_stride_t, q_stride_h, cache_stride_blk, cache_stride_tok, cache_stride_h, table_stride,
    out_stride_t, out_stride_h,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_LIMITS: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq >= batch:
        return
    m_block = tl.load(tile_idx_ptr + tile)
    q_start = tl.load(cu_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_ptr + seq + 1) - q_start).to(tl.int32)
    context = tl.load(context_ptr + seq).to(tl.int32)
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = context - q_len + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    rows_q = q_start + offs_m
    q = tl.load(q_ptr + rows_q[:, None] * q_stride_t + head * q_stride_h + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    end = tl.minimum(context, context - q_len + (m_block + 1) * BLOCK_M)
    q_last = q_pos  # the last key each query sees
    if HAS_LIMITS:  # keys past a query's own position, up to its limit (attention both ways)
        q_last = tl.load(limits_ptr + rows_q, mask=m_mask, other=0).to(tl.int32)
        end = tl.minimum(context, tl.maximum(end, tl.max(tl.where(m_mask, q_last, 0)) + 1))
    table = tables_ptr + seq.to(tl.int64) * table_stride
    lo = 0  # the first key any query of the tile sees: blocks before the window are never read
    if HAS_WINDOW:
        lo = tl.maximum(context - q_len + m_block * BLOCK_M - window + 1, 0)
    for n0 in range(lo, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = blocks * cache_stride_blk + (offs_n % BLOCK_SIZE) * cache_stride_tok + kv_head * cache_stride_h
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if FP8:  # one float32 scale per token and KV head: scales [blocks, bs, kv_heads] contiguous
            scale_rows = (blocks * BLOCK_SIZE + offs_n % BLOCK_SIZE) * cache_stride_tok // cache_stride_h + kv_head
            k = k.to(tl.float32) * tl.load(k_scales_ptr + scale_rows, mask=n_mask, other=0.0)[:, None]
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = softcap * tanh(s / softcap)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_last[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_shift = m_new
        if HAS_WINDOW:
            # a row may see nothing yet (its window starts after this KV tile): shifted by 0, p = alpha = 0, not
            # NaN. Its max stays -inf: a 0 carried on made p = exp2(s) of a later, very negative s underflow
            # (fp16 below 2^-24) while the float32 sum l_i kept it, so out = 0 or 0/0 instead of v.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [N, D]
        if FP8:
            v = v.to(tl.float32) * tl.load(v_scales_ptr + scale_rows, mask=n_mask, other=0.0)[:, None]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(out_ptr + rows_q[:, None] * out_stride_t + head * out_stride_h + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """For new token i of sequence b (row cu_seqlens_q[b] + i) at position p = context_lens[b] - n_b + i:
    out[row, h] = softmax(cap(scale * q[row, h] @ K_b[lo:last + 1].T)) @ V_b[lo:last + 1], K_b/V_b read through
    block_tables[b] (cached prefix and the new tokens, already stored), kv head h // (heads // kv_heads);
    lo = 0, or with a window max(0, p - window + 1) (blocks before every query's window are not read);
    last = p, or key_limits[row] (p <= it < context_lens[b]: a token that also sees later ones of its chunk);
    cap(s) = softcap * tanh(s / softcap) with a softcap, else s.

    q [T, heads, D] (last dim contiguous); k_cache, v_cache [num_blocks, bs, kv_heads, D] contiguous,
    bs a power of two; cu_seqlens_q [B + 1] int; block_tables [B, max_blocks] int; context_lens [B] int
    (>= the sequence's new tokens); returns out [T, heads, D] in q.dtype. An fp8 cache comes with its
    k_scales, v_scales [num_blocks, bs, kv_heads] float32 (kernels.paged_attention_decode).
    """
    batch = context_lens.shape[0]
    heads, head_dim, block_size, kv_heads = require_paged_attention(
        q, k_cache, v_cache, block_tables, batch=batch, rows="T"
    )
    total = q.shape[0]
    require_index("context_lens", context_lens, batch)
    require_index("cu_seqlens_q", cu_seqlens_q, batch + 1)
    require_same_device(q=q, k_cache=k_cache, cu_seqlens_q=cu_seqlens_q, block_tables=block_tables,
                        context_lens=context_lens)
    fp8 = require_kv_scales(k_cache, k_scales, v_scales)
    require_window_softcap(window, softcap)
    if key_limits is not None:
        require_index("key_limits", key_limits, total)
        require_same_device(q=q, key_limits=key_limits)
    if not fp8:
        k_scales = v_scales = context_lens  # unused
    out = torch.empty(total, heads, head_dim, dtype=q.dtype, device=q.device)  # [T, heads, D]
    if total == 0 or batch == 0:
        return out
    config = _config(head_dim)
    num_tiles = cdiv(total, config["BLOCK_M"]) + batch
    tile_seq, tile_idx = _tile_map(cu_seqlens_q, config["BLOCK_M"], num_tiles)
    _prefill_kernel[(num_tiles, heads)](
        q, k_cache, v_cache, cu_seqlens_q, block_tables, context_lens, tile_seq, tile_idx, out,
        k_scales, v_scales, context_lens if key_limits is None else key_limits, scale, softcap or 1.0, window or 0,
        head_dim, batch,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        BLOCK_D=max(next_power_of_2(head_dim), 16), BLOCK_SIZE=block_size, PRECISION=dot_precision(q.dtype),
        FP8=fp8, HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, HAS_LIMITS=key_limits is not None,
        num_warps=config["num_warps"],
    )
    return out
