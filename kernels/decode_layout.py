"""How the CPU reference of paged_attention_decode lays out a step's sequences: in buckets of similar
length, each bucket's cache blocks and the keys each of its queries sees. Built once per step (and per
window), then read by every layer, which only gathers, attends and puts the rows back."""

from dataclasses import dataclass, field

import torch

BUCKET = 16  # decode attention pads sequences in buckets of about this many
MAX_BUCKETS = 4


@dataclass
class DecodeBucket:
    rows: torch.Tensor | None  # [n] int64: the bucket's sequences; None: every sequence, in order
    blocks: torch.Tensor  # [n * span] int64: each sequence's span cache blocks, the ones its window starts in first
    span: int  # blocks gathered per sequence
    visible: torch.Tensor  # [n, 1, 1, span * block_size] bool: the gathered keys each query sees


@dataclass
class DecodeLayout:
    """A decode step's buckets for block_tables [B, max_blocks] and context_lens [B], per window (None: whole
    contexts), cut on first use."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    block_size: int
    num_blocks: int  # blocks in the cache: table entries beyond it are clamped (padding)
    buckets: dict[int | None, list[DecodeBucket]] = field(default_factory=dict, repr=False)

    def for_window(self, window: int | None) -> list[DecodeBucket]:
        if window not in self.buckets:
            self.buckets[window] = self._cut(window)
        return self.buckets[window]

    def _cut(self, window: int | None) -> list[DecodeBucket]:
        batch = self.context_lens.shape[0]
        if batch <= BUCKET:
            return [self._bucket(None, window)]
        # sequences sorted by length, in buckets each padded to its own longest: less padding to gather
        lens = self.context_lens.tolist()
        order = sorted(range(batch), key=lens.__getitem__)
        count = min(MAX_BUCKETS, -(-batch // BUCKET))
        device = self.context_lens.device
        return [self._bucket(torch.tensor(order[i * batch // count : (i + 1) * batch // count], device=device), window)
                for i in range(count)]

    def _bucket(self, rows: torch.Tensor | None, window: int | None) -> DecodeBucket:
        bs = self.block_size
        tables = self.block_tables if rows is None else self.block_tables.index_select(0, rows)
        lens = (self.context_lens if rows is None else self.context_lens.index_select(0, rows)).long()  # [n]
        first = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0) // bs  # first block read
        span = -(-int((lens - first * bs).max()) // bs)
        cols = (first[:, None] + torch.arange(span, device=lens.device)).clamp(max=tables.shape[1] - 1)
        blocks = tables.gather(1, cols).clamp(min=0, max=self.num_blocks - 1).long().flatten()  # [n * span]
        pos = first[:, None] * bs + torch.arange(span * bs, device=lens.device)  # [n, L]: each key's position
        visible = pos < lens[:, None]
        if window is not None:
            visible &= pos > lens[:, None] - 1 - window
        return DecodeBucket(rows=rows, blocks=blocks, span=span, visible=visible[:, None, None, :])
