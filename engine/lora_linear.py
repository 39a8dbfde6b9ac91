"""The LoRA-aware linear layer swapped into the model: base projection plus each token's own
adapter delta, computed for the whole ragged batch by the shrink/expand kernels, which read the
adapters' rows from the layer's paged memory."""

import torch
from torch import nn

import kernels
from engine.context import Context
from engine.lora_modules import PACKED_MODULES, first_index
from engine.models.linear import Linear
from engine.models.quantized_linear import QuantizedLinear
from engine.paged_memory import PagedMemory


class LoRALinear(nn.Module):
    def __init__(self, base: Linear | QuantizedLinear, *, layer: int, first: int, memory: PagedMemory) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.first = first  # module index of the first slice (engine.lora_modules)
        self.num_slices = len(base.out_slices)
        self.memory = memory

    def forward(self, x: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        y = self.base(x)  # [T, out_total]
        lora = ctx.lora if ctx is not None else None
        if lora is None:
            return y
        tables = lora.module(self.layer, self.first, self.num_slices)
        if tables is None:
            return y
        pages = self.memory.flat(self.layer)
        buf = kernels.lora_shrink(x, pages, tables.a_rows, lora.token_slots, tables.a_ranks, meta=lora.meta)  # [S_a, T, R]
        kernels.lora_expand(y, buf, pages, tables.b_rows, lora.token_slots, tables.ranks, tables.scaling,
                            self.base.slice_offsets, meta=lora.meta)
        return y


def swap_in_lora(model: nn.Module, memory: PagedMemory) -> None:
    """Replace every projection of PACKED_MODULES in each layer with a LoRALinear over `memory`."""
    for layer_idx, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name in PACKED_MODULES:
                base = getattr(parent, name, None)
                if isinstance(base, (Linear, QuantizedLinear)):
                    setattr(parent, name, LoRALinear(base, layer=layer_idx, first=first_index(name), memory=memory))
