"""Batched multi-LoRA in one launch: each program takes a block of one adapter's tokens, computes their
x @ A.T (rank is small, so every program of the block recomputes it) and adds its columns of that times B.T into
y, for every slice of a fused projection (q/k/v, gate/up) at once. S-LoRA/Punica's shrink and expand, fused: no
intermediate buffer, no split-K, nothing allocated."""

import functools

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, dot_precision, next_power_of_2
from kernels.lora_meta import BLOCK_M, LoRAMeta, max_blocks

MAX_SLICES = 3  # q/k/v
TARGET_PROGRAMS = 1024  # programs a launch aims at when it splits the columns


@functools.lru_cache(maxsize=1024)
def _config(num_tokens: int, num_slots: int, in_dim: int, slice_offsets: tuple[int, ...], max_rank: int) -> tuple:
    """Tuning and grid of one launch shape (the only place they are chosen; cached, so a step pays a lookup).
    Returns (grid, the slices' offsets padded to MAX_SLICES + 1, columns per program, constexprs)."""
    num_slices = len(slice_offsets) - 1
    max_width = max(b - a for a, b in zip(slice_offsets, slice_offsets[1:], strict=False))
    block_n = 64 if max_width <= 64 else 128
    # with few blocks of tokens (a decode step), split the columns over more programs (each recomputes its
    # x @ A.T); the blocks of a step are not known on the host: as many as distinct adapters can make
    blocks = max(1, min(num_tokens, num_slots))
    splits = max(1, min(cdiv(max_width, block_n), TARGET_PROGRAMS // (blocks * num_slices)))
    per_program = cdiv(cdiv(max_width, splits), block_n) * block_n
    grid = (max_blocks(num_tokens, num_slots), cdiv(max_width, per_program), num_slices)
    offsets = (*slice_offsets, *(slice_offsets[-1],) * (MAX_SLICES + 1 - len(slice_offsets)))
    constexprs = {"BLOCK_M": BLOCK_M, "BLOCK_N": block_n, "BLOCK_K": 64 if in_dim >= 64 else 32,
                  "BLOCK_R": max(16, next_power_of_2(max_rank)), "num_warps": 4}
    return grid, offsets, per_program, constexprs


@triton.jit(do_not_specialize=["per_program"])
def _lora_delta_kernel(
    y_ptr, x_ptr, pages_ptr, a_rows_ptr, b_rows_ptr, ranks_ptr, scaling_ptr,
    sorted_ptr, counts_ptr, starts_ptr, block_slots_ptr, block_offsets_ptr,
    in_dim, per_program, max_rank, off0, off1, off2, off3,
    y_stride, x_stride, a_stride_s, rows_stride_s, rows_stride_u, ranks_stride_s, scaling_stride_s,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    split = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(block_slots_ptr + block)
    if slot < 0:  # past the step's blocks
        return
    rank = tl.minimum(tl.load(ranks_ptr + s * ranks_stride_s + slot), max_rank)
    o0 = tl.where(s == 0, off0, tl.where(s == 1, off1, off2))
    o1 = tl.where(s == 0, off1, tl.where(s == 1, off2, off3))
    c0 = split * per_program  # this program's columns of the slice: c0 .. c0 + per_program - 1
    if (rank == 0) | (o0 + c0 >= o1):  # the adapter leaves this slice alone, or the slice is narrower
        return
    slot = slot.to(tl.int64)
    first = tl.load(block_offsets_ptr + block)
    offs_m = first + tl.arange(0, BLOCK_M)
    m_mask = offs_m < tl.load(counts_ptr + slot)
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # the page tables: where each of this slice's A rows and B-transposed rows starts in the page memory
    a_rows = tl.load(a_rows_ptr + s * a_stride_s + slot * rows_stride_u + offs_r, mask=r_mask, other=0)
    b_rows = tl.load(b_rows_ptr + s * rows_stride_s + slot * rows_stride_u + offs_r, mask=r_mask, other=0)
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # x @ A.T
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_ptr + tokens[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a = tl.load(pages_ptr + a_rows[None, :] + offs_k[:, None], mask=r_mask[None, :] & k_mask[:, None],
                    other=0.0)
        h += tl.dot(x, a, input_precision=PRECISION)
    h_in = h.to(pages_ptr.dtype.element_ty)  # rounded as the two-launch shrink's buffer was
    scale = tl.load(scaling_ptr + s * scaling_stride_s + slot)
    end = tl.minimum(c0 + per_program, o1 - o0)
    for n0 in range(c0, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        n_mask = cols < end
        b = tl.load(pages_ptr + b_rows[:, None] + cols[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = tl.dot(h_in, b, input_precision=PRECISION)
        y_ptrs = y_ptr + tokens[:, None] * y_stride + (o0 + cols)[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta * scale).to(y.dtype), mask=mask)


def lora_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    pages: torch.Tensor,
    a_rows: torch.Tensor,
    b_rows: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    scaling: torch.Tensor,
    slice_offsets: tuple[int, ...],
    *,
    meta: LoRAMeta,
) -> None:
    """y[t, o0:o1] += scaling[s, a] * (x[t] @ A_sa.T) @ B_sa.T for every slice s, a = token_slots[t] >= 0 (see
    kernels.reference.lora_delta). One launch for all slices; programs of empty blocks and of slices an adapter
    leaves alone exit at once.

    y [T, out] (in place) and x [T, in]: last dim contiguous; pages [N] flat, x.dtype; a_rows, b_rows [S, U, R]
    int64 with the same strides and a contiguous last dim (views of one table do; a_rows may be [1, U, R]
    when every slice reads one A); token_slots [T'] int, T' >= T:
    checked against meta only by its length (meta, a LoRAMeta over U slots filled from it, carries the grouping);
    ranks [S, U] int32, scaling [S, U] float32: last dim contiguous; slice_offsets: S + 1 ints, S <= 3.
    Only the cheap checks run here (this is the hot path): the tables are checked when they are made
    (engine.lora_batch)."""
    tokens, in_dim = x.shape
    num_slices, num_slots, max_rank = b_rows.shape
    if not (y.shape[0] == tokens <= meta.num_tokens and meta.num_slots == num_slots and x.stride(1) == 1
            and y.stride(1) == 1 and pages.dtype == x.dtype and len(slice_offsets) == num_slices + 1 <= MAX_SLICES + 1
            and slice_offsets[-1] <= y.shape[1]):
        raise ValueError(f"lora_delta: y {tuple(y.shape)}, x {tuple(x.shape)} ({x.dtype}), pages {pages.dtype}, "
                         f"tables {tuple(b_rows.shape)}, slices {slice_offsets}, meta of {meta.num_tokens} tokens "
                         f"over {meta.num_slots} slots do not fit")
    if tokens == 0 or num_slots == 0:
        return
    grid, offsets, per_program, constexprs = _config(tokens, num_slots, in_dim, tuple(slice_offsets), max_rank)
    a_strides, b_strides = a_rows.stride(), b_rows.stride()
    _lora_delta_kernel[grid](
        y, x, pages, a_rows, b_rows, ranks, scaling,
        meta.sorted_tokens, meta.slot_counts, meta.slot_starts, meta.block_slots, meta.block_offsets,
        in_dim, per_program, max_rank, *offsets,
        y.stride(0), x.stride(0), a_strides[0] if a_rows.shape[0] > 1 else 0, b_strides[0], b_strides[1],
        ranks.stride(0), scaling.stride(0), PRECISION=dot_precision(x.dtype), **constexprs,
    )
