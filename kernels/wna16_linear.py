"""W4A16 / W8A16 GEMM: integer weights unpacked and dequantized in registers, tile by tile, never in memory.

A decode step (1-64 rows) must stream every packed word once, from every SM. Each word is read once (for each of
BLOCK_N columns, BLOCK_K // p words, split in registers into BLOCK_K weights), and `plan` (the only place tuning is
chosen) cuts the work so that enough programs run: BLOCK_N output columns each, and where the row blocks and column
tiles are too few for the device, the reduction too (kernels/split_k.py). docs/quantization.md, "The W4A16 and fp8
block kernels at decode", has the byte and instruction counts behind it."""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import (
    cdiv,
    dot_precision,
    multiprocessor_count,
    require,
    require_contiguous,
    require_float,
    require_shape,
)
from kernels.split_k import split_k, split_tiles, sum_partials
from kernels.wna16_reference import WNA16_BITS

MAX_BLOCK_K = 128  # a group of 128 per tile where groups are in order (one row of scales and zeros)
ACT_ORDER_BLOCK_K = 64  # per-channel groups (g_idx): scales and zeros gathered per weight, a smaller tile
FLOAT16_BIAS = tl.constexpr(0x6400)  # the bits of 1024.0: | q gives 1024 + q, exact for q < 1024
BFLOAT16_BIAS = tl.constexpr(0x4300)  # the bits of 128.0: | q gives 128 + q, exact for q < 128


@dataclass(frozen=True)
class WNA16Config:
    """One launch's tuning."""

    block_m: int  # rows per program
    block_n: int  # output columns per program
    block_k: int  # input channels per step of the K loop; divides a group where groups are in order
    split_k: int = 1  # programs sharing a tile's reduction, each over whole BLOCK_K tiles
    num_warps: int = 4
    num_stages: int = 3  # Triton's software pipeline: stages - 1 tiles in flight

    def __str__(self) -> str:
        return (f"bm={self.block_m} bn={self.block_n} bk={self.block_k} split_k={self.split_k} "
                f"warps={self.num_warps} stages={self.num_stages}")


def block_k_for(group_size: int, in_dim: int, most: int = MAX_BLOCK_K) -> int:
    """The reduction tile: `most`, or a group when groups in order are smaller (a tile never straddles two);
    act order (group_size 0) reads each channel's group, in tiles of ACT_ORDER_BLOCK_K."""
    require(group_size >= 0, f"group_size must be >= 0, got {group_size}")
    if group_size == 0:
        return ACT_ORDER_BLOCK_K
    if group_size >= in_dim:
        return most
    block = min(most, group_size)
    require(group_size % block == 0 and block % 16 == 0, f"wna16: group size {group_size} is not served in order "
            f"(pass group_size=0 to read g_idx)")  # fmt: skip
    return block


