"""RMSNorm with an optional fused residual add (transformers' LlamaRMSNorm semantics)."""

import torch
import triton
import triton.language as tl

from kernels.launch import (
    next_power_of_2,
    require,
    require_contiguous,
    require_float,
    require_same_device,
    require_shape,
)


def _config(hidden: int) -> dict:
    """Tuning (the only place it is chosen): one program per row, the whole row in one block."""
    block = next_power_of_2(hidden)
    return {"BLOCK": block, "num_warps": 4 if block <= 2048 else 8 if block <= 8192 else 16}


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, hidden, eps, HAS_RESIDUAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * hidden + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + row * hidden + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / hidden
    normed = (h * tl.rsqrt(variance + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """h = x (+ residual, rounded to x.dtype); out = weight * (h * rsqrt(mean(h**2) + eps)).to(x.dtype).

    x [T, hidden]; weight [hidden]; residual [T, hidden] or None.
    returns out [T, hidden], or (out, h) with h [T, hidden] when residual is given.
    """
    require(x.dim() == 2, f"x: expected [T, hidden], got {tuple(x.shape)}")
    tokens, hidden = x.shape
    require_float("x", x)
    require_shape("weight", weight, (hidden,))
    require_contiguous(x=x, weight=weight)
    require_same_device(x=x, weight=weight)
    out = torch.empty(tokens, hidden, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)  # [T, H]
    new_residual = None
    if residual is not None:
        require_shape("residual", residual, (tokens, hidden))
        require_contiguous(residual=residual)
        require(residual.dtype == x.dtype, f"residual: expected {x.dtype}, got {residual.dtype}")
        require_same_device(x=x, residual=residual)
        new_residual = torch.empty_like(x)  # [T, hidden]
    if tokens > 0:
        _rms_norm_kernel[(tokens,)](
            x, residual if residual is not None else x, weight, out, new_residual if residual is not None else out,
            hidden, eps, HAS_RESIDUAL=residual is not None, **_config(hidden),
        )
    return out if residual is None else (out, new_residual)
