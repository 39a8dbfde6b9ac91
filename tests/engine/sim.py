"""A stand-in for the model in scheduler tests: each step 'computes' the scheduled tokens and
samples a deterministic next token for every sequence whose tokens are all computed."""

import random
from collections import OrderedDict

from engine.block_manager import BlockManager
from engine.kv.connector import Load
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


def make_seq(request_id, prompt, *, max_tokens=4, adapter=None, tenant="t", weight=1.0, n=1, index=0, leader=None):
    return Sequence(
        request_id=str(request_id),
        index=index,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, n=n),
        adapter=adapter,
        tenant=tenant,
        weight=weight,
        cache_salt=tenant,
        arrival_time=0.0,
        leader=leader,
    )


class PageAdapters:
    """The scheduler's side of the adapter pool, without weights: an adapter in host memory (`ready_set`, None:
    every one) is given `pages` pages of the block manager by `place`; its copy takes `copy_steps` steps
    (`tick`, once per step), then it is resident. Resident adapters no running sequence uses are reclaimed LRU,
    except those the caller keeps."""

    def __init__(self, bm: BlockManager, *, pages: int = 2, ready: set[str] | None = None, copy_steps: int = 1) -> None:
        self.bm, self.pages, self.ready_set, self.copy_steps = bm, pages, ready, copy_steps
        self.resident: dict[str, list[int]] = {}
        self.placing: dict[str, tuple[list[int], int]] = {}  # digest -> (pages, steps left)
        self.users: dict[str, int] = {}
        self.idle: list[str] = []  # LRU first
        self.evictions = 0
        self.evicted: list[str] = []

    def tick(self) -> None:
        for digest, (pages, left) in list(self.placing.items()):
            if left > 1:
                self.placing[digest] = (pages, left - 1)
            else:
                del self.placing[digest]
                self.resident[digest] = pages
                self.idle.append(digest)

    def ready(self, digest: str) -> bool:
        return digest in self.resident

    def pages_to_place(self, digest: str) -> int | None:
        in_host = self.ready_set is None or digest in self.ready_set
        return self.pages if in_host and digest not in self.resident and digest not in self.placing else None

    def place(self, digest: str) -> None:
        self.placing[digest] = (self.bm.take_pages(self.pages), self.copy_steps)

    def acquire(self, digest: str) -> None:
        assert digest in self.resident, "acquired before its copy was done"
        if digest in self.idle:
            self.idle.remove(digest)
        self.users[digest] = self.users.get(digest, 0) + 1

    def release(self, digest: str) -> None:
        self.users[digest] -= 1
        if not self.users[digest]:
            self.idle.append(digest)

    def reclaim(self, num_pages: int, *, keep=()) -> int:
        freed = 0
        for digest in list(self.idle):
            if freed >= num_pages:
                break
            if digest not in keep:
                self.idle.remove(digest)
                pages = self.resident.pop(digest)
                self.bm.give_pages(pages)
                freed += len(pages)
                self.evictions += 1
                self.evicted.append(digest)
        return freed

    def drop_all(self) -> None:
        """Finish the copies under way and evict every unpinned adapter (end of a test)."""
        while self.placing:
            self.tick()
        self.reclaim(self.bm.num_blocks)


class KeyStore:
    """The scheduler's side of a host tier, without bytes: a bounded LRU of block keys, saved as the block manager
    evicts them; a load finishes a random number of schedule() calls after it starts, and sometimes fails."""

    def __init__(self, bm: BlockManager, *, capacity: int, rng: random.Random, fail_rate: float = 0.1) -> None:
        self.bm, self.capacity, self.rng, self.fail_rate = bm, capacity, rng, fail_rate
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.in_flight: list[tuple[Load, int]] = []  # (load, schedule calls left)
        self.loaded = 0
        bm.on_evict = self.save

    def lookup(self, keys: list[bytes]) -> int:
        count = 0
        while count < len(keys) and keys[count] in self.keys:
            count += 1
        return count

    def save(self, block_id: int, key: bytes) -> None:
        assert self.bm.hashes[block_id] == key and self.bm.ref_counts[block_id] == 0
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def start_load(self, load: Load) -> None:
        assert all(key in self.keys for key in load.keys) and len(load.keys) == len(load.block_ids)
        assert all(self.bm.held[b] == 1 and self.bm.hashes[b] is None for b in load.block_ids)
        self.in_flight.append((load, self.rng.randint(0, 3)))

    def finished_loads(self) -> list[Load]:
        done, still = [], []
        for load, left in self.in_flight:
            if left:
                still.append((load, left - 1))
            else:
                load.ok = self.rng.random() >= self.fail_rate
                self.loaded += len(load.keys) if load.ok else 0
                done.append(load)
        self.in_flight = still
        return done


def step(sched: Scheduler) -> SchedulerOutput:
    if sched.adapters is not None:
        sched.adapters.tick()
    out = sched.schedule()
    check_step(sched, out)
    sched.on_step_done(out)
    for seq in out.seqs:
        if seq.is_finished or seq.num_computed_tokens < seq.num_tokens:
            continue
        seq.append_token((seq.num_tokens * 7 + seq.index) % 50)
        if seq.num_completion_tokens >= seq.sampling.max_tokens:
            sched.finish(seq, "length")
    sched.block_manager.check_invariants(sched.running)
    return out


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    assert out.total_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    if sched.adapters is not None:  # every running sequence's adapter is resident and pinned
        assert all(sched.adapters.users.get(s.adapter) for s in sched.running if s.adapter is not None)
    assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
    for seq in out.seqs:
        assert seq in sched.running
        n = out.num_tokens[seq.seq_id]
        assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
        assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_computed_tokens + n


def new_scheduler(*, num_blocks=64, block_size=4, budget=32, max_seqs=8, caching=True, adapter_pages=2,
                  ready=None, host_blocks=0, rng=None, copy_steps=1, **kw):
    """host_blocks: a KeyStore of that many keys as the scheduler's connector (random load delays from rng)."""
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching)
    adapters = PageAdapters(bm, pages=adapter_pages, ready=ready, copy_steps=copy_steps)
    connector = KeyStore(bm, capacity=host_blocks, rng=rng or random.Random(0)) if host_blocks else None
    return Scheduler(block_manager=bm, max_num_batched_tokens=budget, max_num_seqs=max_seqs, adapters=adapters,
                     connector=connector, **kw)
