"""Per-step metadata that travels through the model's forward pass."""

from dataclasses import dataclass

import torch

from engine.lora_batch import LoRABatch


@dataclass
class Context:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, cached tokens including this step's
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    is_decode: bool  # every sequence has exactly one new token
    lora: LoRABatch | None  # the step's adapters; None: no token of the step uses one
