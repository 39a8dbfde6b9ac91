"""The references of the fp8 checkpoints' projections (kernels/fp8_block_linear.py), in plain PyTorch."""

import torch


def dequantize_fp8_groups(weight: torch.Tensor, weight_scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """The float32 weight [..., out, in] that fp8 weight [..., out, in] with scales [..., out, cdiv(in, group_k)]
    stands for: weight[..., o, i] * weight_scale[..., o, i // group_k]."""
    in_dim = weight.shape[-1]
    return weight.float() * weight_scale.repeat_interleave(group_k, dim=-1)[..., :in_dim]


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_k: int) -> torch.Tensor:
    """A weight-only fp8 projection: out[t, o] = sum_i x[t, i] * weight[o, i] * weight_scale[o, i // group_k].

    x [T, in] float; weight [out, in] float8_e4m3fn; weight_scale [out, cdiv(in, group_k)] float32; returns
    out [T, out] in x.dtype (the product of the dequantized weight, in float32)."""
    return (x.float() @ dequantize_fp8_groups(weight, weight_scale, group_k).t()).to(x.dtype)  # [T, out]
