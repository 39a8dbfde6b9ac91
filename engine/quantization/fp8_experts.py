"""An fp8 checkpoint's experts (Qwen3-MoE-FP8, Mixtral in the `fp8` block format): each expert's gate, up and down
projections stored as `weight` F8_E4M3 with `weight_scale_inv` per 128 x 128 block, held as stored.

The experts are stacked as Experts stacks them (gate_up_proj [E, 2I, hidden]: gate rows, then up rows; down_proj
[E, hidden, I]), in fp8, each with scales per row and group of 128 input columns ([E, rows, cdiv(columns, 128)]
float32: a block's scale repeated over its rows). `kernels.grouped_matmul` dequantizes them in registers. Under
tensor parallelism each rank holds its rows of every expert's gate and up (a shard may cut a block: each row takes
its block's scale) and its columns of down (which must start on a block: refused at start otherwise)."""

import torch
from torch import nn

import kernels
from engine.quantization.spec import QuantSpec
from kernels.reference import FP8

BLOCK = 128  # the one weight_block_size served: [128, 128]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


def check_scales(name: str, kind: str, scales: torch.Tensor) -> None:
    if not torch.isfinite(scales).all() or not (scales > 0).all():
        raise ValueError(f"{name}: {kind} holds scales that are not positive and finite")


class Fp8Experts(nn.Module):
    """The experts' weights, scales and grouped products; engine/models/prequantized.py serves this class as an
    engine.models.moe.Experts (its routing, expert-sorted rows and LoRA hooks)."""

    loads_as_stored = True  # CausalLM.load_weights hands it every stored tensor (load_slice); engine/models/prequantized.py finishes it

    group_k = BLOCK  # input columns per scale
    column_blocks = True  # scales per block of input columns: a shard of down's columns must start on a block

    def __init__(self, base: nn.Module, spec: QuantSpec | None = None, *, name: str, tp_rank: int, tp_size: int
                 ) -> None:
        """base: the Experts it replaces (on meta), this rank's slice of each expert's intermediate."""
        nn.Module.__init__(self)
        self.name, self.tp_rank, self.tp_size = name, tp_rank, tp_size
        self.inverse_scales = spec is not None and spec.inverse_scales  # GPTQModel's: weight / weight_scale_inv
        self.num_experts, self.inter = base.num_experts, base.inter
        self.act_and_mul = base.act_and_mul
        experts, rows, hidden = base.gate_up_proj.shape
        self.dtype = base.gate_up_proj.dtype  # the activation dtype the experts stand in
        if tp_size > 1 and self.column_blocks and self.inter % BLOCK:
            raise ValueError(f"{name}: tensor_parallel_size {tp_size} gives each rank {self.inter} of each expert's "
                             f"{self.inter * tp_size} intermediate columns of down_proj, which splits a block of "
                             f"{BLOCK} columns that share a scale; each rank's share must be a multiple of {BLOCK}")
        self.gate_up_proj = param(experts, rows, hidden, dtype=FP8)
        self.gate_up_proj_scale = param(experts, rows, cdiv(hidden, self.group_k), dtype=torch.float32)
        self.down_proj = param(experts, hidden, self.inter, dtype=FP8)
        self.down_proj_scale = param(experts, hidden, cdiv(self.inter, self.group_k), dtype=torch.float32)

    def slice_count(self, kind: str) -> int:
        return 2 * self.num_experts if kind.startswith("gate_up_proj") else self.num_experts

    def load_weight(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """gate_up_proj piece 2e (gate) or 2e + 1 (up), down_proj piece e: this rank's part of an fp8 weight."""
        expert, part = divmod(index, 2) if kind == "gate_up_proj" else (index, 0)
        target = getattr(self, kind).data[expert]
        if kind == "gate_up_proj":
            target = target[part * self.inter : (part + 1) * self.inter]
        if tensor.dtype != FP8 or tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{self.name}: expert {expert} {kind} is {tensor.dtype} {tuple(tensor.shape)}, "
                             f"expected float8_e4m3fn {tuple(target.shape)}")
        target.copy_(tensor)

    def load_slice(self, index: int, kind: str, tensor: torch.Tensor) -> None:
        """gate_up_proj[_scale] piece 2e (gate) or 2e + 1 (up), down_proj[_scale] piece e; a weight comes as this
        rank's part, its block scales whole."""
        if kind in ("gate_up_proj", "down_proj"):
            return self.load_weight(index, kind, tensor)
        expert, part = divmod(index, 2) if kind.startswith("gate_up_proj") else (index, 0)
        hidden = self.gate_up_proj.shape[2]
        inter_total = self.inter * self.tp_size
        if kind == "gate_up_proj_scale":  # [cdiv(I, 128), cdiv(hidden, 128)]: this rank's rows of it
            expected, first = (cdiv(inter_total, BLOCK), cdiv(hidden, BLOCK)), self.tp_rank * self.inter
            rows, columns = torch.arange(first, first + self.inter) // BLOCK, slice(None)
            target = self.gate_up_proj_scale.data[expert, part * self.inter : (part + 1) * self.inter]
        elif kind == "down_proj_scale":  # [cdiv(hidden, 128), cdiv(I, 128)]: this rank's columns of it
            expected, first = (cdiv(hidden, BLOCK), cdiv(inter_total, BLOCK)), self.tp_rank * self.inter // BLOCK
            rows, columns = torch.arange(hidden) // BLOCK, slice(first, first + cdiv(self.inter, BLOCK))
            target = self.down_proj_scale.data[expert]
        else:
            raise ValueError(f"{self.name}: unexpected {kind} for fp8 experts")
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{self.name}: expert {expert} weight_scale_inv of {kind.removesuffix('_scale')} has "
                             f"shape {tuple(tensor.shape)}, expected {expected} (blocks of {BLOCK} x {BLOCK})")
        target.copy_(tensor.float()[rows][:, columns])
        return None

    def finish(self) -> None:
        for kind in ("gate_up_proj_scale", "down_proj_scale"):
            check_scales(self.name, kind, getattr(self, kind))
            if self.inverse_scales:  # held as the scales they are the inverses of
                getattr(self, kind).data = torch.reciprocal(getattr(self, kind).data)

    def project(self, projection: str, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return kernels.grouped_matmul(rows, getattr(self, projection), offsets, getattr(self, f"{projection}_scale"),
                                      self.group_k)

    def full_precision_bytes(self) -> int:
        return (self.gate_up_proj.numel() + self.down_proj.numel()) * self.dtype.itemsize
