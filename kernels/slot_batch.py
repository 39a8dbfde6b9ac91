"""Grouping of a step's tokens by adapter slot, as the CPU references of lora_shrink/lora_expand use it."""

from dataclasses import dataclass, field

import torch

PER_SLOT_WIDTH = 64  # from this many rows per slot on, a matmul per slot at its own rank beats padding ranks
SPAN_MAX_SLOTS = 6  # up to this many slots whose tokens are each one run, a matmul per run beats gathering


@dataclass
class SlotGroup:
    """The tokens of some slots laid out slot by slot, each slot's run padded to the busiest slot's,
    so that one batched matmul over [slots, width, ...] serves every slot."""

    slots: list[int]  # ascending
    rank: int  # the largest rank among the slots
    width: int  # rows per slot
    gather_rows: torch.Tensor  # [slots * width] int64: the token in each padded row (padding repeats token 0)
    scatter_rows: torch.Tensor  # [T] int64: the padded row of each token; other tokens point at a padding row
    slot_ids: torch.Tensor | None  # [slots] int64 when the slots are not one run, else None
    counts: list[int]  # tokens of each slot
    ranks: list[int]  # rank of each slot
    runs: list[torch.Tensor]  # [count] int64 per slot: its tokens
    spans: list[tuple[int, int]] | None  # per slot: (start, end) when its tokens are rows start .. end - 1, for
    # every slot (the model runner orders a step's sequences by adapter), else None
    pieces: list[int]  # with spans: the sizes that cut rows 0 .. T - 1 into consecutive pieces, each span one
    piece_of: list[int]  # with spans: each slot's piece
    identity: bool  # gather_rows and scatter_rows are both 0 .. T-1 (e.g. a decode step, one adapter per token)
    inside: torch.Tensor | None  # [T, 1] float32: 1 for the group's tokens, 0 for others; None when all are in

    @property
    def per_slot(self) -> bool:
        """Whether to multiply slot by slot at each slot's own rank instead of one padded batched matmul."""
        return self.width >= PER_SLOT_WIDTH

    @property
    def by_span(self) -> bool:
        """Whether to multiply run by run on slices of the tokens (no gather, no scatter, no padding)."""
        return self.spans is not None and (len(self.slots) <= SPAN_MAX_SLOTS or self.per_slot)

    def select(self, weights: torch.Tensor, dim: int) -> torch.Tensor:
        """weights indexed by slot along dim, restricted to this group's slots (a view when they are a run)."""
        if self.slot_ids is None:
            return weights.narrow(dim, self.slots[0], len(self.slots))
        return weights.index_select(dim, self.slot_ids)


@dataclass
class SlotBatch:
    """A step's token -> slot assignment, built once per step and passed as `meta` to every LoRA op of
    the step on CPU. `group(ranks)` lays out the tokens of the slots with rank > 0 (cached per ranks)."""

    by_slot: dict[int, list[int]]  # slot -> its tokens, ascending
    num_tokens: int
    device: torch.device
    groups: dict[tuple[int, ...], SlotGroup | None] = field(default_factory=dict, repr=False)
    grouped: dict[tuple, tuple] = field(default_factory=dict, repr=False)  # the references' group per ranks tensor
    # the references' dense operands gathered from the pages: they depend on the page tables, not on the tokens
    gathered: dict[tuple, tuple] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, token_slots: torch.Tensor, *, previous: "SlotBatch | None" = None) -> "SlotBatch":
        """previous: the SlotBatch of an earlier step over the same page tables, whose gathered operands
        this one keeps."""
        by_slot: dict[int, list[int]] = {}
        for t, slot in enumerate(token_slots.tolist()):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(t)
        return cls(by_slot=dict(sorted(by_slot.items())), num_tokens=token_slots.shape[0], device=token_slots.device,
                   gathered=previous.gathered if previous is not None else {})

    def group(self, ranks: torch.Tensor) -> SlotGroup | None:
        """The group of the used slots whose rank (ranks [slots]) is > 0; None when there is none."""
        rank_list = ranks.tolist()
        key = tuple(rank_list[slot] for slot in self.by_slot)
        if key not in self.groups:
            self.groups[key] = self._group({slot: rank_list[slot] for slot in self.by_slot if rank_list[slot] > 0})
        return self.groups[key]

    def _group(self, slot_ranks: dict[int, int]) -> SlotGroup | None:
        if not slot_ranks:
            return None
        runs = [self.by_slot[slot] for slot in slot_ranks]
        width = max(len(run) for run in runs)
        if sum(len(run) for run in runs) < self.num_tokens and all(len(run) == width for run in runs):
            width += 1  # a padding row for the tokens outside the group to point at
        gather, scatter, padding_row = [], [0] * self.num_tokens, None
        for i, run in enumerate(runs):
            gather += run + [0] * (width - len(run))
            if padding_row is None and len(run) < width:
                padding_row = i * width + len(run)
        if padding_row is not None:
            scatter = [padding_row] * self.num_tokens
        for i, run in enumerate(runs):
            for j, t in enumerate(run):
                scatter[t] = i * width + j
        contiguous = all(run[-1] - run[0] + 1 == len(run) for run in runs)
        pieces, piece_of, at = [], [0] * len(runs), 0
        if contiguous:
            for i in sorted(range(len(runs)), key=lambda i: runs[i][0]):
                if runs[i][0] > at:  # rows of other slots or of the base model before this run
                    pieces.append(runs[i][0] - at)
                piece_of[i], at = len(pieces), runs[i][-1] + 1
                pieces.append(len(runs[i]))
            if at < self.num_tokens:
                pieces.append(self.num_tokens - at)
        rank, slots = max(slot_ranks.values()), list(slot_ranks)
        one_run = slots[-1] - slots[0] + 1 == len(slots)
        tokens_in = sum(len(run) for run in runs)
        identity = tokens_in == self.num_tokens == len(gather) and gather == list(range(self.num_tokens))
        inside = None
        if tokens_in < self.num_tokens:
            inside = torch.zeros(self.num_tokens, 1, device=self.device)
            inside[[t for run in runs for t in run]] = 1.0
        return SlotGroup(
            slots=slots,
            rank=rank,
            width=width,
            gather_rows=torch.tensor(gather, dtype=torch.int64, device=self.device),  # [slots * width]
            scatter_rows=torch.tensor(scatter, dtype=torch.int64, device=self.device),  # [T]
            slot_ids=None if one_run else torch.tensor(slots, dtype=torch.int64, device=self.device),
            counts=[len(run) for run in runs],
            ranks=list(slot_ranks.values()),
            runs=[torch.tensor(run, dtype=torch.int64, device=self.device) for run in runs],
            spans=[(run[0], run[-1] + 1) for run in runs] if contiguous else None,
            pieces=pieces,
            piece_of=piece_of,
            identity=identity,
            inside=inside,
        )
