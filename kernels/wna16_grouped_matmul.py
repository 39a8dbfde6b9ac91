"""The experts of an MoE layer in 4 or 8 bits: each expert's packed weight over its rows of an expert-sorted batch,
dequantized in registers (kernels/wna16_linear.py's tile, kernels/grouped_matmul.py's row blocks)."""

import torch
import triton
import triton.language as tl

from kernels.grouped_matmul import BLOCK_M, _row_blocks
from kernels.launch import dot_precision, require, require_contiguous, require_float, require_index
from kernels.wna16_linear import block_k_for, unpacked_words
from kernels.wna16_reference import WNA16_BITS

BLOCK_N = 64  # tuning (the only place it is chosen): output columns; the reduction tile is wna16_linear's
NUM_WARPS = 4


@triton.jit
def _wna16_grouped_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, out_ptr, offsets_ptr, block_expert_ptr, block_first_ptr,
    out_dim, in_dim, num_groups, num_experts, x_stride, out_stride,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    block = tl.program_id(0)  # one of the step's row blocks, each within one expert
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= num_experts:  # past the last row block
        return
    start = tl.load(offsets_ptr + expert).to(tl.int64)
    count = tl.load(offsets_ptr + expert + 1).to(tl.int64) - start
    offs_m = (block - tl.load(block_first_ptr + expert)) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = start + offs_m
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_dim
    packed_n = out_dim // PER
    e64 = expert.to(tl.int64)
    qweight_ptr += e64 * (in_dim // PER) * out_dim
    scales_ptr += e64 * num_groups * out_dim
    zeros_ptr += e64 * num_groups * packed_n
    g_idx_ptr += e64 * in_dim
    if HAS_PERM:
        perm_ptr += e64 * in_dim
    z_shift = ((offs_n % PER) * BITS)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        if HAS_PERM:  # act order sorted at load: x's columns in the weights' order
            cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        else:
            cols = offs_k
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = k0 // PER + tl.arange(0, BLOCK_K // PER)
        packed = tl.load(qweight_ptr + words[None, :].to(tl.int64) * out_dim + offs_n[:, None],
                         mask=n_mask[:, None] & (words < in_dim // PER)[None, :], other=0)  # [N, K // p], read once
        q = tl.trans(unpacked_words(packed, BITS))  # [K, N]
        if GROUP_SIZE > 0:  # groups in order: one row of scales and zeros per tile (BLOCK_K divides a group)
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + group * out_dim + offs_n, mask=n_mask, other=0.0)[None, :]  # [1, N]
            zero_word = tl.load(zeros_ptr + group * packed_n + offs_n // PER, mask=n_mask, other=0)[None, :]
        else:  # act order: each input channel's own group
            group = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0).to(tl.int64)  # [K]
            scale = tl.load(scales_ptr + group[:, None] * out_dim + offs_n[None, :], mask=kn_mask, other=0.0)
            zero_word = tl.load(zeros_ptr + group[:, None] * packed_n + (offs_n // PER)[None, :], mask=kn_mask,
                                other=0)
        zero = (zero_word >> z_shift) & MASK
        w = ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out_ptrs = out_ptr + rows[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def wna16_grouped_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                         g_idx: torch.Tensor, expert_offsets: torch.Tensor, bits: int, *, group_size: int = 0,
                         perm: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.reference.wna16_grouped_matmul; nothing is read back to the host (the grid
    covers the most row blocks N rows can need, as kernels.grouped_matmul's). group_size > 0: every expert's
    g_idx in order, one row of scales and zeros per tile; perm [E, K]: each expert's order of x's columns."""
    require(bits in WNA16_BITS, f"wna16_grouped_matmul: bits must be one of {WNA16_BITS}, got {bits}")
    per = 32 // bits
    require(x.dim() == 2 and qweight.dim() == 3 and qweight.dtype == torch.int32,
            f"x [N, K], qweight [E, K // {per}, M] int32: got {tuple(x.shape)}, {tuple(qweight.shape)} {qweight.dtype}")
    experts, _, out_dim = qweight.shape
    in_dim = x.shape[1]
    require(in_dim % per == 0 and out_dim % per == 0 and qweight.shape[1] == in_dim // per,
            f"wna16_grouped_matmul: K ({in_dim}), M ({out_dim}) must be multiples of {per}, qweight "
            f"{tuple(qweight.shape)}")  # fmt: skip
    groups = scales.shape[1]
    require(tuple(scales.shape) == (experts, groups, out_dim) and tuple(zeros.shape) == (experts, groups, out_dim // per)
            and tuple(g_idx.shape) == (experts, in_dim), f"scales [E, G, M], zeros [E, G, M // {per}], g_idx [E, K]: "
            f"got {tuple(scales.shape)}, {tuple(zeros.shape)}, {tuple(g_idx.shape)}")  # fmt: skip
    require_float("x", x)
    require_float("scales", scales)
    require(zeros.dtype == torch.int32 and g_idx.dtype in (torch.int32, torch.int64), "zeros int32, g_idx int32/64")
    require_index("expert_offsets", expert_offsets, experts + 1)
    require(x.stride(1) == 1, "x: last dimension must be contiguous")
    require_contiguous(qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx)
    require(perm is None or (tuple(perm.shape) == (experts, in_dim) and perm.is_contiguous()),
            f"perm: [E, K] contiguous, got {None if perm is None else tuple(perm.shape)}")
    out = torch.empty(x.shape[0], out_dim, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    block_expert, block_first, num_blocks = _row_blocks(expert_offsets, x.shape[0], experts)
    grid = (num_blocks, triton.cdiv(out_dim, BLOCK_N))
    _wna16_grouped_kernel[grid](
        x, qweight, scales, zeros, g_idx, g_idx if perm is None else perm, out, expert_offsets, block_expert, block_first, out_dim, in_dim, groups,
        experts, x.stride(0), out.stride(0), BITS=bits, GROUP_SIZE=group_size, HAS_PERM=perm is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_K=block_k_for(group_size, in_dim, 64),
        PRECISION=dot_precision(x.dtype), num_warps=NUM_WARPS,
    )
    return out
