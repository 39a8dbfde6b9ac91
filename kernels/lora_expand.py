"""Batched multi-LoRA expand (buf @ B.T * scaling, rank -> out) added in place, several slices at once;
each adapter's B rows (B transposed, one row per rank) are read from paged memory through a page table."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    dot_precision,
    require,
    require_contiguous,
    require_float,
    require_index,
    require_last_dim_contiguous,
    require_same_device,
    require_shape,
)
from kernels.lora_meta import LoRAMeta


def _config(num_tokens: int, max_rank: int) -> dict:
    """Tuning for one launch (the only place tile sizes and warps are chosen)."""
    block_m = 16 if num_tokens <= 256 else 64
    block_k = 16 if max_rank <= 16 else 32
    return {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": block_k, "num_warps": 4}


_OFFSETS: dict[tuple, torch.Tensor] = {}


def _offsets_tensor(slice_offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """slice_offsets as an int32 device tensor, cached so repeated calls (and graph replays) copy nothing."""
    key = (tuple(slice_offsets), str(device))
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.tensor(slice_offsets, dtype=torch.int32, device=device)  # [S + 1]
    return _OFFSETS[key]


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_expand_kernel(
    buf_ptr, pages_ptr, rows_ptr, y_ptr, sorted_ptr, counts_ptr, starts_ptr, ranks_ptr, scaling_ptr, offsets_ptr,
    num_tokens, max_width, max_rank,
    buf_stride_s, buf_stride_t, rows_stride_s, rows_stride_slot, ranks_stride_s, y_stride, scaling_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    s = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    rank = tl.minimum(tl.load(ranks_ptr + s * ranks_stride_s + slot).to(tl.int32), max_rank)
    o0 = tl.load(offsets_ptr + s)
    o1 = tl.load(offsets_ptr + s + 1)
    pid_m = pid_mn // tl.cdiv(max_width, BLOCK_N)
    pid_n = pid_mn % tl.cdiv(max_width, BLOCK_N)
    if (pid_m * BLOCK_M >= count) | (rank == 0) | (o0 + pid_n * BLOCK_N >= o1):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # within the slice
    n_mask = o0 + cols < o1
    rows_base = rows_ptr + s.to(tl.int64) * rows_stride_s + slot.to(tl.int64) * rows_stride_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < rank
        h = tl.load(buf_ptr + s * buf_stride_s + tokens[:, None] * buf_stride_t + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # the page table: where row j of this slice's B (transposed: one row per rank) starts
        b_rows = tl.load(rows_base + offs_k, mask=k_mask, other=0).to(tl.int64)
        b = tl.load(pages_ptr + b_rows[:, None] + cols[None, :], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(h, b, input_precision=PRECISION)
    scale = tl.load(scaling_ptr + s * scaling_stride + slot)
    y_ptrs = y_ptr + tokens[:, None] * y_stride + (o0 + cols)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=mask)


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    pages: torch.Tensor,
    b_rows: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    *,
    meta: LoRAMeta | None = None,
) -> None:
    """y[t, o0:o1] += scaling[s, a] * sum_j buf[s, t, j] * pages[b_rows[s, a, j] :][:o1 - o0] for j < ranks[s, a],
    every slice s, where a = token_slots[t] >= 0 and (o0, o1) = slice_offsets[s], slice_offsets[s + 1].
    buf may hold one slice for all: buf [1, T, R] reads as buf[0] for every s (slices sharing one A).

    y [T, out_total] (updated in place; row stride free, last dim contiguous); buf [S or 1, T, R] contiguous;
    pages [N] flat (buf.dtype); b_rows [S, U, R] int64 contiguous: where row j of slice s's B
    transposed starts; token_slots [T] int (-1 = base); ranks [S, U] int; scaling [S, U] float32;
    slice_offsets: S + 1 python ints; meta as in lora_shrink. All slices run in one launch; only the
    true rank is read.
    """
    require(y.dim() == 2 and buf.dim() == 3 and pages.dim() == 1 and b_rows.dim() == 3,
            f"y [T, out], buf [S, T, R], pages [N], b_rows [S, U, R]: got {tuple(y.shape)}, {tuple(buf.shape)}, "
            f"{tuple(pages.shape)}, {tuple(b_rows.shape)}")
    tokens, out_total = y.shape
    num_slices, num_slots, max_rank = b_rows.shape
    offsets = tuple(int(o) for o in slice_offsets)
    require(len(offsets) == num_slices + 1 and offsets[0] >= 0 and offsets[-1] <= out_total
            and all(a <= b for a, b in zip(offsets, offsets[1:], strict=False)),
            f"slice_offsets {offsets} do not fit {num_slices} slices of y [T, {out_total}]")
    require_shape("buf", buf, (num_slices if buf.shape[0] != 1 else 1, tokens, max_rank))
    require_shape("ranks", ranks, (num_slices, num_slots))
    require_shape("scaling", scaling, (num_slices, num_slots))
    require_float("y", y)
    require_float("buf", buf)
    require_float("pages", pages, buf.dtype)
    require(scaling.dtype == torch.float32, f"scaling: expected float32, got {scaling.dtype}")
    require(b_rows.dtype == torch.int64, f"b_rows: expected int64, got {b_rows.dtype}")
    require_index("token_slots", token_slots, tokens)
    require_contiguous(buf=buf, pages=pages, b_rows=b_rows, ranks=ranks, scaling=scaling)
    require_last_dim_contiguous(y=y)
    require_same_device(y=y, buf=buf, pages=pages, b_rows=b_rows, token_slots=token_slots, ranks=ranks,
                        scaling=scaling)
    if meta is None:
        meta = LoRAMeta.build(token_slots, num_slots)
    require(meta.num_slots == num_slots and meta.sorted_tokens.shape[0] == tokens, "meta does not fit this batch")
    max_width = max(b - a for a, b in zip(offsets, offsets[1:], strict=False))
    if tokens == 0 or max_rank == 0 or max_width == 0 or num_slots == 0:
        return
    config = _config(tokens, max_rank)
    grid = (triton.cdiv(tokens, config["BLOCK_M"]) * triton.cdiv(max_width, config["BLOCK_N"]), num_slices, num_slots)
    _lora_expand_kernel[grid](
        buf, pages, b_rows, y, meta.sorted_tokens, meta.slot_counts, meta.slot_starts, ranks, scaling,
        _offsets_tensor(offsets, y.device),
        tokens, max_width, max_rank,
        buf.stride(0) if buf.shape[0] > 1 else 0, buf.stride(1), b_rows.stride(0), b_rows.stride(1), ranks.stride(0), y.stride(0),
        scaling.stride(0), PRECISION=dot_precision(buf.dtype), **config,
    )
