"""Grouped matmul: the experts of a mixture-of-experts layer, each over its own rows of an expert-sorted batch;
their weights in the activation dtype, or in fp8 with a float32 scale per row and group of columns (an fp8
checkpoint's experts, dequantized in registers)."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    FP8,
    dot_precision,
    require,
    require_float,
    require_index,
    require_last_dim_contiguous,
    require_shape,
)

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32  # tuning (the only place it is chosen): rows, output columns, reduction
NUM_WARPS = 4


@triton.jit
def _grouped_matmul_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, offsets_ptr, block_expert_ptr, block_first_ptr, out_dim, in_dim, num_experts,
    group_k, x_stride, w_stride_e, w_stride_n, s_stride_e, s_stride_n, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    SCALED: tl.constexpr,
):
    block = tl.program_id(0)  # one of the step's row blocks, each within one expert
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # past the last row block: the grid is sized without reading the counts back
        return
    start = tl.load(offsets_ptr + expert).to(tl.int64)
    count = tl.load(offsets_ptr + expert + 1).to(tl.int64) - start
    pid_m = block - tl.load(block_first_ptr + expert)  # this block's place among its expert's
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = start + offs_m  # [BLOCK_M] rows of x and out
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_dim
    w_base = w_ptr + expert.to(tl.int64) * w_stride_e + offs_n[None, :].to(tl.int64) * w_stride_n
    s_base = s_ptr + expert.to(tl.int64) * s_stride_e + offs_n.to(tl.int64) * s_stride_n  # fp8: each row's scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_base + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [K, N]
        if SCALED:  # a K tile lies in one scale group (BLOCK_K divides group_k)
            scale = tl.load(s_base + k0 // group_k, mask=n_mask, other=0.0)  # [N]
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * scale[None, :]
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _row_blocks(expert_offsets: torch.Tensor, num_rows: int, experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(block_expert [B], block_first [E], B): the expert of each of B row blocks of BLOCK_M rows, each block
    within one expert (past the last: E), and each expert's first block; all on the device, no host read.
    B = cdiv(N, BLOCK_M) + E bounds the blocks any split of N rows over E experts needs."""
    counts = (expert_offsets[1:] - expert_offsets[:-1]).to(torch.int64)  # [E]
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = torch.cumsum(blocks, 0)  # [E]
    bound = triton.cdiv(num_rows, BLOCK_M) + experts
    block_expert = torch.searchsorted(ends, torch.arange(bound, device=ends.device), right=True)  # [B]
    return block_expert.to(torch.int32), (ends - blocks).to(torch.int32), bound


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
                   weight_scale: torch.Tensor | None = None, group_k: int = 0) -> torch.Tensor:
    """out[r] = x[r] @ weight[e].T for every row r in expert_offsets[e] <= r < expert_offsets[e + 1].

    x [N, in] sorted by expert; weight [E, out, in] (each expert's nn.Linear weight); expert_offsets [E + 1]
    int, non-decreasing, from 0 to N. Returns out [N, out] in x.dtype (float32 accumulation).
    An fp8 weight (float8_e4m3fn) comes with weight_scale [E, out, cdiv(in, group_k)] float32 and stands for
    weight[e, o, i] * weight_scale[e, o, i // group_k] (group_k a multiple of 32, or covering every column).
    Nothing is read back to the host: the grid covers the most row blocks N rows can need (a CPU tensor's
    offsets are checked to end at N; on CUDA that would cost a sync)."""
    require(x.dim() == 2 and weight.dim() == 3, f"x [N, in], weight [E, out, in]: got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}")  # fmt: skip
    experts, out_dim, in_dim = weight.shape
    require(x.shape[1] == in_dim, f"x has {x.shape[1]} columns, weight {in_dim}")
    require_float("x", x)
    scaled = weight.dtype == FP8
    if scaled:
        require(weight_scale is not None and weight_scale.dtype == torch.float32,
                "weight_scale: an fp8 weight needs its float32 scales")  # fmt: skip
        require(group_k >= in_dim or (group_k > 0 and group_k % BLOCK_K == 0),
                f"group_k must be a multiple of {BLOCK_K} or cover every column, got {group_k}")  # fmt: skip
        require_shape("weight_scale", weight_scale, (experts, out_dim, triton.cdiv(in_dim, group_k)))
        require_last_dim_contiguous(weight_scale=weight_scale)
    else:
        require_float("weight", weight, x.dtype)
        require(weight_scale is None, f"weight_scale is for an fp8 weight, not {weight.dtype}")
    require_index("expert_offsets", expert_offsets, experts + 1)
    require_last_dim_contiguous(x=x, weight=weight)
    out = torch.empty(x.shape[0], out_dim, dtype=x.dtype, device=x.device)  # [N, out]
    if x.shape[0] == 0 or out_dim == 0:
        return out
    if not x.is_cuda:
        require(int(expert_offsets[-1]) == x.shape[0], f"expert_offsets end at {int(expert_offsets[-1])}, x has "
                f"{x.shape[0]} rows")  # fmt: skip
    block_expert, block_first, num_blocks = _row_blocks(expert_offsets, x.shape[0], experts)
    grid = (num_blocks, triton.cdiv(out_dim, BLOCK_N))
    scales = weight_scale if scaled else x  # unread without SCALED
    _grouped_matmul_kernel[grid](
        x, weight, scales, out, expert_offsets, block_expert, block_first, out_dim, in_dim, experts, max(group_k, 1),
        x.stride(0), weight.stride(0), weight.stride(1), scales.stride(0) if scaled else 0,
        scales.stride(1) if scaled else 0, out.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(x.dtype), SCALED=scaled, num_warps=NUM_WARPS,
    )
    return out
