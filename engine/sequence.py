"""One sequence being generated: its tokens, its KV blocks and its bookkeeping. No torch."""

import itertools
from enum import Enum, auto

from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request with n completions is n sequences; completion 0 leads, the others follow it and
    reuse its prompt blocks once it has computed them."""

    def __init__(
        self,
        *,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        adapter: str | None,
        tenant: str,
        weight: float,
        cache_salt: str,
        arrival_time: float,
        leader: "Sequence | None" = None,
        constrained: bool = False,
        images: tuple = (),
        rope_positions: list[list[int]] | None = None,
        rope_delta: int = 0,
        unsplit: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """images: the prompt's engine.images.PromptImage, in order; rope_positions: a multimodal rope's (t, h, w)
        positions of the prompt's tokens, [3][prompt], and rope_delta what each later token's adds to its index;
        unsplit: runs [start, end) of prompt positions, in order, that no prefill chunk may end inside (an image
        whose tokens attend to each other both ways)."""
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling = sampling
        self.adapter = adapter
        self.tenant = tenant
        self.weight = weight
        self.cache_salt = cache_salt
        self.leader = leader
        self.constrained = constrained  # a grammar constrains its output (engine/guided.py holds its state)
        self.images = tuple(images)
        self.rope_positions, self.rope_delta = rope_positions, rope_delta
        self.unsplit = tuple(unsplit)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit on first admission
        self.num_charged_tokens = 0  # tokens the fairness policy has charged for (never twice)
        self.block_table: list[int] = []  # FREED (-1) at the head where blocks left every layer's window
        self.num_freed_blocks = 0  # those head entries
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks seen so far
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_type: str | None = None  # e.g. "adapter_unavailable"
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.gpu_ms = 0.0
        self.num_preemptions = 0
        self.text = ""  # final text once finished (the detokenizer holds it before)
        self.logprobs: list = []  # engine.outputs.Logprob per completion token, when asked for
        self.prompt_logprobs: list | None = None
        self.num_spec_proposed = 0  # speculative decoding: tokens proposed for this sequence, and accepted
        self.num_spec_accepted = 0
        self.num_sampling_steps = 0  # steps that gave it tokens: completion tokens / this = its tokens per step

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}/{self.index}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def mrope_positions(self, start: int, end: int) -> list[list[int]]:
        """The (t, h, w) positions [3][end - start] of tokens start..end-1 under a multimodal rope."""
        prompt = self.rope_positions
        return [[axis[p] if prompt is not None and p < len(axis) else p + self.rope_delta for p in range(start, end)]
                for axis in (prompt or ([], [], []))]

    @property
    def content_marks(self) -> tuple[tuple[int, int, str], ...]:
        """(first, end, digest) of each image over its placeholder tokens: part of its blocks' keys."""
        return tuple((image.offset, image.offset + image.features.num_tokens, image.features.digest)
                     for image in self.images)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of tokens start..end-1 may end instead, so that it ends inside no unsplit run: back at
        the run's start, or on at its end when the run starts at or before `start` (then past `end`)."""
        for first, last in self.unsplit:
            if first < end < last:
                end = first if first > start else last
        return end

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
