"""Each constrained sequence's grammar state, and the token masks of a step, computed while the model runs.

`start()` hands the masks of the sequences that sample this step to a thread before the forward pass;
llguidance computes them in Rust with the GIL released (on its own pool of threads), so the model runs
meanwhile; `allowed()` joins before sampling. State is keyed by seq_id, never by batch row."""

import os
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from engine.grammar import Grammar
from engine.sequence import Sequence

BITS = torch.arange(32, dtype=torch.int32)  # bit j of word w allows token 32 * w + j


class GuidedDecoding:
    def __init__(self, *, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.matchers: dict[int, llguidance.LLMatcher] = {}  # seq_id -> its grammar state
        self.mask_words = -(-vocab_size // 32)  # int32 words per mask: llguidance's vocabulary, set by add()
        self._executor: llguidance.LLExecutor | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def add(self, seq: Sequence, grammar: Grammar) -> None:
        self.matchers[seq.seq_id] = grammar.matcher()
        self.mask_words = -(-grammar.mask_vocab_size // 32)

    def release(self, seq: Sequence) -> None:
        self.matchers.pop(seq.seq_id, None)

    def constrained(self, seq: Sequence) -> bool:
        return seq.seq_id in self.matchers

    def accept(self, seq: Sequence, token_id: int) -> str | None:
        """Advance seq's grammar by its sampled token; the grammar's error if it cannot take it (a bug)."""
        matcher = self.matchers.get(seq.seq_id)
        if matcher is None or matcher.consume_token(token_id):
            return None
        return matcher.get_error() or f"the grammar refused token {token_id}"

    def start(self, seqs: list[Sequence]) -> Future | None:
        """Begin computing the next-token masks of `seqs` (their matchers must not change until joined)."""
        if not seqs:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=self.mask_threads())
        matchers = [(self.matchers[seq.seq_id], row) for row, seq in enumerate(seqs)]
        words = self.mask_words
        bitmask = torch.empty((len(seqs), words), dtype=torch.int32)  # [M, words]; written by llguidance
        executor = self._executor

        def compute() -> torch.Tensor:
            executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, len(seqs))
            return bitmask

        return self._thread.submit(compute)

    def mask_threads(self) -> int:
        """llguidance's threads for a step's masks: on CPU the forward pass they overlap uses every core, and a
        wider pool only contends with it (measured: benchmarks/RESULTS.md); beside a GPU the cores are free."""
        return 1 if self.device.type == "cpu" else max(1, min(8, (os.cpu_count() or 2) // 2))

    def allowed(self, pending: Future, seqs: list[Sequence]) -> dict[int, torch.Tensor]:
        """Join the masks `start(seqs)` computes: seq_id -> [vocab] bool on the device."""
        bitmask = pending.result().to(self.device, non_blocking=True)
        bits = (bitmask[:, :, None] >> BITS.to(self.device)) & 1  # [M, words, 32]
        allowed = bits.view(len(seqs), -1)[:, : self.vocab_size].bool()  # [M, vocab]
        return {seq.seq_id: allowed[i] for i, seq in enumerate(seqs)}

    def state(self) -> dict:
        return {"constrained_sequences": len(self.matchers)}
