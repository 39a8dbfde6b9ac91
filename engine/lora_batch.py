"""A step's adapters as the LoRA kernels see them: each token's index among the step's U adapters and,
per (layer, fused projection), the page tables of their rows, cut on first use and kept for the step."""

from dataclasses import dataclass, field

import torch

import kernels


@dataclass
class ModuleTables:
    a_rows: torch.Tensor  # [S, U, R] int64: where each A row starts in the layer's page memory
    b_rows: torch.Tensor  # [S, U, R] int64: where each row of B transposed starts
    ranks: torch.Tensor  # [S, U] int32, each slice's own rank
    scaling: torch.Tensor  # [S, U] float32


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] int32: index of the token's adapter among the step's, -1 = base model
    meta: object  # kernels.lora_meta(token_slots, U): the grouping every LoRA op of the step shares
    offsets: torch.Tensor  # [U, L, M, 2, R] int64 (device): every adapter's page table
    ranks: torch.Tensor  # [U, L, M] int32 (host)
    scaling: torch.Tensor  # [U, L, M] float32 (device)
    modules: dict[tuple[int, int, int], ModuleTables | None] = field(default_factory=dict)

    @classmethod
    def build(cls, token_slots: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> "LoRABatch":
        offsets, ranks, scaling = tables
        return cls(token_slots=token_slots, meta=kernels.lora_meta(token_slots, offsets.shape[0]), offsets=offsets,
                   ranks=ranks, scaling=scaling)

    def module(self, layer: int, first: int, num_slices: int) -> ModuleTables | None:
        """Tables of module indices first .. first + num_slices - 1 of a layer; None when no adapter of
        the step targets any of them."""
        key = (layer, first, num_slices)
        if key not in self.modules:
            ranks = self.ranks[:, layer, first : first + num_slices]  # [U, S]
            width = int(ranks.max())
            if width == 0:
                self.modules[key] = None
            else:
                rows = self.offsets[:, layer, first : first + num_slices, :, :width]  # [U, S, 2, R]
                device = self.offsets.device
                self.modules[key] = ModuleTables(
                    a_rows=rows[:, :, 0].transpose(0, 1).contiguous(),
                    b_rows=rows[:, :, 1].transpose(0, 1).contiguous(),
                    ranks=ranks.t().contiguous().to(device),
                    scaling=self.scaling[:, layer, first : first + num_slices].t().contiguous(),
                )
        return self.modules[key]
