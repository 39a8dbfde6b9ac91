"""Batched multi-LoRA in one launch: each program takes a block of one adapter's tokens, computes their
x @ A.T and adds its share of the columns of that times B.T into y, for every slice of a fused projection
(q/k/v, gate/up) at once. S-LoRA/Punica's shrink and expand, fused: no intermediate buffer, nothing allocated.

What the fusion costs is the serial loop over in_dim that every program runs, recomputed by each of the
`splits` programs that share a block's columns. `plan` (the only place tuning is chosen) sizes the K tile to
make that loop short and picks the splits with a cost model, in microseconds (docs/gpu.md, "lora_delta's
launch"): a program costs ITERATION_US per step of its two loops (kernels.log on an H200: down T=1 took 140 µs
for 224 steps that each waited on global memory); programs beyond what the SMs hold run in waves; the bytes
read cost UNIQUE_BYTES_PER_US once and REREAD_BYTES_PER_US for every split after the first (x @ A.T again);
the launch takes the larger of the two. Rows that start 16-byte aligned (`row_align`, the engine's pages)
are read with vector loads pipelined through shared memory (cp.async), so the K tile is bounded by shared
memory; unaligned rows go through registers, in tiles half as large."""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, dot_precision, multiprocessor_count, next_power_of_2
from kernels.lora_meta import BLOCK_M, LoRAMeta, max_blocks

MAX_SLICES = 3  # q/k/v
ITERATION_US = 0.6  # one step of a program's loop that waits on global memory (kernels.log, down T=1: 140/224)
UNIQUE_BYTES_PER_US = 4.16e6  # the H200's device-to-device copy (kernels.log: 4159 GB/s)
REREAD_BYTES_PER_US = 2.1e6  # x and A re-read by the splits (kernels.log, down T=64 r=64: 1.9 GB in 895 µs)
SHARED_MEMORY_PER_SM = 228 * 1024  # H100/H200
MOST_PROGRAMS_PER_SM = 3  # registers: ptxas gives the kernel 64-150 per thread (4 warps: 136 at bk=64)
ALIGNED_TILE = 20480  # (BLOCK_M + BLOCK_R) * BLOCK_K values of the K loop's tiles per stage, rows aligned
UNALIGNED_TILE = 8192  # the same in registers (unaligned rows): more spills


@dataclass(frozen=True)
class DeltaConfig:
    """One launch's tuning."""

    block_k: int  # in_dim values per step of the K loop (x @ A.T)
    block_n: int  # output columns per step of the N loop (· B.T)
    splits: int  # programs sharing a block's columns of a slice; each recomputes x @ A.T
    num_warps: int = 4
    num_stages: int = 3  # Triton's software pipeline: stages - 1 tiles in flight

    def __str__(self) -> str:
        return f"bk={self.block_k} bn={self.block_n} splits={self.splits} warps={self.num_warps} stages={self.num_stages}"


