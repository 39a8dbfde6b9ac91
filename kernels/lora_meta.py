"""Grouping of a batch's tokens by adapter slot, shared by the LoRA shrink and expand kernels."""

from dataclasses import dataclass

import torch


@dataclass
class LoRAMeta:
    """Tokens sorted by slot, with per-slot counts and starts (all on the tokens' device).

    sorted_tokens [T] int32: token indices ordered by slot (base-model tokens last);
    slot_counts [slots] int32: tokens using each slot; slot_starts [slots] int32: where each
    slot's run begins in sorted_tokens. Built with device ops only (no host sync), so it can be
    built once per step, shared by every layer, and refilled in place (`fill_`) inside a CUDA graph.
    """

    sorted_tokens: torch.Tensor
    slot_counts: torch.Tensor
    slot_starts: torch.Tensor

    @classmethod
    def empty(cls, num_tokens: int, num_slots: int, device: torch.device | str) -> "LoRAMeta":
        return cls(
            sorted_tokens=torch.zeros(num_tokens, dtype=torch.int32, device=device),  # [T]
            slot_counts=torch.zeros(num_slots, dtype=torch.int32, device=device),  # [slots]
            slot_starts=torch.zeros(num_slots, dtype=torch.int32, device=device),  # [slots]
        )

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int) -> "LoRAMeta":
        meta = cls.empty(token_slots.shape[0], num_slots, token_slots.device)
        return meta.fill_(token_slots)

    @property
    def num_slots(self) -> int:
        return self.slot_counts.shape[0]

    def fill_(self, token_slots: torch.Tensor) -> "LoRAMeta":
        """Recompute the grouping for token_slots [T] (same T and device) in place."""
        if token_slots.shape != self.sorted_tokens.shape:
            raise ValueError(f"token_slots {tuple(token_slots.shape)} != meta {tuple(self.sorted_tokens.shape)}")
        num_slots = self.num_slots
        slots = token_slots.long()
        key = torch.where((slots < 0) | (slots >= num_slots), torch.full_like(slots, num_slots), slots)  # [T]
        self.sorted_tokens.copy_(torch.sort(key, stable=True).indices)
        counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)  # [slots + 1]
        counts.scatter_add_(0, key, torch.ones_like(key))
        self.slot_counts.copy_(counts[:num_slots])
        self.slot_starts.copy_(torch.cumsum(counts[:num_slots], 0) - counts[:num_slots])
        return self
