"""Batched multi-LoRA shrink (x @ A.T, hidden -> rank) over a ragged batch, S-LoRA/Punica style: each
adapter's A rows are read from paged memory through a page table (a row offset per rank)."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    dot_precision,
    multiprocessor_count,
    next_power_of_2,
    require,
    require_contiguous,
    require_float,
    require_index,
    require_last_dim_contiguous,
    require_same_device,
    require_shape,
)
from kernels.lora_meta import LoRAMeta


def _config(num_tokens: int, in_dim: int, max_rank: int, num_slices: int, device: torch.device) -> dict:
    """Tuning for one launch: tile sizes, warps and split-K (the only place they are chosen)."""
    block_m = 16 if num_tokens <= 256 else 32
    block_n = min(max(next_power_of_2(max_rank), 16), 64)
    block_k = 128 if in_dim >= 128 else max(next_power_of_2(in_dim), 16)
    tiles = triton.cdiv(num_tokens, block_m) * num_slices * triton.cdiv(max_rank, block_n)
    split_k = 1
    while tiles * split_k < 2 * multiprocessor_count(device) and split_k * block_k * 2 <= in_dim and split_k < 32:
        split_k *= 2
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4}


@triton.jit(do_not_specialize=["num_tokens"])
def _lora_shrink_kernel(
    x_ptr, pages_ptr, rows_ptr, out_ptr, sorted_ptr, counts_ptr, starts_ptr, ranks_ptr,
    num_tokens, in_dim, max_rank,
    x_stride, rows_stride_s, rows_stride_slot, ranks_stride_s, out_stride_s, out_stride_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_sk = tl.program_id(1)
    slot = tl.program_id(2)
    s = pid_sk // SPLIT_K
    k_split = pid_sk % SPLIT_K
    count = tl.load(counts_ptr + slot)
    rank = tl.minimum(tl.load(ranks_ptr + s * ranks_stride_s + slot).to(tl.int32), max_rank)
    pid_m = pid_mn // tl.cdiv(max_rank, BLOCK_N)
    pid_n = pid_mn % tl.cdiv(max_rank, BLOCK_N)
    if (pid_m * BLOCK_M >= count) | (pid_n * BLOCK_N >= rank):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rank
    # the page table: where each of this slice's A rows starts in the page memory
    a_rows = tl.load(rows_ptr + s.to(tl.int64) * rows_stride_s + slot.to(tl.int64) * rows_stride_slot + offs_n,
                     mask=n_mask, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, in_dim, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_ptr + tokens[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a = tl.load(pages_ptr + a_rows[None, :] + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc += tl.dot(x, a, input_precision=PRECISION)
    out_ptrs = out_ptr + s * out_stride_s + tokens[:, None] * out_stride_t + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask)


def lora_shrink(
    x: torch.Tensor,
    pages: torch.Tensor,
    a_rows: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    *,
    meta: LoRAMeta | None = None,
) -> torch.Tensor:
    """buf[s, t, j] = x[t] @ pages[a_rows[s, a, j] :][:in] for j < ranks[s, a], a = token_slots[t] >= 0; else 0.

    x [T, in] (row stride free, last dim contiguous); pages [N] flat (x.dtype); a_rows [S, U, R] int64
    contiguous: where each A row starts; token_slots [T] int (-1 = base model); ranks [S, U] int
    contiguous; meta: the batch's LoRAMeta over U slots (built here when None; pass a prebuilt one to
    share it across layers or capture it in a CUDA graph). returns buf [S, T, R] in x.dtype. Tokens
    are grouped by adapter; only each slice's true rank is read, through the page table, and programs
    of unused adapters exit at once (an all-base batch does no work).
    """
    require(x.dim() == 2 and pages.dim() == 1 and a_rows.dim() == 3,
            f"x [T, in], pages [N], a_rows [S, U, R]: got {tuple(x.shape)}, {tuple(pages.shape)}, "
            f"{tuple(a_rows.shape)}")
    tokens, in_dim = x.shape
    num_slices, num_slots, max_rank = a_rows.shape
    require_float("x", x)
    require_float("pages", pages, x.dtype)
    require_index("token_slots", token_slots, tokens)
    require_shape("ranks", ranks, (num_slices, num_slots))
    require(a_rows.dtype == torch.int64, f"a_rows: expected int64, got {a_rows.dtype}")
    require_contiguous(pages=pages, a_rows=a_rows, ranks=ranks)
    require_last_dim_contiguous(x=x)
    require_same_device(x=x, pages=pages, a_rows=a_rows, token_slots=token_slots, ranks=ranks)
    if meta is None:
        meta = LoRAMeta.build(token_slots, num_slots)
    require(meta.num_slots == num_slots and meta.sorted_tokens.shape[0] == tokens, "meta does not fit this batch")
    config = _config(tokens, in_dim, max_rank, num_slices, x.device)
    split_k = config["SPLIT_K"]
    acc_dtype = x.dtype if split_k == 1 else torch.float32
    buf = torch.zeros(num_slices, tokens, max_rank, dtype=acc_dtype, device=x.device)  # [S, T, R]
    if tokens == 0 or max_rank == 0 or num_slots == 0:
        return buf.to(x.dtype)
    grid = (
        triton.cdiv(tokens, config["BLOCK_M"]) * triton.cdiv(max_rank, config["BLOCK_N"]),
        num_slices * split_k,
        num_slots,
    )
    _lora_shrink_kernel[grid](
        x, pages, a_rows, buf, meta.sorted_tokens, meta.slot_counts, meta.slot_starts, ranks,
        tokens, in_dim, max_rank,
        x.stride(0), a_rows.stride(0), a_rows.stride(1), ranks.stride(0), buf.stride(0), buf.stride(1),
        PRECISION=dot_precision(x.dtype), **config,
    )
    return buf.to(x.dtype)
