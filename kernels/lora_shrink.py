"""Batched multi-LoRA shrink (x @ A.T, hidden -> rank) over a ragged batch, S-LoRA/Punica style."""

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
    x_ptr, a_ptr, out_ptr, sorted_ptr, counts_ptr, starts_ptr, ranks_ptr,
    num_tokens, in_dim, max_rank,
    x_stride, a_stride_s, a_stride_slot, a_stride_r, out_stride_s, out_stride_t,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    pid_sk = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    rank = tl.minimum(tl.load(ranks_ptr + slot).to(tl.int32), max_rank)
    pid_m = pid_mn // tl.cdiv(max_rank, BLOCK_N)
    pid_n = pid_mn % tl.cdiv(max_rank, BLOCK_N)
    if (pid_m * BLOCK_M >= count) | (pid_n * BLOCK_N >= rank):
        return
    s = pid_sk // SPLIT_K
    k_split = pid_sk % SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rank
    a_base = a_ptr + s.to(tl.int64) * a_stride_s + slot.to(tl.int64) * a_stride_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_split * BLOCK_K, in_dim, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_ptr + tokens[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a = tl.load(a_base + offs_n[None, :] * a_stride_r + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
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
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    ranks: torch.Tensor,
    *,
    meta: LoRAMeta | None = None,
) -> torch.Tensor:
    """buf[s, t, :r] = x[t] @ lora_a[s, a, :r].T where a = token_slots[t] >= 0, r = ranks[a]; else 0.

    x [T, in] (row stride free, last dim contiguous); lora_a [S, slots, max_rank, in] contiguous;
    token_slots [T] int (-1 = base model); ranks [slots] int; meta: the batch's LoRAMeta (built
    here when None; pass a prebuilt one to share it across layers or capture it in a CUDA graph).
    returns buf [S, T, max_rank] in x.dtype. Tokens are grouped by slot; only the true rank is
    computed, and programs of unused slots exit at once (an all-base batch does no work).
    """
    require(x.dim() == 2 and lora_a.dim() == 4, f"x [T, in], lora_a [S, slots, max_rank, in]: got "
            f"{tuple(x.shape)}, {tuple(lora_a.shape)}")
    tokens, in_dim = x.shape
    num_slices, num_slots, max_rank, a_in = lora_a.shape
    require(a_in == in_dim, f"lora_a in_dim {a_in} != x in_dim {in_dim}")
    require_float("x", x)
    require_float("lora_a", lora_a, x.dtype)
    require_index("token_slots", token_slots, tokens)
    require_index("ranks", ranks, num_slots)
    require_contiguous(lora_a=lora_a)
    require_last_dim_contiguous(x=x)
    require_same_device(x=x, lora_a=lora_a, token_slots=token_slots, ranks=ranks)
    if meta is None:
        meta = LoRAMeta.build(token_slots, num_slots)
    require(meta.num_slots == num_slots and meta.sorted_tokens.shape[0] == tokens, "meta does not fit this batch")
    config = _config(tokens, in_dim, max_rank, num_slices, x.device)
    split_k = config["SPLIT_K"]
    acc_dtype = x.dtype if split_k == 1 else torch.float32
    buf = torch.zeros(num_slices, tokens, max_rank, dtype=acc_dtype, device=x.device)  # [S, T, max_rank]
    if tokens == 0 or max_rank == 0:
        return buf.to(x.dtype)
    grid = (
        triton.cdiv(tokens, config["BLOCK_M"]) * triton.cdiv(max_rank, config["BLOCK_N"]),
        num_slices * split_k,
        num_slots,
    )
    _lora_shrink_kernel[grid](
        x, lora_a, buf, meta.sorted_tokens, meta.slot_counts, meta.slot_starts, ranks,
        tokens, in_dim, max_rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), buf.stride(0), buf.stride(1),
        PRECISION=dot_precision(x.dtype), **config,
    )
    return buf.to(x.dtype)
