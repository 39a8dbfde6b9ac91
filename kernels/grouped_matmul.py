"""Grouped matmul: the experts of a mixture-of-experts layer, each over its own rows of an expert-sorted batch."""

import torch
import triton
import triton.language as tl

from kernels.launch import dot_precision, require, require_float, require_index, require_last_dim_contiguous

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tuning (the only place it is chosen): rows, output columns, reduction
NUM_WARPS = 4


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, offsets_ptr, out_dim, in_dim,
    x_stride, w_stride_e, w_stride_n, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_mn = tl.program_id(0)
    expert = tl.program_id(1)
    start = tl.load(offsets_ptr + expert).to(tl.int64)
    count = tl.load(offsets_ptr + expert + 1).to(tl.int64) - start
    pid_m = pid_mn // tl.cdiv(out_dim, BLOCK_N)
    pid_n = pid_mn % tl.cdiv(out_dim, BLOCK_N)
    if pid_m * BLOCK_M >= count:  # this expert has fewer rows (or none)
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = start + offs_m  # [BLOCK_M] rows of x and out
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_dim
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e + offs_n[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [K, N]
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """out[r] = x[r] @ weight[e].T for every row r in expert_offsets[e] <= r < expert_offsets[e + 1].

    x [N, in] sorted by expert; weight [E, out, in] (each expert's nn.Linear weight); expert_offsets [E + 1]
    int, non-decreasing, from 0 to N. Returns out [N, out] in x.dtype (float32 accumulation)."""
    require(x.dim() == 2 and weight.dim() == 3, f"x [N, in], weight [E, out, in]: got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}")  # fmt: skip
    experts, out_dim, in_dim = weight.shape
    require(x.shape[1] == in_dim, f"x has {x.shape[1]} columns, weight {in_dim}")
    require_float("x", x)
    require_float("weight", weight, x.dtype)
    require_index("expert_offsets", expert_offsets, experts + 1)
    require_last_dim_contiguous(x=x, weight=weight)
    out = torch.empty(x.shape[0], out_dim, dtype=x.dtype, device=x.device)  # [N, out]
    if x.shape[0] == 0 or out_dim == 0:
        return out
    require(int(expert_offsets[-1]) == x.shape[0], f"expert_offsets end at {int(expert_offsets[-1])}, x has "
            f"{x.shape[0]} rows")  # fmt: skip
    max_rows = int((expert_offsets[1:] - expert_offsets[:-1]).max())
    grid = (triton.cdiv(max_rows, BLOCK_M) * triton.cdiv(out_dim, BLOCK_N), experts)
    _grouped_matmul_kernel[grid](
        x, weight, out, expert_offsets, out_dim, in_dim, x.stride(0), weight.stride(0), weight.stride(1),
        out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=dot_precision(x.dtype),
        num_warps=NUM_WARPS,
    )
    return out
