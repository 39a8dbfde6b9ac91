"""The fp8 checkpoints' projection: float8_e4m3fn weights with one float32 scale per output row and group of
input columns, dequantized in registers and multiplied with the activations in their own dtype."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    FP8,
    cdiv,
    dot_precision,
    multiprocessor_count,
    next_power_of_2,
    require,
    require_float,
    require_last_dim_contiguous,
    require_same_device,
    require_shape,
)
from kernels.split_k import split_k, split_tiles, sum_partials


def _config(tokens: int, out_dim: int, in_dim: int, group_k: int, sms: int) -> dict:
    """Tuning for one launch (the only place it is chosen): a K tile never straddles two scale groups; each program
    takes as many columns as its rows of x weigh in bytes (64 rows: 128 columns; fewer made every program read x
    again for a narrow strip of weights: 9x the weights' bytes at 16 columns), and split-K fills the device
    (kernels.split_k)."""
    block_m = 16 if tokens <= 16 else 32 if tokens <= 32 else 64
    block_k = min(128, max(next_power_of_2(in_dim), 16))
    while group_k < in_dim and group_k % block_k:
        block_k //= 2
    block_n = 128 if block_m == 64 else 64
    split = split_k(cdiv(tokens, block_m) * cdiv(out_dim, block_n), cdiv(in_dim, block_k), tokens, out_dim,
                    out_dim * in_dim, sms)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4}


@triton.jit(do_not_specialize=["tokens"])
def _fp8_block_linear_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, tokens, out_dim, in_dim, group_k, tiles_per_split, x_stride, w_stride, s_stride,
    out_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)  # fastest: the programs of one row block and split stream neighbouring rows of w
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < tokens
    n_mask = offs_n < out_dim
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_stride
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * w_stride
    s_rows = s_ptr + offs_n.to(tl.int64) * s_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = split * tiles_per_split * BLOCK_K
    for k0 in range(k_first, tl.minimum(k_first + tiles_per_split * BLOCK_K, in_dim), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [M, K]
        w = tl.load(w_cols + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [K, N] fp8
        scale = tl.load(s_rows + k0 // group_k, mask=n_mask, other=0.0)  # [N]: this K tile's group
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * scale[None, :]
    if PARTIALS:  # float32 partials [splits, T, out]
        out_ptr += split.to(tl.int64) * tokens * out_stride
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_k: int, *,
                     config: dict | None = None) -> torch.Tensor:
    """out[t, o] = sum_i x[t, i] * weight[o, i] * weight_scale[o, i // group_k], summed in float32.

    x [T, in] float; weight [out, in] float8_e4m3fn; weight_scale [out, cdiv(in, group_k)] float32 (a block
    format's [cdiv(out, 128), cdiv(in, 128)] scales repeated over each block's rows; per-channel scales:
    [out, 1] with group_k = in); returns out [T, out] in x.dtype. config: this launch's tuning, as `_config`
    returns it (default: `_config`'s; benchmarks/kernel_quantized.py tries others)."""
    require(x.dim() == 2 and weight.dim() == 2, f"x [T, in], weight [out, in]: got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}")  # fmt: skip
    out_dim, in_dim = weight.shape
    require(x.shape[1] == in_dim, f"x has {x.shape[1]} columns, weight {in_dim}")
    require_float("x", x)
    require(weight.dtype == FP8, f"weight: expected float8_e4m3fn, got {weight.dtype}")
    require(weight_scale.dtype == torch.float32, f"weight_scale: expected float32, got {weight_scale.dtype}")
    require(group_k >= in_dim or (group_k > 0 and group_k % 16 == 0),
            f"group_k must be a multiple of 16 or cover every column, got {group_k} for {in_dim} columns")
    require_shape("weight_scale", weight_scale, (out_dim, triton.cdiv(in_dim, group_k)))
    require_last_dim_contiguous(x=x, weight=weight, weight_scale=weight_scale)
    require_same_device(x=x, weight=weight, weight_scale=weight_scale)
    tokens = x.shape[0]
    out = torch.empty(tokens, out_dim, dtype=x.dtype, device=x.device)  # [T, out]
    if tokens == 0 or out_dim == 0:
        return out
    config = dict(config or _config(tokens, out_dim, in_dim, group_k, multiprocessor_count(x.device)))
    tiles, split = split_tiles(cdiv(in_dim, config["BLOCK_K"]), config.pop("SPLIT_K"))
    target = out if split == 1 else torch.empty(split, tokens, out_dim, dtype=torch.float32, device=x.device)
    grid = (cdiv(out_dim, config["BLOCK_N"]), split, cdiv(tokens, config["BLOCK_M"]))
    _fp8_block_linear_kernel[grid](
        x, weight, weight_scale, target, tokens, out_dim, in_dim, group_k, tiles, x.stride(0), weight.stride(0),
        weight_scale.stride(0), out_dim, PARTIALS=split > 1, PRECISION=dot_precision(x.dtype), **config,
    )
    if split > 1:
        sum_partials(target, out)
    return out
