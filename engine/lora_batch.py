"""A step's adapters as the LoRA kernels see them: each token's index among the step's U adapters and,
per (layer, fused projection), the page tables of their rows, cut on first use and kept for the step."""

from dataclasses import dataclass, field

import torch

import kernels
from engine.lora_modules import EXPERT_INDEX


@dataclass
class ModuleTables:
    a_rows: torch.Tensor  # [S_a, U, R] int64: where each A row starts in the layer's page memory; S_a is 1 when
    # every slice of every adapter reads the same A (fused-name adapters: x·A is taken once), else S
    a_ranks: torch.Tensor  # [S_a, U] int32: the ranks of those A rows
    b_rows: torch.Tensor  # [S, U, R] int64: where each row of B transposed starts
    ranks: torch.Tensor  # [S, U] int32, each slice's own rank
    scaling: torch.Tensor  # [S, U] float32


@dataclass
class ExpertTables:
    """Page tables of one expert module (lora_modules.EXPERT_INDEX) of a layer, per adapter and expert."""

    a_rows: torch.Tensor  # [U, E, R] int64: where each expert's A rows start in the layer's page memory
    b_rows: torch.Tensor  # [S, U, E, R] int64: where its rows of B transposed start, per output slice
    ranks: torch.Tensor  # [U] int32: each adapter's rank per expert (0: the adapter leaves the module alone)
    scaling: torch.Tensor  # [U] float32


@dataclass
class LoRABatch:
    token_slots: torch.Tensor  # [T] int32: index of the token's adapter among the step's, -1 = base model
    meta: object  # kernels.lora_meta(token_slots, U): the grouping every LoRA op of the step shares
    offsets: torch.Tensor  # [U, L, M', 2, R] int64 (device): every adapter's page table (modules before the experts')
    ranks: torch.Tensor  # [U, L, M] int32 (host)
    scaling: torch.Tensor  # [U, L, M] float32 (device)
    a_source: torch.Tensor  # [U, L, M] int64 (host): the module whose A rows each module reads (AdapterPlan)
    expert_offsets: torch.Tensor  # [U, L, 2, 2, R_e] int64 (device): the experts' modules' page tables
    modules: dict[tuple[int, int, int], ModuleTables | ExpertTables | None] = field(default_factory=dict)

    @classmethod
    def build(cls, token_slots: torch.Tensor,
              tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> "LoRABatch":
        """tables: AdapterPool.tables."""
        offsets, ranks, scaling, a_source, expert_offsets = tables
        return cls(token_slots=token_slots, meta=kernels.lora_meta(token_slots, offsets.shape[0]), offsets=offsets,
                   ranks=ranks, scaling=scaling, a_source=a_source, expert_offsets=expert_offsets)

    def with_slots(self, token_slots: torch.Tensor) -> "LoRABatch":
        """The same adapters and page tables for other tokens: the module tables cut so far, and what the
        kernels gathered through them, are kept."""
        meta = kernels.lora_meta(token_slots, self.offsets.shape[0], previous=self.meta)
        return LoRABatch(token_slots=token_slots, meta=meta, offsets=self.offsets, ranks=self.ranks,
                         scaling=self.scaling, a_source=self.a_source, expert_offsets=self.expert_offsets,
                         modules=self.modules)

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
                ranks = ranks.t().contiguous().to(device)  # [S, U]
                a_slices = 1 if self._one_a(layer, first, num_slices) else num_slices
                self.modules[key] = ModuleTables(
                    a_rows=rows[:, :a_slices, 0].transpose(0, 1).contiguous(),
                    a_ranks=ranks[:a_slices].contiguous(),
                    b_rows=rows[:, :, 1].transpose(0, 1).contiguous(),
                    ranks=ranks,
                    scaling=self.scaling[:, layer, first : first + num_slices].t().contiguous(),
                )
        return self.modules[key]

    def experts(self, layer: int, module: int, num_experts: int, num_slices: int) -> ExpertTables | None:
        """Tables of expert module `module` of a layer (expert e's rows e*r .. e*r + r - 1 of an adapter's page
        table there, and of slice s of B: s*E*r + e*r + j, AdapterPlan); None when no adapter of the step adapts
        it."""
        key = (layer, module, -num_experts)
        if key not in self.modules:
            ranks = self.ranks[:, layer, module]  # [U] host
            width = int(ranks.max())
            if width == 0:
                self.modules[key] = None
            else:
                device = self.offsets.device
                ranks_dev = ranks.to(device)
                rank = ranks_dev.long()[None, :, None, None]  # [1, U, 1, 1]
                s = torch.arange(num_slices, device=device)[:, None, None, None]
                e = torch.arange(num_experts, device=device)[None, None, :, None]
                j = torch.arange(width, device=device)
                table = self.expert_offsets[:, layer, module - EXPERT_INDEX[0]]  # [U, 2, rows]
                index = ((s * num_experts + e) * rank + j).clamp_(max=table.shape[-1] - 1)  # [S, U, E, R]
                used = len(ranks)

                def pick(half, index):  # [S', U, E, R] rows of one half's table
                    flat = index.permute(1, 0, 2, 3).reshape(used, -1)  # [U, S' * E * R]
                    return table[:, half].gather(1, flat).view(used, -1, num_experts, width).transpose(0, 1)

                self.modules[key] = ExpertTables(
                    a_rows=pick(0, index[:1])[0].contiguous(), b_rows=pick(1, index).contiguous(),
                    ranks=ranks_dev.contiguous(), scaling=self.scaling[:, layer, module].contiguous())
        return self.modules[key]

    def _one_a(self, layer: int, first: int, num_slices: int) -> bool:
        """Whether every adapter of the step that adapts a later slice reads the first slice's A there (the
        slices of a fused-name adapter, engine.lora_modules.per_slice): then one shrink serves every slice."""
        later = slice(first + 1, first + num_slices)
        reads_first = self.a_source[:, layer, later] == first  # [U, S - 1]
        return bool((reads_first | (self.ranks[:, layer, later] == 0)).all())
