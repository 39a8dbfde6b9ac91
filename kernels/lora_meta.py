"""Grouping of a batch's tokens by adapter slot, shared by the LoRA kernels of a step."""

from dataclasses import dataclass

import numpy as np
import torch

BLOCK_M = 16  # tokens per program of lora_delta (the block table below is cut in blocks of this many)


@dataclass
class LoRAMeta:
    """Tokens sorted by slot, with per-slot counts and starts, and the blocks of BLOCK_M tokens of one slot
    that lora_delta's programs take (all on the tokens' device, views of one int32 buffer `packed`).

    token_slots [T] int32: each token's slot (-1: base model), as filled;
    sorted_tokens [T] int32: token indices ordered by slot (base-model tokens last);
    slot_counts [slots] int32: tokens using each slot; slot_starts [slots] int32: where each
    slot's run begins in sorted_tokens;
    block_slots [P] int32: the slot of each block (-1: no block), P = cdiv(T, BLOCK_M) + min(T, slots), the most
    blocks any grouping of T tokens needs; block_offsets [P] int32: the block's first token within its slot's run.
    Allocated once and refilled in place, so it is built once per step, shared by every layer, and read by a
    CUDA graph's replay: `fill_host_` from a host list (the whole buffer in one copy, no device op) or `fill_`
    from a device tensor (device ops only, no host sync; capturable). A step may have fewer tokens than T:
    either fill takes any prefix and counts the rest as the base model's.
    """

    packed: torch.Tensor  # [2T + 2 slots + 2P] int32: the fields below, one after another
    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_counts: torch.Tensor
    slot_starts: torch.Tensor
    block_slots: torch.Tensor
    block_offsets: torch.Tensor

    @classmethod
    def empty(cls, num_tokens: int, num_slots: int, device: torch.device | str) -> "LoRAMeta":
        blocks = max_blocks(num_tokens, num_slots)
        packed = torch.zeros(2 * num_tokens + 2 * num_slots + 2 * blocks, dtype=torch.int32, device=device)
        fields = packed.split([num_tokens, num_tokens, num_slots, num_slots, blocks, blocks])
        meta = cls(packed, *fields)
        meta.token_slots.fill_(-1)
        meta.block_slots.fill_(-1)
        return meta

    @classmethod
    def build(cls, token_slots: torch.Tensor, num_slots: int) -> "LoRAMeta":
        meta = cls.empty(token_slots.shape[0], num_slots, token_slots.device)
        return meta.fill_(token_slots)

    @property
    def num_slots(self) -> int:
        return self.slot_counts.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.sorted_tokens.shape[0]

    def fill_host_(self, token_slots: list[int], *, staging: torch.Tensor | None = None) -> "LoRAMeta":
        """Compute the grouping of token_slots (T' <= T ints) on the host and copy it in with one copy;
        staging: a pinned int32 host tensor like `packed` to copy from without blocking (the caller makes sure
        the previous copy from it is done)."""
        tokens, num_slots = self.num_tokens, self.num_slots
        if len(token_slots) > tokens:
            raise ValueError(f"{len(token_slots)} token slots do not fit meta of {tokens} tokens")
        out = np.empty(self.packed.shape[0], dtype=np.int32) if staging is None else staging.numpy()
        slots = out[:tokens]
        slots[: len(token_slots)] = token_slots
        slots[len(token_slots) :] = -1
        key = np.where((slots < 0) | (slots >= num_slots), num_slots, slots)  # [T]
        out[tokens : 2 * tokens] = np.argsort(key, kind="stable")
        counts = np.bincount(key, minlength=num_slots + 1)[:num_slots]
        at = 2 * tokens
        out[at : at + num_slots] = counts
        out[at + num_slots : at + 2 * num_slots] = np.cumsum(counts) - counts
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        ends = np.cumsum(blocks)
        program = np.arange(self.block_slots.shape[0])
        slot = np.searchsorted(ends, program, side="right")  # [P]; num_slots: past the last block
        first_block = np.append(ends - blocks, 0)[slot]
        at += 2 * num_slots
        out[at : at + len(program)] = np.where(slot < num_slots, slot, -1)
        out[at + len(program) :] = (program - first_block) * BLOCK_M
        self.packed.copy_(torch.from_numpy(out) if staging is None else staging, non_blocking=staging is not None)
        return self

    def fill_(self, token_slots: torch.Tensor) -> "LoRAMeta":
        """Recompute the grouping for token_slots [T'] (T' <= T, same device) in place, with device ops."""
        if token_slots.dim() != 1 or token_slots.shape[0] > self.num_tokens:
            raise ValueError(f"token_slots {tuple(token_slots.shape)} do not fit meta of {self.num_tokens} tokens")
        num_slots, device = self.num_slots, self.sorted_tokens.device
        self.token_slots.fill_(-1)
        self.token_slots[: token_slots.shape[0]] = token_slots
        slots = self.token_slots.long()
        key = torch.where((slots < 0) | (slots >= num_slots), num_slots, slots)  # [T]
        self.sorted_tokens.copy_(torch.sort(key, stable=True).indices)
        counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)  # [slots + 1]
        counts.scatter_add_(0, key, torch.ones_like(key))
        counts = counts[:num_slots]
        self.slot_counts.copy_(counts)
        self.slot_starts.copy_(torch.cumsum(counts, 0) - counts)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [slots]
        ends = torch.cumsum(blocks, 0)  # [slots] one past each slot's last block
        program = torch.arange(self.block_slots.shape[0], device=device)  # [P]
        slot = torch.searchsorted(ends, program, right=True)  # [P] in 0 .. slots (slots: past the last block)
        first_block = torch.cat([ends - blocks, ends.new_zeros(1)]).gather(0, slot)
        self.block_slots.copy_(torch.where(slot < num_slots, slot, -1))
        self.block_offsets.copy_((program - first_block) * BLOCK_M)
        return self


def max_blocks(num_tokens: int, num_slots: int) -> int:
    """The most blocks of BLOCK_M tokens of one slot that num_tokens tokens over num_slots slots can make."""
    return -(-num_tokens // BLOCK_M) + min(num_tokens, num_slots)
