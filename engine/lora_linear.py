"""The LoRA-aware linear layer swapped into the model: base projection plus each token's own
adapter delta, computed for the whole ragged batch by one lora_delta launch over every slice, which reads
the adapters' rows from the layer's paged memory."""

import torch
from torch import nn

import kernels
from adapters.base_shapes import ROUTER
from engine.context import Context
from engine.lora_modules import (
    EXPERT_INDEX,
    EXPERT_SLICES,
    MODULE_INDEX,
    PACKED_MODULES,
    SHARED_EXPERT_PACKED,
    first_index,
)
from engine.models.linear import Linear
from engine.models.moe import Experts
from engine.paged_memory import PagedMemory
from engine.quantization import PackedLinear
from engine.quantization.on_load import QuantizedLinear


class LoRALinear(nn.Module):
    def __init__(self, base: Linear | QuantizedLinear | PackedLinear, *, layer: int, first: int, memory: PagedMemory) -> None:
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
        lora.wait_layer(self.layer)  # its adapters' rows copied into this layer's pages
        kernels.lora_delta(y, x, self.memory.flat(self.layer), tables.a_rows, tables.b_rows, lora.token_slots,
                           tables.ranks, tables.scaling, self.base.slice_offsets, meta=lora.meta,
                           row_align=self.memory.row_align)  # one launch
        return y


class LoRAExperts(nn.Module):
    """The experts of a MoE layer plus, on each projection's expert-sorted rows, each row's adapter delta of its
    own expert (kernels.expert_lora over the layer's paged memory)."""

    _MODULES = {"gate_up_proj": EXPERT_INDEX[0], "down_proj": EXPERT_INDEX[1]}

    def __init__(self, base: Experts, *, layer: int, memory: PagedMemory) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.memory = memory
        self._rows = None  # (tokens, their adapter slots) of the forward pass under way

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx: Context | None = None
                ) -> torch.Tensor:
        lora = ctx.lora if ctx is not None else None
        try:
            return self.base(x, weights, ids, ctx, lora=self._delta if lora is not None else None)
        finally:
            self._rows = None

    def _delta(self, y: torch.Tensor, x: torch.Tensor, projection: str, tokens: torch.Tensor,
               experts: torch.Tensor, ctx: Context) -> None:
        """y [rows, out] += each row's LoRA; x [rows, in] the projection's input; tokens, experts [rows]."""
        lora, module = ctx.lora, self._MODULES[projection]
        slices = EXPERT_SLICES[module]
        tables = lora.experts(self.layer, module, self.base.num_experts, slices)
        if tables is None:
            return
        if self._rows is None or self._rows[0] is not tokens:  # the layer's two projections share one tensor
            self._rows = (tokens, lora.token_slots[tokens])
        lora.wait_layer(self.layer)  # its adapters' rows copied into this layer's pages
        width = y.shape[1] // slices
        kernels.expert_lora(y, x, self.memory.flat(self.layer), tables.a_rows, tables.b_rows, self._rows[1],
                            experts, tables.ranks, tables.scaling, tuple(range(0, y.shape[1] + 1, width)),
                            meta=lora.meta)


def swap_in_lora(model: nn.Module, memory: PagedMemory) -> None:
    """Replace every projection of PACKED_MODULES in each layer with a LoRALinear over `memory` (an MoE layer's
    router and shared expert too, on their own module columns), and the experts of an MoE layer with
    LoRAExperts."""
    for layer_idx, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name in PACKED_MODULES:
                base = getattr(parent, name, None)
                if isinstance(base, (Linear, QuantizedLinear, PackedLinear)):
                    setattr(parent, name, LoRALinear(base, layer=layer_idx, first=first_index(name), memory=memory))
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, Experts):
            layer.mlp.experts = LoRAExperts(experts, layer=layer_idx, memory=memory)
        router = getattr(layer.mlp, "gate", None)
        if isinstance(experts, Experts) and isinstance(router, Linear):
            layer.mlp.gate = LoRALinear(router, layer=layer_idx, first=MODULE_INDEX[ROUTER], memory=memory)
        shared = getattr(layer.mlp, "shared_expert", None)
        for name, first in SHARED_EXPERT_PACKED.items() if shared is not None else ():
            base = getattr(shared, name)
            setattr(shared, name, LoRALinear(base, layer=layer_idx, first=MODULE_INDEX[first], memory=memory))
