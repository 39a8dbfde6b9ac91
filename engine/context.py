"""Per-step metadata that travels through the model's forward pass."""

from dataclasses import dataclass

import torch

from kernels import LoRAMeta, SlotBatch


@dataclass
class Context:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, cached tokens including this step's
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    is_decode: bool  # every sequence has exactly one new token
    token_slots: torch.Tensor  # [T] int32, adapter slot per token, -1 = base model
    lora_meta: LoRAMeta | SlotBatch | None  # kernels.lora_meta's grouping; None: no token in the step uses an adapter
    active_slots: tuple[int, ...]  # adapter slots used by some token of the step
