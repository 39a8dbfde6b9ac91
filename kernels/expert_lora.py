"""LoRA on the experts of a mixture-of-experts layer: every (token, expert) row of the expert-sorted batch adds
its own adapter's LoRA of its own expert, the A and B rows read from paged memory through a page table."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    next_power_of_2,
    require,
    require_contiguous,
    require_float,
    require_index,
    require_same_device,
    require_shape,
)
from kernels.lora_expand import _offsets_tensor

BLOCK_K, BLOCK_N = 64, 64  # tuning (the only place it is chosen): input columns, output columns per step
NUM_WARPS = 4


@triton.jit(do_not_specialize=["max_rank"])
def _expert_lora_kernel(
    y_ptr, x_ptr, pages_ptr, a_rows_ptr, b_rows_ptr, slots_ptr, experts_ptr, ranks_ptr, scaling_ptr, offsets_ptr,
    in_dim, num_slices, max_rank, y_stride, x_stride, rows_stride_u, rows_stride_e, b_rows_stride_s,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # base model
        return
    rank = tl.minimum(tl.load(ranks_ptr + slot).to(tl.int32), max_rank)
    if rank == 0:  # the adapter leaves this module alone
        return
    expert = tl.load(experts_ptr + row).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    table = slot * rows_stride_u + expert * rows_stride_e + offs_r
    a_rows = tl.load(a_rows_ptr + table, mask=r_mask, other=0)  # [R] where each A row starts
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)  # x[row] @ A.T
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_ptr + row * x_stride + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(pages_ptr + a_rows[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [R, K]
        h += tl.sum(a * x[None, :], axis=1)
    h = h * tl.load(scaling_ptr + slot)
    for s in range(num_slices):
        lo = tl.load(offsets_ptr + s)
        width = tl.load(offsets_ptr + s + 1) - lo
        b_rows = tl.load(b_rows_ptr + s * b_rows_stride_s + table, mask=r_mask, other=0)  # [R] rows of B^T
        for n0 in range(0, width, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < width
            b = tl.load(pages_ptr + b_rows[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                        other=0.0).to(tl.float32)  # [R, N]
            delta = tl.sum(h[:, None] * b, axis=0)  # [N]
            y_ptrs = y_ptr + row * y_stride + lo + offs_n
            y = tl.load(y_ptrs, mask=n_mask, other=0.0)
            tl.store(y_ptrs, y + delta.to(y.dtype), mask=n_mask)


def expert_lora(y: torch.Tensor, x: torch.Tensor, pages: torch.Tensor, a_rows: torch.Tensor, b_rows: torch.Tensor,
                row_slots: torch.Tensor, row_experts: torch.Tensor, ranks: torch.Tensor, scaling: torch.Tensor,
                slice_offsets: tuple[int, ...], *, meta: object = None) -> None:
    """Each row's LoRA of its adapter's own expert, added in place, over S output slices (gate and up):

    for n in range(N), s in range(S): a, e = row_slots[n], row_experts[n]; (o0, o1) = slice_offsets[s : s + 2]
        if a >= 0: for j < ranks[a]:
            A_j = pages[a_rows[a, e, j] : + in]; B_sj = pages[b_rows[s, a, e, j] : + o1 - o0]  (B^T's row j)
            y[n, o0:o1] += scaling[a] * (x[n] @ A_j) * B_sj

    y [N, out] (updated in place); x [N, in]; pages [P] flat, x.dtype; a_rows [U, E, R] int64; b_rows
    [S, U, E, R] int64; row_slots [N] int (-1 = base model); row_experts [N] int; ranks [U] int (each expert's
    rank, 0: not adapted); scaling [U] float32; slice_offsets: S + 1 python ints from 0 to out. `meta` is the
    references' (the step's SlotBatch); the launcher needs none."""
    require(y.dim() == 2 and x.dim() == 2 and y.shape[0] == x.shape[0],
            f"y [N, out], x [N, in]: got {tuple(y.shape)}, {tuple(x.shape)}")  # fmt: skip
    rows, in_dim = x.shape
    out_dim = y.shape[1]
    require(a_rows.dim() == 3, f"a_rows [U, E, R]: got {tuple(a_rows.shape)}")
    used, experts, max_rank = a_rows.shape
    num_slices = len(slice_offsets) - 1
    require_shape("b_rows", b_rows, (num_slices, used, experts, max_rank))
    require(slice_offsets[0] == 0 and slice_offsets[-1] == out_dim and list(slice_offsets) == sorted(slice_offsets),
            f"slice_offsets must rise from 0 to {out_dim}: got {slice_offsets}")
    require_float("x", x)
    require_float("y", y)
    require_float("pages", pages, x.dtype)
    require_index("row_slots", row_slots, rows)
    require_index("row_experts", row_experts, rows)
    require_index("ranks", ranks, used)
    require(scaling.dtype == torch.float32, f"scaling: expected float32, got {scaling.dtype}")
    require_shape("scaling", scaling, (used,))
    require_contiguous(y=y, x=x, pages=pages, a_rows=a_rows, b_rows=b_rows, scaling=scaling)
    require_same_device(y=y, x=x, pages=pages, a_rows=a_rows, b_rows=b_rows, row_slots=row_slots,
                        row_experts=row_experts, ranks=ranks, scaling=scaling)
    if rows == 0 or max_rank == 0 or used == 0 or out_dim == 0:
        return
    offsets = _offsets_tensor(slice_offsets, y.device)  # cached: nothing copied per call
    _expert_lora_kernel[(rows,)](
        y, x, pages, a_rows, b_rows, row_slots, row_experts, ranks, scaling, offsets,
        in_dim, num_slices, max_rank, y.stride(0), x.stride(0), a_rows.stride(0), a_rows.stride(1), b_rows.stride(0),
        BLOCK_R=next_power_of_2(max_rank), BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
    )
