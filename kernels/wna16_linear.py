"""W4A16 / W8A16 GEMM: integer weights unpacked and dequantized in registers, tile by tile, never in memory."""

import torch
import triton
import triton.language as tl

from kernels.launch import dot_precision, require, require_contiguous, require_float, require_shape
from kernels.wna16_reference import WNA16_BITS

BLOCK_N, BLOCK_K = 64, 64  # tuning (the only place it is chosen): output columns, reduction
NUM_WARPS = 4


def _block_m(tokens: int) -> int:
    """Rows per program: 16 for decode-sized batches (tl.dot's least), 64 for prefill."""
    return 16 if tokens <= 16 else 32 if tokens <= 64 else 64


def _block_k(group_size: int, in_dim: int) -> int:
    """The reduction tile: BLOCK_K, or a group when groups in order are smaller (a tile never straddles two)."""
    require(group_size >= 0, f"group_size must be >= 0, got {group_size}")
    if group_size == 0 or group_size >= in_dim:
        return BLOCK_K
    block = min(BLOCK_K, group_size)
    require(group_size % block == 0 and block % 16 == 0, f"wna16: group size {group_size} is not served in order "
            f"(pass group_size=0 to read g_idx)")  # fmt: skip
    return block


@triton.jit
def _wna16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, out_ptr, num_tokens, out_dim, in_dim,
    x_stride, out_stride,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS  # values in one int32
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < out_dim
    packed_n = out_dim // PER
    z_shift = ((offs_n % PER) * BITS)[None, :]  # [1, N] of each column's zero in its int32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        if HAS_PERM:  # act order sorted at load: x's columns in the weights' order
            cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        else:
            cols = offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * x_stride + cols[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [M, K]
        kn_mask = k_mask[:, None] & n_mask[None, :]
        packed = tl.load(qweight_ptr + (offs_k // PER)[:, None].to(tl.int64) * out_dim + offs_n[None, :],
                         mask=kn_mask, other=0)  # [K, N] int32, each read by PER rows
        q = (packed >> ((offs_k % PER) * BITS)[:, None]) & MASK
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
        w = ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)  # [K, N] dequantized in registers
        acc += tl.dot(x, w, input_precision=PRECISION)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, *, group_size: int = 0, perm: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Same contract as kernels.reference.wna16_linear; the product accumulates in float32 from weights
    dequantized to x.dtype in registers. group_size > 0 (g_idx in order): one row of scales and zeros per tile;
    perm: x's columns read in that order (in the tile's loads)."""
    require(bits in WNA16_BITS, f"wna16_linear: bits must be one of {WNA16_BITS}, got {bits}")
    per = 32 // bits
    require(x.dim() == 2, f"x [T, K]: got {tuple(x.shape)}")
    tokens, in_dim = x.shape
    require(qweight.dim() == 2 and qweight.dtype == torch.int32, f"qweight: [K // {per}, N] int32, got "
            f"{tuple(qweight.shape)} {qweight.dtype}")  # fmt: skip
    out_dim = qweight.shape[1]
    require(in_dim % per == 0 and out_dim % per == 0, f"wna16_linear: K ({in_dim}) and N ({out_dim}) must be "
            f"multiples of {per}")  # fmt: skip
    require_shape("qweight", qweight, (in_dim // per, out_dim))
    require(scales.dim() == 2 and scales.shape[1] == out_dim, f"scales: [G, {out_dim}], got {tuple(scales.shape)}")
    require_float("scales", scales)
    require_float("x", x)
    require_shape("zeros", zeros, (scales.shape[0], out_dim // per))
    require(zeros.dtype == torch.int32, f"zeros: int32, got {zeros.dtype}")
    require_shape("g_idx", g_idx, (in_dim,))
    require(g_idx.dtype in (torch.int32, torch.int64), f"g_idx: int32/int64, got {g_idx.dtype}")
    require(x.stride(1) == 1, "x: last dimension must be contiguous")
    require_contiguous(qweight=qweight, scales=scales, zeros=zeros, g_idx=g_idx)
    if perm is not None:
        require_shape("perm", perm, (in_dim,))
        require(perm.dtype in (torch.int32, torch.int64) and perm.is_contiguous(), "perm: contiguous int32/int64")
    out = torch.empty(tokens, out_dim, dtype=x.dtype, device=x.device)  # [T, N]
    if tokens == 0:
        return out
    block_m, block_k = _block_m(tokens), _block_k(group_size, in_dim)
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(out_dim, BLOCK_N))
    _wna16_kernel[grid](
        x, qweight, scales, zeros, g_idx, g_idx if perm is None else perm, out, tokens, out_dim, in_dim, x.stride(0),
        out.stride(0), BITS=bits, GROUP_SIZE=group_size, HAS_PERM=perm is not None, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
        num_warps=NUM_WARPS,
    )
    return out