@functools.lru_cache(maxsize=1024)
def plan(num_tokens: int, num_slots: int, in_dim: int, widths: tuple[int, ...], max_rank: int, row_align: int,
         itemsize: int = 2, sms: int = 132) -> DeltaConfig:
    """The configuration the cost model finds fastest for a launch of this static shape (cached: a step pays a
    lookup; a new shape about a millisecond). The number of distinct adapters is not known on the host: it takes
    the most blocks the tokens can make (each adapter's tokens in their own blocks)."""
    block_r = max(16, next_power_of_2(max_rank))
    budget = ALIGNED_TILE if row_align * itemsize >= 16 else UNALIGNED_TILE
    block_k = max(16, min(next_power_of_2(in_dim), _floor_power_of_2(budget // (BLOCK_M + block_r))))
    warps = 8 if (BLOCK_M + block_r) * block_k > 8192 else 4
    max_width = max(widths)
    block_ns = (64,) if max_width <= 64 else tuple(n for n in (128, 256) if n == 128 or block_r * n <= budget)
    best, best_us = None, float("inf")
    for block_n in block_ns:
        tiles = cdiv(max_width, block_n)
        for splits in sorted({cdiv(tiles, per) for per in range(1, tiles + 1)}):  # each split of the tiles once
            config = DeltaConfig(block_k, block_n, splits, warps)
            us = estimate_us(config, num_tokens, num_slots, in_dim, widths, max_rank, itemsize, sms)
            if us < best_us * 0.99:  # a near tie goes to fewer programs
                best, best_us = config, us
    return best


def estimate_us(config: DeltaConfig, num_tokens: int, num_slots: int, in_dim: int, widths: tuple[int, ...],
                max_rank: int, itemsize: int = 2, sms: int = 132) -> float:
    """The cost model's time of one launch (module docstring), with as many blocks as the tokens can make."""
    blocks = max(cdiv(num_tokens, BLOCK_M), min(num_tokens, num_slots))
    rows = max(1, num_tokens // blocks)  # x rows a block reads (masked rows are not read)
    per_program = _per_program(config, max(widths))
    active = sum(cdiv(width, per_program) for width in widths)  # programs per block that have columns
    program_us = (cdiv(in_dim, config.block_k) + per_program // config.block_n) * ITERATION_US
    block_r = max(16, next_power_of_2(max_rank))
    shared = (config.num_stages - 1) * (BLOCK_M + block_r) * config.block_k * itemsize
    resident = sms * max(1, min(MOST_PROGRAMS_PER_SM, SHARED_MEMORY_PER_SM // max(shared, 1)))
    a_and_x = (max_rank + rows) * in_dim * itemsize  # what each program of a block reads again
    unique = blocks * (len(widths) * a_and_x + sum(widths) * (max_rank + 2 * rows) * itemsize)
    reread = blocks * (active - len(widths)) * a_and_x
    return max(cdiv(blocks * active, resident) * program_us,
               unique / UNIQUE_BYTES_PER_US + reread / REREAD_BYTES_PER_US)


def _per_program(config: DeltaConfig, max_width: int) -> int:
    """Columns of a slice each program takes: the widest slice cut in `splits`, whole BLOCK_N tiles."""
    return cdiv(cdiv(max_width, config.splits), config.block_n) * config.block_n


def _floor_power_of_2(value: int) -> int:
    return 1 << (max(int(value), 1).bit_length() - 1)


@triton.jit(do_not_specialize=["col_blocks"])
def _lora_delta_kernel(
    y_ptr, x_ptr, pages_ptr, a_rows_ptr, b_rows_ptr, ranks_ptr, scaling_ptr,
    sorted_ptr, counts_ptr, starts_ptr, block_slots_ptr, block_offsets_ptr,
    in_dim, col_blocks, max_rank, off0, off1, off2, off3,
    y_stride, x_stride, a_stride_s, rows_stride_s, rows_stride_u, ranks_stride_s, scaling_stride_s,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    ROW_ALIGN: tl.constexpr, PRECISION: tl.constexpr,
):
    split = tl.program_id(0)  # fastest: a block's splits run side by side and share its rows of A in L2
    block = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(block_slots_ptr + block)
    if slot < 0:  # past the step's blocks
        return
    rank = tl.minimum(tl.load(ranks_ptr + s * ranks_stride_s + slot), max_rank)
    o0 = tl.where(s == 0, off0, tl.where(s == 1, off1, off2))
    o1 = tl.where(s == 0, off1, tl.where(s == 1, off2, off3))
    per_program = col_blocks * BLOCK_N  # a multiple of BLOCK_N the compiler can see (vector loads of B and y)
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
    a_rows = tl.multiple_of(a_rows, ROW_ALIGN)  # the caller's promise (row_align): vector loads, pipelined
    b_rows = tl.multiple_of(b_rows, ROW_ALIGN)
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
    row_align: int = 1,
    config: DeltaConfig | None = None,
) -> None:
    """y[t, o0:o1] += scaling[s, a] * (x[t] @ A_sa.T) @ B_sa.T for every slice s, a = token_slots[t] >= 0 (see
    kernels.reference.lora_delta). One launch for all slices; programs of empty blocks and of slices an adapter
    leaves alone exit at once.

    y [T, out] (in place) and x [T, in]: last dim contiguous; pages [N] flat, x.dtype; a_rows, b_rows [S, U, R]
    int64 with the same strides and a contiguous last dim (views of one table do; a_rows may be [1, U, R]
    when every slice reads one A); token_slots [T'] int, T' >= T:
    checked against meta only by its length (meta, a LoRAMeta over U slots filled from it, carries the grouping);
    ranks [S, U] int32, scaling [S, U] float32: last dim contiguous; slice_offsets: S + 1 ints, S <= 3.
    row_align: the caller's promise that every row an adapter's rank reaches (a_rows, b_rows) starts at a multiple
    of this many values (the engine's pages: engine.paged_memory.ROW_ALIGN); a broken promise faults on the GPU.
    config: this launch's tuning (default: `plan`'s; benchmarks/kernel_lora_configs.py tries others).
    Only the cheap checks run here (this is the hot path): the tables are checked when they are made
    (engine.lora_batch)."""
    tokens, in_dim = x.shape
    num_slices, num_slots, max_rank = b_rows.shape
    if not (y.shape[0] == tokens <= meta.num_tokens and meta.num_slots == num_slots and x.stride(1) == 1
            and y.stride(1) == 1 and pages.dtype == x.dtype and len(slice_offsets) == num_slices + 1 <= MAX_SLICES + 1
            and slice_offsets[-1] <= y.shape[1] and row_align >= 1):
        raise ValueError(f"lora_delta: y {tuple(y.shape)}, x {tuple(x.shape)} ({x.dtype}), pages {pages.dtype}, "
                         f"tables {tuple(b_rows.shape)}, slices {slice_offsets}, meta of {meta.num_tokens} tokens "
                         f"over {meta.num_slots} slots, row_align {row_align} do not fit")
    if tokens == 0 or num_slots == 0:
        return
    widths = tuple(b - a for a, b in zip(slice_offsets, slice_offsets[1:], strict=False))
    aligned = min(row_align & -row_align, 16 // x.element_size())  # the largest power of two it promises, <= 16 B
    if config is None:  # planned for a power of two of tokens: a few plans serve every step's count
        config = plan(next_power_of_2(tokens), num_slots, in_dim, widths, max_rank, aligned, x.element_size(),
                      multiprocessor_count(x.device))
    per_program = _per_program(config, max(widths))
    grid = (cdiv(max(widths), per_program), max_blocks(tokens, num_slots), num_slices)
    offsets = (*slice_offsets, *(slice_offsets[-1],) * (MAX_SLICES + 1 - len(slice_offsets)))
    a_strides, b_strides = a_rows.stride(), b_rows.stride()
    _lora_delta_kernel[grid](
        y, x, pages, a_rows, b_rows, ranks, scaling,
        meta.sorted_tokens, meta.slot_counts, meta.slot_starts, meta.block_slots, meta.block_offsets,
        in_dim, per_program // config.block_n, max_rank, *offsets,
        y.stride(0), x.stride(0), a_strides[0] if a_rows.shape[0] > 1 else 0, b_strides[0], b_strides[1],
        ranks.stride(0), scaling.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, BLOCK_R=max(16, next_power_of_2(max_rank)),
        ROW_ALIGN=aligned, PRECISION=dot_precision(x.dtype), num_warps=config.num_warps, num_stages=config.num_stages,
    )
