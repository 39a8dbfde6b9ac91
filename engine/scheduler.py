"""Iteration-level continuous batching. No torch."""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.fairness import FirstComeFirstServed, VirtualTokenCounter
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step: the sequences to run, in batch order, and how many of their tokens to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens computed this step
    new_seq_ids: set[int] = field(default_factory=set)  # admitted this step (first time or after preemption)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        *,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_adapters: int,
        long_prefill_token_threshold: int = 0,
        policy: FirstComeFirstServed | VirtualTokenCounter | None = None,
        adapter_ready: Callable[[str], bool] = lambda digest: True,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_adapters = max_adapters
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.policy = policy or VirtualTokenCounter()
        self.adapter_ready = adapter_ready
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def active_tenants(self) -> set[str]:
        return {seq.tenant for seq in self.waiting} | {seq.tenant for seq in self.running}

    def running_adapters(self) -> set[str]:
        return {seq.adapter for seq in self.running if seq.adapter is not None}

    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING
        self.policy.on_arrival(seq, self.active_tenants())
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Fill one step of at most `max_num_batched_tokens` tokens.

        Running sequences go first, oldest first: each asks for all its uncomputed tokens (one for a
        decode, a chunk of the prompt for a prefill), capped by the budget left. When the KV cache
        cannot hold them, the newest running sequence is preempted (its blocks freed, to be
        recomputed later) until they fit. Then, if nothing was preempted, waiting sequences are
        admitted one at a time in the order the fairness policy picks among those that are eligible
        (adapter loaded, at most `max_adapters` distinct adapters running, leader's prompt done),
        each taking its prefix-cache hits plus a chunk of its remaining prompt, while the budget,
        `max_num_seqs` and the free blocks last. The first one that does not fit stops admission.
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # running
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk_cap)
            if n == 0:
                i += 1
                continue
            while not bm.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break
            bm.append_slots(seq, n)
            self._add_to_step(out, seq, n)
            budget -= n
            i += 1

        # waiting
        candidates = self._eligible() if not out.preempted else []
        adapters = self.running_adapters()
        while candidates and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.policy.pick(candidates)
            hits = bm.lookup_prefix(seq)
            n = min(seq.num_tokens - len(hits) * bm.block_size, budget, self.chunk_cap)
            if not bm.can_allocate(seq, n, hits):
                break
            bm.allocate(seq, n, hits)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.new_seq_ids.add(seq.seq_id)
            self._add_to_step(out, seq, n)
            budget -= n
            candidates.remove(seq)
            if seq.adapter is not None and seq.adapter not in adapters:
                adapters.add(seq.adapter)
                if len(adapters) >= self.max_adapters:
                    candidates = [c for c in candidates if c.adapter is None or c.adapter in adapters]
        return out

    def _eligible(self) -> list[Sequence]:
        adapters = self.running_adapters()
        eligible = []
        for seq in self.waiting:
            if seq.leader is not None and (seq.leader.in_prefill and not seq.leader.is_finished):
                continue
            if seq.adapter is not None:
                if seq.adapter not in adapters and len(adapters) >= self.max_adapters:
                    continue
                if not self.adapter_ready(seq.adapter):
                    continue
            eligible.append(seq)
        return eligible

    def _add_to_step(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_tokens[seq.seq_id] = n
        prompt_left = max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        self.policy.on_served(seq, prompt_tokens=min(n, prompt_left), completion_tokens=n - min(n, prompt_left))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The model ran the step: its tokens are now in the KV cache."""
        for seq in out.seqs:
            if seq.status == SequenceStatus.RUNNING:
                seq.num_computed_tokens += out.num_tokens[seq.seq_id]
                self.block_manager.commit(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is, freeing its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
