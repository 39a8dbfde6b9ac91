"""Per-step metadata that travels through the model's forward pass."""

from dataclasses import dataclass, field

import torch

import kernels
from engine.lora_batch import LoRABatch


@dataclass
class ImageBatch:
    """The step's image tokens: where they are and what the vision encoder made of them."""

    rows: torch.Tensor  # [N] int64: the step's rows that hold image tokens
    embeds: torch.Tensor  # [N, hidden]: their embeddings
    deepstack: list[torch.Tensor]  # [N, hidden] per layer: added after the first decoder layers (Qwen3-VL)


@dataclass
class Context:
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32, cached tokens including this step's
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    prompt_lens: torch.Tensor  # [B] int32, each sequence's prompt length (LongRoPE's choice of rows)
    is_decode: bool  # every sequence has exactly one new token
    lora: LoRABatch | None  # the step's adapters; None: no token of the step uses one
    images: "ImageBatch | None" = None  # the images whose placeholder tokens this step prefills
    mrope_positions: torch.Tensor | None = None  # [3, T] int64: (t, h, w) positions of a multimodal rope
    key_limits: torch.Tensor | None = None  # [T] int32: the last key each row sees, past its own position for an
    # image's tokens that attend both ways (Gemma 3); None: causal
    rope_table: torch.Tensor | None = None  # [T, rotary_dim]: each row's own rope row (multimodal rope), read
    # in place of the layers' tables; the positions the layers get are then 0..T-1
    _decode_layout: object = field(default=None, repr=False)  # decode_meta(): prepare_decode() cuts it
    _decode_ready: bool = field(default=False, repr=False)

    @classmethod
    def build(cls, *, positions: list[int], slot_mapping: list[int], block_tables: list[list[int]],
              context_lens: list[int], cu_seqlens_q: list[int], prompt_lens: list[int], lora: LoRABatch | None,
              device: torch.device, images: ImageBatch | None = None,
              mrope_positions: list[list[int]] | None = None, key_limits: list[int] | None = None) -> "Context":
        """The step's Context from plain lists (block tables padded with page 0 to the longest)."""
        width = max(len(t) for t in block_tables)
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),  # [T]
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),  # [T]
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                      device=device),  # [B, max_blocks]
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),  # [B]
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=device),  # [B + 1]
            prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32, device=device),  # [B]
            is_decode=len(positions) == len(context_lens),
            lora=lora,
            images=images,
            mrope_positions=None if mrope_positions is None else torch.tensor(
                mrope_positions, dtype=torch.int64, device=device),  # [3, T]
            key_limits=None if key_limits is None else torch.tensor(key_limits, dtype=torch.int32, device=device),  # [T]
        )

    def prepare_decode(self, k_cache: torch.Tensor, windows: set[int | None]) -> "Context":
        """Cut, before the forward, the `meta` every layer's paged_attention_decode of a decode step reads
        (kernels.decode_layout: the reference's buckets, for each of the model's windows; nothing for the Triton
        launcher), so that the forward itself makes no host sync and no choice on the tensors' values."""
        if self.is_decode and not self._decode_ready:
            layout = kernels.decode_layout(self.block_tables, self.context_lens, k_cache)
            for window in windows if layout is not None else ():
                layout.for_window(window)
            self._decode_layout, self._decode_ready = layout, True
        return self

    def decode_meta(self, k_cache: torch.Tensor):
        """The `meta` of a decode step's paged_attention_decode calls, shared by every layer (every layer's cache
        has one shape): prepare_decode's, or cut by the first layer that asks when it was not called."""
        if not self._decode_ready:
            self.prepare_decode(k_cache, set())
        return self._decode_layout
