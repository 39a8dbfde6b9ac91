"""A step flattened into one ragged batch, as host lists: what the eager path makes tensors of and the graph
path (engine/cuda_graph.py) copies into its static buffers."""

from dataclasses import dataclass, field


@dataclass
class StepInputs:
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]: block_id * block_size + offset
    block_tables: list[list[int]]  # [B][blocks]
    context_lens: list[int]  # [B]: cached tokens including this step's
    cu_seqlens_q: list[int]  # [B + 1]
    prompt_lens: list[int]  # [B]
    token_slots: list[int]  # [T]: index of the token's adapter in `adapters`, -1 = base model
    adapters: list[str]  # the step's adapter digests, in slot order
    mrope_positions: list[list[int]] | None = None  # [3][T]: a multimodal rope's (t, h, w) positions
    key_limits: list[int] | None = None  # [T]: the last key each row sees (images attended both ways); None: causal
    images: list = field(default_factory=list)  # (key, ImageFeatures, rows [N], its token of each [N], last chunk)

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one new token (no prefill chunk, no speculative rows)."""
        return len(self.input_ids) == len(self.context_lens)
