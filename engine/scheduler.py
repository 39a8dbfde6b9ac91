"""Iteration-level continuous batching. No torch."""

import itertools
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_manager import BlockManager
from engine.fairness import FirstComeFirstServed, VirtualTokenCounter
from engine.kv.connector import ConnectorScheduler, Load
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """One step: the sequences to run, in batch order, and how many of their tokens to compute."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens computed this step
    new_seq_ids: set[int] = field(default_factory=set)  # admitted this step (first time or after preemption)
    preempted: list[Sequence] = field(default_factory=list)
    lookahead: dict[int, int] = field(default_factory=dict)  # seq_id -> KV slots reserved for speculative tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class AdapterPages(Protocol):
    """What the scheduler asks of the adapter pool (engine.adapter_pool.AdapterPool)."""

    def ready(self, digest: str) -> bool: ...  # resident on the device (else its load is under way)
    def pages_to_place(self, digest: str) -> int | None: ...  # in host memory, waiting for `place`: its pages
    def place(self, digest: str) -> None: ...  # take its pages and copy it there, off the step loop
    def acquire(self, digest: str) -> None: ...
    def release(self, digest: str) -> None: ...
    def reclaim(self, num_pages: int, *, keep: Collection[str] = ()) -> int: ...


class PageLender(Protocol):
    """Pages held for someone outside the engine's own requests, which it gives back when they are needed
    (engine.kv.lease.LeaseTable: blocks leased to a decode engine that has not pulled them yet)."""

    def reclaim(self, num_pages: int) -> int: ...


class Scheduler:
    def __init__(
        self,
        *,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        long_prefill_token_threshold: int = 0,
        policy: FirstComeFirstServed | VirtualTokenCounter | None = None,
        adapters: AdapterPages | None = None,
        lookahead: Callable[[Sequence, int], int] | None = None,
        connector: ConnectorScheduler | None = None,
        leases: PageLender | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.policy = policy or VirtualTokenCounter()
        self.adapters = adapters
        self.lookahead = lookahead  # (decoding seq, batch size) -> speculative tokens it may propose
        self.connector = connector  # KV outside the pool (engine/kv/connector.py): loads before admission
        self.leases = leases  # blocks kept for other engines: given back when the pool runs short
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[int, tuple[Sequence, Load, list[int]]] = {}  # seq_id -> (seq, its load, device hits held)
        self.loaded: dict[int, int] = {}  # seq_id -> blocks a finished load brought in, until admitted
        self.load_failed: set[int] = set()  # seq_ids whose load failed: they recompute, never load again
        self.tier_counts = {"device": [0, 0], "host": [0, 0]}  # tier -> [hit blocks, missed blocks], first admissions

    @property
    def max_chunk(self) -> int:
        """The most tokens of one sequence a step computes."""
        return min(self.chunk_cap, self.max_num_batched_tokens)

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
        decode, a chunk of the prompt for a prefill), capped by the budget left; a chunk never ends inside one of
        the sequence's unsplit runs (an image attended both ways): it stops before the run, or takes all of it,
        or waits for a step with room. Then, if nothing was
        preempted, waiting sequences are admitted one at a time in the order the fairness policy picks
        among those that are eligible (adapter resident on the device, leader's prompt done), each taking its
        prefix-cache hits plus a chunk of its remaining prompt, while the budget, `max_num_seqs` and the pages
        last. The first one that does not fit stops admission. There is no cap on distinct adapters. Last, the
        adapters that waiting sequences need and that are in host memory are given pages, in line order, while
        pages stay free beyond one per running sequence, and their copy starts off the step loop; their
        sequences become eligible in the step after it is done. An adapter not in memory at all is read from
        disk in the background from its first request on. With a connector
        (a host tier), a candidate whose next blocks after its device hits the connector holds is not
        admitted yet: pages are taken for those blocks and a load starts; it waits (the others go on)
        until a later step finds the load done and its blocks cached, and is then admitted as a prefix hit.

        With speculative decoding, each running decoding sequence then gets lookahead slots for the tokens
        it may propose, as many as the `lookahead` policy grants and the budget and free pages left after
        admission allow (a guess never preempts, nor keeps anyone waiting); slots of rejected tokens are
        given back in `on_step_done`.

        Pages (KV blocks and adapter pages are one pool) come from, in order: the free list, prefix-
        cached blocks no one holds (LRU), adapters no running or waiting sequence needs (LRU), blocks leased
        to another engine that has not pulled them yet (the leases closest to expiry end), adapters only
        waiting sequences need (LRU; never for a placement, which only takes what no one needs); and only for
        a running sequence, then, by preempting the newest running sequence (its blocks freed and its
        adapter unpinned, to be recomputed later). Admission never preempts.
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        if self.connector is not None:
            self._finish_loads()

        # running
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            while not bm.can_append(seq, n):
                if self._reclaim(bm.append_shortfall(seq, n)):
                    continue
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
        while candidates and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.policy.pick(candidates)
            if seq.adapter is not None and not self.adapters.ready(seq.adapter):  # evicted since: placed again
                candidates.remove(seq)
                continue
            hits = bm.lookup_prefix(seq)
            if self.connector is not None and self._start_load(seq, hits):
                candidates.remove(seq)
                continue
            n = self._chunk(seq, len(hits) * bm.block_size, budget)
            if n == 0:  # an unsplit run that does not fit what is left of the step
                break
            short = bm.shortfall(seq, n, hits, 0)
            if short and not (self._reclaim(short, keep=seq.adapter) and bm.can_allocate(seq, n, hits, 0)):
                break
            bm.allocate(seq, n, hits)
            if seq.adapter is not None:
                self.adapters.acquire(seq.adapter)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
                self._count_tiers(seq, len(hits))
            self.loaded.pop(seq.seq_id, None)
            self.load_failed.discard(seq.seq_id)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.new_seq_ids.add(seq.seq_id)
            self._add_to_step(out, seq, n)
            budget -= n
            candidates.remove(seq)

        self._place_adapters()

        # speculative lookahead, from what is left
        if self.lookahead is not None:
            for seq in out.seqs:
                if seq.seq_id not in out.new_seq_ids and budget > 0:
                    extra = self._lookahead(seq, out.num_tokens[seq.seq_id], budget)
                    if extra:
                        bm.append_slots(seq, 1 + extra)
                        out.lookahead[seq.seq_id] = extra
                        budget -= extra
        return out


    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """How many of seq's tokens from `start` to compute this step: all that are left, capped by the budget and
        the chunk cap, with the chunk's end moved out of any unsplit run (Sequence.chunk_end); 0 when that takes
        more than the cap allows."""
        limit = min(budget, self.chunk_cap)
        n = min(seq.num_tokens - start, limit)
        n = seq.chunk_end(start, start + n) - start if seq.unsplit else n
        return n if n <= limit else 0

    # KV from the connector
    def _start_load(self, seq: Sequence, hits: list[int]) -> bool:
        """Start loading the blocks after seq's device hits that the connector holds, if pages allow (a reserve
        of one per running sequence stays free); whether it did (then seq waits for it)."""
        bm = self.block_manager
        if seq.seq_id in self.load_failed:
            return False
        keys = bm.keys_after(seq, len(hits))
        count = self.connector.lookup(keys) if keys else 0
        revived = sum(1 for b in hits if bm.ref_counts[b] == 0)
        count = min(count, bm.num_free_blocks - revived - len(self.running) - 1)
        if count <= 0:
            return False
        held = bm.hold(seq.block_hashes[: len(hits)])  # the loaded blocks' parents stay till they are in
        block_ids = bm.take_blocks(count)
        found = self.connector.lookup(keys[:count])  # taking pages evicts blocks into it, and may push some out
        bm.release(block_ids[found:])
        if not found:
            bm.release(held)
            return False
        load = Load(seq_id=seq.seq_id, keys=keys[:found], block_ids=block_ids[:found])
        self.loading[seq.seq_id] = (seq, load, held)
        self.connector.start_load(load)
        return True

    def _finish_loads(self) -> None:
        for load in self.connector.finished_loads():
            seq, _, held = self.loading.pop(load.seq_id)
            if load.ok:
                self.block_manager.install(load.block_ids, load.keys)
                if not seq.is_finished:
                    self.loaded[seq.seq_id] = len(load.keys)
            else:
                self.block_manager.release(load.block_ids)
                if not seq.is_finished:
                    self.load_failed.add(seq.seq_id)
            self.block_manager.release(held)

    def _count_tiers(self, seq: Sequence, num_hits: int) -> None:
        """Hit and missed blocks of a first admission, by tier: the device's own, then the host tier's."""
        looked = len(self.block_manager.keys_after(seq, 0))
        if not looked:
            return
        from_host = min(self.loaded.get(seq.seq_id, 0), num_hits)
        device = self.tier_counts["device"]
        device[0] += num_hits - from_host
        device[1] += looked - (num_hits - from_host)
        if self.connector is not None:
            self.tier_counts["host"][0] += from_host
            self.tier_counts["host"][1] += looked - num_hits

    def _lookahead(self, seq: Sequence, n: int, budget: int) -> int:
        """Lookahead slots for seq (scheduled for n tokens) within `budget` tokens and the free pages."""
        if n != 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
            return 0
        extra = min(self.lookahead(seq, len(self.running)), budget)
        while extra > 0 and not self.block_manager.can_append(seq, n + extra):  # never preempt for a guess
            extra -= 1
        return max(extra, 0)

    # adapters' pages
    def _waiting_adapters(self) -> dict[str, None]:
        """The adapters waiting sequences need, in line order."""
        return dict.fromkeys(seq.adapter for seq in self.waiting if seq.adapter is not None)

    def _place_adapters(self) -> None:
        """Give pages to the adapters of the next max_num_seqs sequences in line that are in host memory and start
        their copy, while pages stay free beyond one per running sequence, evicting only adapters no running or
        waiting sequence needs."""
        if self.adapters is None:
            return
        needed = self._waiting_adapters()
        next_in_line = itertools.islice(self.waiting, self.max_num_seqs)
        for digest in dict.fromkeys(seq.adapter for seq in next_in_line if seq.adapter is not None):
            pages = self.adapters.pages_to_place(digest)
            if pages is None:
                continue
            short = pages - (self.block_manager.num_free_blocks - len(self.running))
            if short > 0 and self.adapters.reclaim(short, keep=needed) < short:
                return
            self.adapters.place(digest)

    def _reclaim(self, num_pages: int, *, keep: str | None = None) -> bool:
        """Free num_pages pages by evicting unpinned adapters no waiting sequence needs, then by ending leases,
        then by evicting those only waiting sequences need; whether that was enough."""
        kept = {keep} if keep is not None else set()
        freed = 0
        if self.adapters is not None:
            freed = self.adapters.reclaim(num_pages, keep=kept | self._waiting_adapters().keys())
        if freed < num_pages and self.leases is not None:
            freed += self.leases.reclaim(num_pages - freed)
        if freed < num_pages and self.adapters is not None:
            freed += self.adapters.reclaim(num_pages - freed, keep=kept)
        return freed >= num_pages

    def _eligible(self) -> list[Sequence]:
        eligible = []
        for seq in self.waiting:
            if seq.seq_id in self.loading:
                continue
            if seq.leader is not None and (seq.leader.in_prefill and not seq.leader.is_finished):
                continue
            if seq.adapter is not None and not self.adapters.ready(seq.adapter):
                continue
            eligible.append(seq)
        return eligible

    def _add_to_step(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        """Put seq in the step and charge its tenant for the tokens computed for the first time: a
        recompute after preemption (or a prefix hit) is not charged again."""
        out.seqs.append(seq)
        out.num_tokens[seq.seq_id] = n
        start = max(seq.num_computed_tokens, seq.num_charged_tokens)
        end = seq.num_computed_tokens + n
        if end > start:
            prompt = max(0, min(end, seq.num_prompt_tokens) - start)
            self.policy.on_served(seq, prompt_tokens=prompt, completion_tokens=end - start - prompt)
            seq.num_charged_tokens = end

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)

    def _preempt(self, seq: Sequence) -> None:
        self._leave_running(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def on_step_done(self, out: SchedulerOutput, accepted: dict[int, int] | None = None) -> None:
        """The model ran the step: its tokens are now in the KV cache. `accepted`: seq_id -> speculative
        tokens verified this step (about to be appended), whose KV is valid too; the rest are rolled back."""
        for seq in out.seqs:
            if seq.status == SequenceStatus.RUNNING:
                seq.num_computed_tokens += out.num_tokens[seq.seq_id]
                self.block_manager.commit(seq)  # the accepted tokens' blocks are committed next step
                if seq.seq_id in out.lookahead:
                    verified = (accepted or {}).get(seq.seq_id, 0)
                    seq.num_computed_tokens += verified
                    if seq.num_computed_tokens > seq.num_charged_tokens:  # served tokens, charged like any other
                        self.policy.on_served(seq, prompt_tokens=0,
                                              completion_tokens=seq.num_computed_tokens - seq.num_charged_tokens)
                        seq.num_charged_tokens = seq.num_computed_tokens
                    self.block_manager.trim(seq, seq.num_computed_tokens + 1)
                self.block_manager.free_outside_window(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is, freeing its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)  # a load of its blocks still finishes, into the prefix cache
        self.loaded.pop(seq.seq_id, None)
        self.load_failed.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
