"""SiLU-and-mul: the gated activation of a Llama MLP."""

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv, require, require_float, require_last_dim_contiguous

BLOCK = 1024  # tuning (the only place it is chosen): columns per program, and warps
NUM_WARPS = 4


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """out[t, i] = silu(x[t, i]) * x[t, I + i]   (silu rounded to x.dtype first, as torch does).

    x [T, 2 * I]; returns out [T, I] in x.dtype.
    """
    require(x.dim() == 2 and x.shape[1] % 2 == 0, f"x: expected [T, 2 * I], got {tuple(x.shape)}")
    require_float("x", x)
    require_last_dim_contiguous(x=x)
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=x.dtype, device=x.device)  # [T, I]
    if tokens == 0 or inter == 0:
        return out
    grid = (tokens, cdiv(inter, BLOCK))
    _silu_and_mul_kernel[grid](x, out, inter, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
