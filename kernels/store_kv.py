"""Scatter new keys and values into the paged KV cache."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    FP8_MAX,
    FP8_MIN_SCALE,
    next_power_of_2,
    require,
    require_contiguous,
    require_index,
    require_kv_scales,
    require_last_dim_contiguous,
    require_same_device,
)


def _config(kv_heads: int, head_dim: int) -> dict:
    """Tuning (the only place it is chosen): heads per inner step and warps."""
    block_d = next_power_of_2(head_dim)
    return {"BLOCK_H": max(1, min(next_power_of_2(kv_heads), 2048 // block_d)), "BLOCK_D": block_d, "num_warps": 4}


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scales_ptr, v_scales_ptr, k_token_stride,
                     k_head_stride, v_token_stride, v_head_stride, num_heads, head_dim, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + heads
        mask = (h < num_heads)[:, None] & (cols < head_dim)[None, :]
        dst = slot * num_heads * head_dim + h[:, None] * head_dim + cols[None, :]
        k = tl.load(k_ptr + row * k_token_stride + h[:, None] * k_head_stride + cols[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + row * v_token_stride + h[:, None] * v_head_stride + cols[None, :], mask=mask, other=0.0)
        if FP8:  # one scale per token and head (kernels.reference.store_kv)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            k_scale = tl.maximum(tl.max(tl.abs(k), axis=1) / FP8_MAX, FP8_MIN_SCALE)  # [BLOCK_H]
            v_scale = tl.maximum(tl.max(tl.abs(v), axis=1) / FP8_MAX, FP8_MIN_SCALE)
            k = k / k_scale[:, None]
            v = v / v_scale[:, None]
            tl.store(k_scales_ptr + slot * num_heads + h, k_scale, mask=h < num_heads)
            tl.store(v_scales_ptr + slot * num_heads + h, v_scale, mask=h < num_heads)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """for t: if slot_mapping[t] >= 0: blk, off = divmod(slot_mapping[t], bs); k_cache[blk, off] = k[t] (v alike).

    k, v [T, kv_heads, D] (token and head strides free, last dim contiguous);
    k_cache, v_cache [num_blocks, bs, kv_heads, D] contiguous; slot_mapping [T] int (-1 skipped);
    an fp8 cache quantizes each token's head with its own scale, written to k_scales, v_scales
    [num_blocks, bs, kv_heads] float32 (kernels.reference.store_kv).
    """
    require(k.dim() == 3 and k.shape == v.shape, f"k, v: expected equal [T, kv_heads, D], got {tuple(k.shape)}, "
            f"{tuple(v.shape)}")
    tokens, kv_heads, head_dim = k.shape
    require(k_cache.dim() == 4 and k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == (kv_heads, head_dim),
            f"caches: expected [num_blocks, bs, {kv_heads}, {head_dim}], got {tuple(k_cache.shape)}")
    require_index("slot_mapping", slot_mapping, tokens)
    require_contiguous(k_cache=k_cache, v_cache=v_cache)
    require_last_dim_contiguous(k=k, v=v)
    require_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    fp8 = require_kv_scales(k_cache, k_scales, v_scales)
    if tokens == 0:
        return
    if not fp8:
        k_scales = v_scales = slot_mapping  # unused
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_heads, head_dim, **_config(kv_heads, head_dim), FP8=fp8,
    )
