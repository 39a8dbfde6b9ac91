"""Rotary position embedding applied in place to q and k (HF rotate_half / neox layout)."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    next_power_of_2,
    require,
    require_contiguous,
    require_index,
    require_last_dim_contiguous,
    require_same_device,
)


def _config(num_heads: int, rotary_dim: int) -> dict:
    """Tuning (the only place it is chosen): heads per inner step and warps."""
    block_half = next_power_of_2(rotary_dim // 2)
    return {"BLOCK_H": max(1, min(next_power_of_2(num_heads), 4096 // block_half)), "BLOCK_HALF": block_half,
            "num_warps": 4}  # fmt: skip


@triton.jit
def _rotate_heads(x_ptr, row, token_stride, head_stride, num_heads, half, cos, sin, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    for h0 in range(0, num_heads, BLOCK_H):
        mask = ((h0 + heads) < num_heads)[:, None] & (cols < half)[None, :]
        ptrs = x_ptr + row * token_stride + (h0 + heads)[:, None] * head_stride + cols[None, :]
        x1 = tl.load(ptrs, mask=mask, other=0.0)
        x2 = tl.load(ptrs + half, mask=mask, other=0.0)
        c = cos.to(x1.dtype).to(tl.float32)[None, :]
        s = sin.to(x1.dtype).to(tl.float32)[None, :]
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(ptrs, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(ptrs + half, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, q_token_stride, q_head_stride, k_token_stride,
                   k_head_stride, num_q_heads, num_k_heads, half, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * 2 * half + cols, mask=cols < half, other=0.0)
    sin = tl.load(cache_ptr + pos * 2 * half + half + cols, mask=cols < half, other=0.0)
    _rotate_heads(q_ptr, row, q_token_stride, q_head_stride, num_q_heads, half, cos, sin, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, row, k_token_stride, k_head_stride, num_k_heads, half, cos, sin, BLOCK_H, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """In place: x[t, h, :R] = x[t, h, :R] * cos + rotate_half(x[t, h, :R]) * sin for x in (q, k),
    R = cos_sin_cache.shape[1] (R < D: a partial rotary, dims R.. untouched).

    cos, sin = halves of cos_sin_cache[positions[t]] (cast to x.dtype, as transformers does),
    each repeated to R; rotate_half(v) = cat(-v[R/2:], v[:R/2]).
    positions [T] int; q [T, heads, D]; k [T, kv_heads, D] (token and head strides free, last dim
    contiguous, e.g. views of a fused qkv output); cos_sin_cache [max_positions, R] contiguous, R even, R <= D.
    """
    require(q.dim() == 3 and k.dim() == 3, f"q, k: expected [T, heads, D], got {tuple(q.shape)}, {tuple(k.shape)}")
    tokens, _, head_dim = q.shape
    require(k.shape[0] == tokens and k.shape[2] == head_dim, f"k: shape {tuple(k.shape)} does not fit q")
    require(cos_sin_cache.dim() == 2, f"cos_sin_cache: expected [max_positions, R], got {tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    require(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
            f"cos_sin_cache: its width R={rotary_dim} must be even and at most head_dim {head_dim}")
    require(q.dtype == k.dtype, f"q and k dtypes differ: {q.dtype} vs {k.dtype}")
    require_index("positions", positions, tokens)
    require_contiguous(cos_sin_cache=cos_sin_cache)
    require_last_dim_contiguous(q=q, k=k)
    require_same_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    if tokens == 0:
        return
    _rotary_kernel[(tokens,)](
        positions, q, k, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0), k.stride(1), q.shape[1],
        k.shape[1], rotary_dim // 2, **_config(max(q.shape[1], k.shape[1]), rotary_dim),
    )
