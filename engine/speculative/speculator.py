"""Speculative decoding as the engine sees it: how many lookahead slots a sequence gets (the policy), the
proposals of a scheduled step (the proposer), and per-sequence bookkeeping. See docs/speculative.md."""

from typing import Protocol

from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative.policy import SpeculationPolicy


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], lookahead: dict[int, int]) -> tuple[dict[int, list[int]], dict]:
        """(seq_id -> proposed tokens, seq_id -> [k, vocab] distributions they were drawn from, if not one-hot)."""
        ...

    def release(self, seq: Sequence) -> None: ...


class Speculator:
    def __init__(self, *, proposer: Proposer, policy: SpeculationPolicy) -> None:
        self.proposer = proposer
        self.policy = policy
        self.num_proposed = 0  # engine totals, for metrics
        self.num_accepted = 0

    def lookahead(self, seq: Sequence, batch_size: int) -> int:
        return self.policy.lookahead(seq, batch_size)

    def propose(self, out: SchedulerOutput) -> tuple[dict[int, list[int]], dict]:
        if not out.lookahead:
            return {}, {}
        seqs = [seq for seq in out.seqs if seq.seq_id in out.lookahead]
        return self.proposer.propose(seqs, out.lookahead)

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.num_spec_proposed += proposed
        seq.num_spec_accepted += accepted
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.policy.record(seq, proposed, accepted)

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)
        self.policy.release(seq)