@functools.lru_cache(maxsize=1024)
def plan(tokens: int, out_dim: int, in_dim: int, group_size: int, bits: int, sms: int) -> WNA16Config:
    """The launch for a static shape (cached: a step pays a lookup). Rows: 16 per program up to 16 tokens (the
    least a tensor-core product takes), 32, then 64 (a weight tile dequantized once for 64 rows). Columns: 64
    (256 bytes of each row of words). Split-K: kernels.split_k's rule (at one token the partials are 0.3% of the
    weight's bytes; at 64 tokens they bound the split)."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    block_n = 64
    block_k = block_k_for(group_size, in_dim)
    split = split_k(cdiv(tokens, block_m) * cdiv(out_dim, block_n), cdiv(in_dim, block_k), tokens, out_dim,
                    in_dim * out_dim * bits // 8, sms)
    return WNA16Config(block_m, block_n, block_k, split)


@triton.jit
def unpacked_words(packed, BITS: tl.constexpr):
    """packed [N, W] int32 -> q [N, W * p] int32: value j of word w at column w * p + j (GPTQ's order, the first
    value in the lowest bits). Each word is read from memory once and split here, its values joined as the
    innermost dims, so a thread's values of one word stay in its registers."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:  # [N, W, 2, 2, 2]: value 4 * i2 + 2 * i1 + i0 at [..., i0, i1, i2]
        q = tl.join(tl.join(tl.join(packed & MASK, (packed >> 4) & MASK), tl.join((packed >> 8) & MASK, (packed >> 12) & MASK)),
                    tl.join(tl.join((packed >> 16) & MASK, (packed >> 20) & MASK),
                            tl.join((packed >> 24) & MASK, (packed >> 28) & MASK)))
        q = tl.permute(q, (0, 1, 4, 3, 2))
    else:  # [N, W, 2, 2]: value 2 * i1 + i0 at [..., i0, i1]
        q = tl.join(tl.join(packed & MASK, (packed >> 8) & MASK), tl.join((packed >> 16) & MASK, (packed >> 24) & MASK))
        q = tl.permute(q, (0, 1, 3, 2))
    return tl.reshape(q, (packed.shape[0], packed.shape[1] * (32 // BITS)))


@triton.jit
def minus_zero(q, zero, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """q - zero in DTYPE, exactly (both in [0, 2**BITS)). Half types without an int-to-float conversion per value
    (the conversion unit's rate is below the weights' at decode): q or-ed into the mantissa of 1024.0 (float16) or
    of 128.0 (bfloat16, 4 bits) is that float plus q, and one subtraction of two such floats (two values an
    instruction) leaves the difference."""
    if DTYPE == tl.float16:
        return _biased(q, FLOAT16_BIAS, DTYPE) - _biased(zero, FLOAT16_BIAS, DTYPE)
    elif DTYPE == tl.bfloat16 and BITS == 4:
        return _biased(q, BFLOAT16_BIAS, DTYPE) - _biased(zero, BFLOAT16_BIAS, DTYPE)
    else:
        return (q - zero).to(DTYPE)


@triton.jit
def _biased(q, BIAS: tl.constexpr, DTYPE: tl.constexpr):
    return (q | BIAS).to(tl.int16).to(DTYPE, bitcast=True)


@triton.jit(do_not_specialize=["num_tokens"])
def _wna16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, out_ptr, num_tokens, out_dim, in_dim, tiles_per_split,
    x_stride,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr, PRECISION: tl.constexpr,
):
    PER: tl.constexpr = 32 // BITS  # values in one int32
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)  # fastest: the programs of one row block and split stream neighbouring columns
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < out_dim
    packed_n = out_dim // PER
    z_shift = ((offs_n % PER) * BITS)[:, None]  # [N, 1] of each column's zero in its int32
    # out^T [N, M]: the weights are the product's left operand (the wide side of a tensor-core product), the few
    # tokens its right one
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_first = split * tiles_per_split * BLOCK_K
    for k0 in range(k_first, tl.minimum(k_first + tiles_per_split * BLOCK_K, in_dim), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        if HAS_PERM:  # act order sorted at load: x's columns in the weights' order
            cols = tl.load(perm_ptr + offs_k, mask=k_mask, other=0)
        else:
            cols = offs_k
        x_t = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * x_stride + cols[:, None],
                      mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # [K, M]
        words = k0 // PER + tl.arange(0, BLOCK_K // PER)
        packed = tl.load(qweight_ptr + words[None, :].to(tl.int64) * out_dim + offs_n[:, None],
                         mask=n_mask[:, None] & (words < in_dim // PER)[None, :], other=0)  # [N, K // p]
        q = unpacked_words(packed, BITS)  # [N, K]
        if GROUP_SIZE > 0:  # groups in order: the tile is in one group, its scale applied to the tile's product
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + group * out_dim + offs_n, mask=n_mask, other=0.0)[:, None]  # [N, 1]
            zero_word = tl.load(zeros_ptr + group * packed_n + offs_n // PER, mask=n_mask, other=0)[:, None]
            w = minus_zero(q, (zero_word >> z_shift) & MASK, x_t.dtype, BITS)  # [N, K]
            acc += tl.dot(w, x_t, input_precision=PRECISION) * scale.to(tl.float32)
        else:  # act order: each input channel's own group
            group = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0).to(tl.int64)  # [K]
            nk_mask = n_mask[:, None] & k_mask[None, :]
            scale = tl.load(scales_ptr + group[None, :] * out_dim + offs_n[:, None], mask=nk_mask, other=0.0)
            zero_word = tl.load(zeros_ptr + group[None, :] * packed_n + (offs_n // PER)[:, None], mask=nk_mask,
                                other=0)
            w = ((q - ((zero_word >> z_shift) & MASK)).to(tl.float32) * scale.to(tl.float32)).to(x_t.dtype)
            acc += tl.dot(w, x_t, input_precision=PRECISION)
    if PARTIALS:  # float32 partials [splits, T, N]
        out_ptr += split.to(tl.int64) * num_tokens * out_dim
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * out_dim + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, *, group_size: int = 0, perm: torch.Tensor | None = None,
                 config: WNA16Config | None = None) -> torch.Tensor:
    """Same contract as kernels.reference.wna16_linear; the product accumulates in float32. group_size > 0 (g_idx
    in order): one row of scales and zeros per tile, each tile's integer product scaled in float32; act order
    (group_size 0): each weight dequantized to x.dtype in registers. perm: x's columns read in that order (in the
    tile's loads). config: this launch's tuning (default: `plan`'s; benchmarks/kernel_quantized.py tries others)."""
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
    if config is None:
        config = plan(tokens, out_dim, in_dim, group_size, bits, multiprocessor_count(x.device))
    else:
        require(config.block_k == block_k_for(group_size, in_dim, config.block_k), f"wna16_linear: {config} "
                f"straddles the groups of {group_size}")  # fmt: skip
    tiles, split = split_tiles(cdiv(in_dim, config.block_k), config.split_k)
    target = out if split == 1 else torch.empty(split, tokens, out_dim, dtype=torch.float32, device=x.device)
    grid = (cdiv(out_dim, config.block_n), split, cdiv(tokens, config.block_m))
    _wna16_kernel[grid](
        x, qweight, scales, zeros, g_idx, g_idx if perm is None else perm, target, tokens, out_dim, in_dim, tiles,
        x.stride(0), BITS=bits, GROUP_SIZE=group_size, HAS_PERM=perm is not None, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, PARTIALS=split > 1, PRECISION=dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        sum_partials(target, out)
    return out
