"""The LoRA-aware linear layer swapped into the model: base projection plus each token's own
adapter delta, computed for the whole ragged batch by the shrink/expand kernels."""

from dataclasses import dataclass

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.models.linear import Linear


@dataclass
class LoRAWeights:
    """All adapter slots of one (fused) projection of one layer; ranks above a module's own are zero."""

    modules: tuple[str, ...]  # checkpoint module of each slice, e.g. ("q_proj", "k_proj", "v_proj")
    lora_a: torch.Tensor  # [S, slots, max_rank, in]
    lora_b: torch.Tensor  # [slots, out_total, max_rank]
    scaling: torch.Tensor  # [S, slots] float32
    ranks: torch.Tensor  # [slots] int32, the largest rank among the slices (0: no slice targeted)
    slice_offsets: tuple[int, ...]
    host_ranks: list[int]  # ranks, kept on the host so a step whose adapters skip this projection skips it too

    @classmethod
    def empty(cls, base: Linear, modules: tuple[str, ...], *, num_slots: int, max_rank: int) -> "LoRAWeights":
        dtype, device = base.weight.dtype, base.weight.device
        num_slices = len(modules)
        return cls(
            modules=modules,
            lora_a=torch.zeros(num_slices, num_slots, max_rank, base.in_features, dtype=dtype, device=device),
            lora_b=torch.zeros(num_slots, base.slice_offsets[-1], max_rank, dtype=dtype, device=device),
            scaling=torch.zeros(num_slices, num_slots, dtype=torch.float32, device=device),
            ranks=torch.zeros(num_slots, dtype=torch.int32, device=device),
            slice_offsets=base.slice_offsets,
            host_ranks=[0] * num_slots,
        )


class LoRALinear(nn.Module):
    def __init__(self, base: Linear, weights: LoRAWeights) -> None:
        super().__init__()
        self.base = base
        self.weights = weights

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        y = self.base(x)  # [T, out_total]
        w = self.weights
        if ctx is None or ctx.lora_meta is None or not any(w.host_ranks[slot] for slot in ctx.active_slots):
            return y
        buf = kernels.lora_shrink(x, w.lora_a, ctx.token_slots, w.ranks, meta=ctx.lora_meta)  # [S, T, max_rank]
        kernels.lora_expand(
            y, buf, w.lora_b, ctx.token_slots, w.ranks, w.scaling, w.slice_offsets, meta=ctx.lora_meta
        )
        return y


def swap_in_lora(model: nn.Module, packed: dict[str, tuple[str, ...]], *, num_slots: int, max_rank: int):
    """Replace every projection named in `packed` (fused name -> checkpoint modules) in each layer
    with a LoRALinear; returns {(layer index, checkpoint module): (weights, slice index)}."""
    index = {}
    for layer_idx, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, modules in packed.items():
                base = getattr(parent, name, None)
                if not isinstance(base, Linear):
                    continue
                weights = LoRAWeights.empty(base, modules, num_slots=num_slots, max_rank=max_rank)
                setattr(parent, name, LoRALinear(base, weights))
                for slice_idx, module in enumerate(modules):
                    index[(layer_idx, module)] = (weights, slice_idx)
    return index
