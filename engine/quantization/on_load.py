"""Base projections quantized on load: int8 weight-only or fp8 (E4M3), one float32 scale per output row.

Every decoder projection (fused q/k/v, o, fused gate/up, down) is swapped for a QuantizedLinear as soon
as the loader has read its weights (engine/models/loader.py, whose quantize_model does it to a loaded model),
freeing its full-precision weight; the embeddings and lm_head stay in the model dtype. A QuantizedLinear keeps
`out_slices` and `slice_offsets`, so the LoRALinear swapped in over it adds each token's adapter delta, in the
activation dtype, on top of the quantized base. docs/quantization.md gives the rules."""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.context import Context
from kernels.reference import quantize_fp8_rows

QUANTIZATIONS = ("int8", "fp8")
INT8_MAX = 127.0


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (round(weight / s) in int8 [out, in], s [out] float32), s = amax(|row|) / 127."""
    w = weight.float()
    scale = (w.abs().amax(1) / INT8_MAX).clamp(min=1e-12)  # [out]
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (weight / s in float8_e4m3fn [out, in], s [out] float32), s = amax(|row|) / 448."""
    return quantize_fp8_rows(weight)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] a quantized one stands for."""
    return qweight.float() * scale[:, None]


class QuantizedLinear(nn.Module):
    def __init__(self, base: nn.Module, method: str) -> None:
        """base: the model's Linear it replaces (in_features, out_slices, slice_offsets, weight, bias)."""
        super().__init__()
        if method not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
        self.method = method
        self.in_features = base.in_features
        self.out_slices = list(base.out_slices)
        self.slice_offsets = base.slice_offsets
        qweight, scale = (quantize_int8 if method == "int8" else quantize_fp8)(base.weight.data)
        if method == "fp8" and qweight.is_cuda and (self.in_features % 16 or qweight.shape[0] % 16):
            raise ValueError(f"fp8 needs projections whose in and out features are multiples of 16 on CUDA, "
                             f"got {tuple(qweight.shape)}")
        self.register_buffer("qweight", qweight)  # [out, in] int8 or float8_e4m3fn
        self.register_buffer("weight_scale", scale)  # [out] float32
        self.bias = base.bias  # [out] in the model dtype, or None

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        if self.method == "int8":  # per-row scale commutes with the product: scale after, in x.dtype
            y = F.linear(x, self.qweight.to(x.dtype)) * self.weight_scale.to(x.dtype)  # [T, out]
        else:
            y = kernels.fp8_linear(x, self.qweight, self.weight_scale)  # [T, out]
        return y if self.bias is None else y + self.bias


def check_quantization(method: str, device: torch.device) -> None:
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("quantization 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         "use 'int8' on this one")


def quantize_projection(model: nn.Module, name: str, method: str) -> None:
    """Replace the Linear at `name` with its QuantizedLinear; its full-precision weight is freed with it."""
    parent, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent)
    setattr(parent, attr, QuantizedLinear(getattr(parent, attr), method))


def tensor_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a tied tensor once)."""
    seen = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def unquantized_bytes(model: nn.Module) -> int:
    """tensor_bytes(model) as it would be with every QuantizedLinear's weight in the model dtype."""
    itemsize = model.lm_head.weight.element_size()
    total = tensor_bytes(model)
    for module in model.modules():
        if hasattr(module, "full_precision_bytes"):  # a pre-quantized checkpoint's (engine/quantization/)
            total += module.full_precision_bytes() - tensor_bytes(module)
        if isinstance(module, QuantizedLinear):
            q, scale = module.qweight, module.weight_scale
            total += q.numel() * itemsize - q.numel() * q.element_size() - scale.numel() * scale.element_size()
    return total

