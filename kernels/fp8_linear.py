"""The fp8 projection on CUDA: torch._scaled_mm with per-token (or one static) activation and per-channel weight
scales."""

import torch

from kernels.reference import FP8, quantize_fp8_rows, quantize_fp8_static


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as kernels.reference.fp8_linear (CUDA, compute capability 8.9 or newer; in and out
    multiples of 16). The product is produced in bfloat16 (row-wise scaling supports no other output) and
    cast to x.dtype."""
    if weight.dtype != FP8 or weight_scale.dtype != torch.float32:
        raise ValueError(f"fp8_linear: expected an fp8 weight and float32 scales, got {weight.dtype}, "
                         f"{weight_scale.dtype}")
    if x.shape[-1] % 16 or weight.shape[0] % 16:
        raise ValueError(f"fp8_linear: in and out features must be multiples of 16, got {tuple(weight.shape)}")
    if input_scale is None:  # dynamic: per token
        xq, x_scale = quantize_fp8_rows(x)  # [T, in] fp8, [T] float32
    else:  # static: the checkpoint's per-tensor scale
        xq, x_scale = quantize_fp8_static(x, input_scale), input_scale.float().expand(x.shape[0])
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale[:, None].contiguous(),
                           scale_b=weight_scale[None, :].contiguous(), out_dtype=torch.bfloat16)  # [T, out]
    return out.to(x.dtype)
