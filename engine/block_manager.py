"""Paged memory bookkeeping: block tables, reference counts, a free list and prefix caching.

Pages serve as KV blocks or as adapter pages (engine.paged_memory): both are taken from one free list
(`_take_block`, `take_pages`), so the KV cache and adapters share one budget.

A full block is identified by its key (engine/block_keys.py): a hash chain over the base model's digest,
the adapter's content digest (LoRA on k/v changes the cache), a salt (the tenant: a cache shared across
tenants would let one time-probe another's prompts), its tokens and the key of the block before it. A
freed block keeps its key and stays reusable until it is needed for something else; such blocks are
evicted least-recently-used, and `on_evict` hears of each one first (the host tier saves it).

Blocks may also be held from outside any sequence (`hold`, `take_blocks`, `release`): a transfer reading
them, a load writing them, a lease keeping them for another engine; `install` names freshly written
blocks by their keys, as cached prefix blocks.

With a sliding window on every layer (`window`), a running sequence gives back the blocks at the head of
its table that no later query can see; their entries become FREED (-1), which no attention reads.
No torch.
"""

from collections import Counter, OrderedDict, deque
from collections.abc import Callable

from engine.block_keys import chain, namespace
from engine.sequence import Sequence

FREED = -1  # a block-table entry whose block was given back: wholly outside every layer's window


def blocks_to_run(num_tokens: int, chunk: int, *, block_size: int, window: int | None) -> int:
    """The most blocks a sequence of num_tokens holds at once, steps computing up to `chunk` of its tokens:
    all of its blocks, or with a window at most those of the window and a chunk (the rest is given back)."""
    blocks = -(-num_tokens // block_size)
    return blocks if window is None else min(blocks, -(-(window - 1 + chunk) // block_size) + 1)


class BlockManager:
    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 window: int | None = None, base: str = "") -> None:
        """window: the widest sliding window when every layer has one (keys p - window < j <= p), else None;
        base: the base model's digest (engine.block_keys.base_digest), part of every key."""
        self.num_blocks = num_blocks
        self.base = base
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.free_ids: deque[int] = deque(range(num_blocks))  # no hash, ref 0
        self.evictable: OrderedDict[int, None] = OrderedDict()  # hashed, ref 0; oldest first
        self.adapter_pages: set[int] = set()  # pages holding adapter rows (ref 1 each)
        self.held: Counter[int] = Counter()  # block id -> references from outside any sequence
        self.on_evict: Callable[[int, bytes], None] | None = None  # (block id, key) before a cached block is reused
        self.num_lookups = 0
        self.num_hit_tokens = 0
        self.num_lookup_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_unused_pages(self) -> int:
        """Pages on the free list proper (not counting prefix-cached blocks that could be evicted)."""
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        """Pages holding KV (adapter pages not counted)."""
        return self.num_blocks - self.num_free_blocks - len(self.adapter_pages)

    def take_pages(self, count: int) -> list[int]:
        """Pages for adapter rows, from the same free list as KV blocks."""
        assert count <= self.num_free_blocks, "take_pages beyond the free pages"
        pages = [self._take_block() for _ in range(count)]
        self.adapter_pages.update(pages)
        return pages

    def give_pages(self, pages: list[int]) -> None:
        for page in pages:
            self.adapter_pages.remove(page)
            self.ref_counts[page] = 0
            self.free_ids.append(page)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_run(self, num_tokens: int, chunk: int) -> int:
        return blocks_to_run(num_tokens, chunk, block_size=self.block_size, window=self.window)

    def longest_fitting(self, max_model_len: int, chunk: int) -> int:
        """max_model_len, or the pool's tokens when one sequence that long would need more blocks than there are."""
        if self.blocks_to_run(max_model_len, chunk) > self.num_blocks:
            return min(max_model_len, self.num_blocks * self.block_size)
        return max_model_len

    def _update_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Extend seq.block_hashes over the full blocks among its first num_tokens tokens."""
        if len(seq.block_hashes) < num_tokens // self.block_size:
            seq.block_hashes = chain(self.namespace(seq.adapter, seq.cache_salt), seq.token_ids[:num_tokens],
                                     self.block_size, start=seq.block_hashes, marks=seq.content_marks)

    def namespace(self, adapter: str | None, salt: str) -> bytes:
        return namespace(self.base, adapter, salt)

    def keys(self, token_ids: list[int], *, adapter: str | None, salt: str,
             marks: tuple[tuple[int, int, str], ...] = ()) -> list[bytes]:
        """Keys of the full blocks of token_ids, as a sequence with this adapter, salt and content marks (its
        images: Sequence.content_marks) would have them."""
        return chain(self.namespace(adapter, salt), token_ids, self.block_size, marks=marks)

    def _caches(self, seq: Sequence) -> bool:
        # with prefix caching off, the completions of one request still share their prompt
        return self.enable_prefix_caching or seq.sampling.n > 1

    # prefix hit
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of seq; at least one token is always left to compute. With a
        window on every layer, only the blocks the first computed token's window reaches must be cached:
        the ones before it (evicted or not) come back as FREED."""
        assert seq.num_computed_tokens == 0 and not seq.block_table
        if not self._caches(seq) or seq.sampling.prompt_logprobs is not None:
            return []
        self._update_hashes(seq, seq.num_tokens - 1)
        cached = [self.cached.get(h) for h in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]]
        if self.window is None:
            return cached[: cached.index(None)] if None in cached else cached
        run = 0  # cached blocks in a row up to block i
        best = 0, 0  # (blocks hit, of which FREED at the head)
        for i, block_id in enumerate(cached):
            run = run + 1 if block_id is not None else 0
            first = self._first_seen_block((i + 1) * self.block_size)
            if run >= i + 1 - first:
                best = i + 1, first
        num_hits, first = best
        return [FREED] * first + cached[first:num_hits]

    def keys_after(self, seq: Sequence, num_hits: int) -> list[bytes]:
        """Keys of the blocks after seq's first num_hits (from lookup_prefix) that could still be prefix hits
        if they came from elsewhere (a host tier); none without prefix caching, with prompt log-probabilities
        (every position is computed) or with a window on every layer."""
        if self.window is not None or not self._caches(seq) or seq.sampling.prompt_logprobs is not None:
            return []
        self._update_hashes(seq, seq.num_tokens - 1)
        return seq.block_hashes[num_hits : (seq.num_tokens - 1) // self.block_size]

    def _first_seen_block(self, num_computed_tokens: int) -> int:
        """With a window: the first block the next query (at position num_computed_tokens) sees; it sees keys
        j > num_computed_tokens - window."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def shortfall(self, seq: Sequence, num_new_tokens: int, hits: list[int], extra_pages: int = 0) -> int:
        """Pages missing to admit seq with these hits (plus extra_pages for its adapter); 0: it fits."""
        num_cached = len(hits) * self.block_size
        new_blocks = self.blocks_needed(num_cached + num_new_tokens) - len(hits)
        revived = sum(1 for b in hits if b != FREED and self.ref_counts[b] == 0)
        return max(0, new_blocks + revived + extra_pages - self.num_free_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int], extra_pages: int = 0) -> bool:
        return self.shortfall(seq, num_new_tokens, hits, extra_pages) == 0

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int]) -> None:
        """First admission (or re-admission after preemption): take the hits, add fresh blocks."""
        assert self.can_allocate(seq, num_new_tokens, hits)
        freed = hits.count(FREED)  # at the head (lookup_prefix with a window)
        for block_id in hits[freed:]:
            self._ref(block_id)
        seq.block_table = list(hits)
        seq.num_freed_blocks = freed
        seq.num_computed_tokens = len(hits) * self.block_size
        self.num_lookups += 1
        self.num_hit_tokens += seq.num_computed_tokens
        self.num_lookup_tokens += seq.num_tokens
        self.append_slots(seq, num_new_tokens)

    def append_shortfall(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(0, needed - self.num_free_blocks)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.append_shortfall(seq, num_new_tokens) == 0

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert needed <= self.num_free_blocks, "append_slots without can_append"
        for _ in range(needed):
            seq.block_table.append(self._take_block())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks beyond the first num_tokens slots (lookahead slots of rejected
        speculative tokens). They were never committed, so they hold no hash and no one shares them."""
        keep = max(self.blocks_needed(num_tokens), self.blocks_needed(seq.num_computed_tokens))
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            assert self.ref_counts[block_id] == 1 and self.hashes[block_id] is None
            self.ref_counts[block_id] = 0
            self.free_ids.append(block_id)

    def _take_block(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(block_id, self.hashes[block_id])
            del self.cached[self.hashes[block_id]]
            self.hashes[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that computed tokens have filled, so later sequences can hit them."""
        if not self._caches(seq):
            return
        self._update_hashes(seq, seq.num_computed_tokens)
        for i in range(seq.num_freed_blocks, seq.num_computed_tokens // self.block_size):
            block_id = seq.block_table[i]
            if self.hashes[block_id] is not None:
                continue
            h = seq.block_hashes[i]
            if h in self.cached:  # computed twice concurrently: keep the first
                continue
            self.hashes[block_id] = h
            self.cached[h] = block_id

    def free(self, seq: Sequence) -> None:
        # tail blocks first, so they are evicted before the prefix that other prompts may share
        for block_id in reversed(seq.block_table[seq.num_freed_blocks :]):
            self._unref(block_id)
        seq.block_table = []
        seq.num_freed_blocks = 0
        seq.num_computed_tokens = 0

    def free_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks no later query of seq can see. Its next query sits at p >= num_computed_tokens
        and sees keys j > p - window, so block i (keys up to (i + 1) * bs - 1) goes once
        (i + 1) * bs <= num_computed_tokens - window + 1."""
        if self.window is None:
            return
        past = self._first_seen_block(seq.num_computed_tokens)  # blocks [0, past) are seen no more
        for i in range(seq.num_freed_blocks, min(past, len(seq.block_table))):
            self._unref(seq.block_table[i])
            seq.block_table[i] = FREED
        seq.num_freed_blocks = max(seq.num_freed_blocks, min(past, len(seq.block_table)))

    def _unref(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0
        if self.ref_counts[block_id] == 0:
            if self.hashes[block_id] is None:
                self.free_ids.append(block_id)
            else:
                self.evictable[block_id] = None

    # held from outside any sequence
    def hold(self, keys: list[bytes]) -> list[int]:
        """Hold the cached blocks of the leading run of keys (stopping at the first one not cached)."""
        block_ids = []
        for key in keys:
            block_id = self.cached.get(key)
            if block_id is None:
                break
            self._ref(block_id)
            self.held[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def take_blocks(self, count: int) -> list[int]:
        """Fresh blocks to write KV into (a load, an import), held until `install` or `release`."""
        assert count <= self.num_free_blocks, "take_blocks beyond the free pages"
        block_ids = [self._take_block() for _ in range(count)]
        self.held.update(block_ids)
        return block_ids

    def install(self, block_ids: list[int], keys: list[bytes]) -> None:
        """Name blocks from `take_blocks`, now written, by their keys and let them go: cached prefix blocks,
        evictable once no one holds them. A key cached meanwhile keeps its first block; the copy is freed."""
        for block_id, key in zip(block_ids, keys, strict=True):
            assert self.hashes[block_id] is None
            if key not in self.cached:
                self.hashes[block_id] = key
                self.cached[key] = block_id
        self.release(block_ids)

    def release(self, block_ids: list[int]) -> None:
        """Drop holds from `hold` or `take_blocks`; the last block first, so a prefix outlives its tail."""
        for block_id in reversed(block_ids):
            assert self.held[block_id] > 0, f"block {block_id} released but not held"
            self.held[block_id] -= 1
            if not self.held[block_id]:
                del self.held[block_id]
            self._unref(block_id)

    def _ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0

    def check_invariants(self, seqs: list[Sequence]) -> None:
        owners = [1 if block_id in self.adapter_pages else 0 for block_id in range(self.num_blocks)]
        for seq in seqs:
            head, held = seq.block_table[: seq.num_freed_blocks], seq.block_table[seq.num_freed_blocks :]
            assert all(b == FREED for b in head) and FREED not in held, f"{seq} has FREED entries past its head"
            assert len(set(held)) == len(held), f"{seq} holds a block twice"
            assert len(seq.block_table) >= self.blocks_needed(seq.num_computed_tokens)
            if seq.num_freed_blocks:  # never a block some query still sees
                assert seq.num_freed_blocks <= self._first_seen_block(seq.num_computed_tokens)
            for block_id in held:
                owners[block_id] += 1
        for block_id, count in self.held.items():
            owners[block_id] += count
        assert owners == self.ref_counts, "ref counts differ from the block tables"
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids)
        assert not free & set(self.evictable)
        for block_id in range(self.num_blocks):
            in_use = self.ref_counts[block_id] > 0
            assert in_use + (block_id in free) + (block_id in self.evictable) == 1, f"block {block_id} leaked"
            if block_id in free:
                assert self.hashes[block_id] is None
            if block_id in self.evictable:
                assert self.hashes[block_id] is not None
        assert {b: h for h, b in self.cached.items()} == {
            b: h for b, h in enumerate(self.hashes) if h is not None
        }
