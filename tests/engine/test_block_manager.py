import random

import pytest

from engine.block_manager import FREED, BlockManager
from tests.engine.sim import make_seq


def test_prefix_hits_need_same_tokens_adapter_and_tenant():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))
    first = make_seq(1, prompt, tenant="a", adapter="x")
    bm.allocate(first, 10, bm.lookup_prefix(first))
    first.num_computed_tokens = 10
    bm.commit(first)
    assert bm.lookup_prefix(make_seq(2, prompt, tenant="a", adapter="x")) == first.block_table[:2]
    assert bm.lookup_prefix(make_seq(3, prompt, tenant="b", adapter="x")) == []
    assert bm.lookup_prefix(make_seq(4, prompt, tenant="a", adapter="y")) == []
    assert bm.lookup_prefix(make_seq(5, prompt, tenant="a", adapter=None)) == []
    assert bm.lookup_prefix(make_seq(6, [0, 1, 2, 3, 9, 9, 9, 9, 9], tenant="a", adapter="x")) == first.block_table[:1]
    # a prompt equal to a cached prefix still leaves its last token to compute
    assert bm.lookup_prefix(make_seq(7, prompt[:8], tenant="a", adapter="x")) == first.block_table[:1]


def test_the_base_model_is_in_every_key():
    prompt = list(range(10))
    one, other = (BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, base=b) for b in ("m1", "m2"))
    assert one.keys(prompt, adapter="x", salt="a") != other.keys(prompt, adapter="x", salt="a")
    seq = make_seq(1, prompt, tenant="a", adapter="x")
    one.allocate(seq, 10, one.lookup_prefix(seq))
    seq.num_computed_tokens = 10
    one.commit(seq)
    assert set(one.cached) == set(one.keys(prompt, adapter="x", salt="a"))


def test_blocks_held_taken_and_installed_from_outside_a_sequence():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    evicted = []
    bm.on_evict = lambda block_id, key: evicted.append((block_id, key))
    keys = bm.keys([1, 2, 3, 4, 5, 6], adapter=None, salt="t")
    written = bm.take_blocks(3)  # a load writing them
    assert bm.num_free_blocks == 3
    bm.check_invariants([])
    bm.install(written, keys)
    assert [bm.cached[k] for k in keys] == written and bm.num_free_blocks == 6 and not bm.held
    assert bm.hold(keys[:1] + [b"missing"] + keys[1:]) == written[:1]  # the leading run only
    taken = bm.take_blocks(5)
    assert [b for b, _ in evicted] == [written[2], written[1]]  # held ones stay; the tail goes first
    bm.check_invariants([])
    assert list(bm.cached) == keys[:1]
    bm.release(written[:1])
    seq = make_seq(2, [1, 2, 3, 4, 5, 6, 7], tenant="t")
    assert bm.lookup_prefix(seq) == written[:1]  # the installed prefix is an ordinary hit
    bm.release(taken)
    bm.check_invariants([])


def test_free_keeps_hashed_blocks_reusable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq(1, [1, 2, 3, 4, 5])
    bm.allocate(a, 5, [])
    a.num_computed_tokens = 5
    bm.commit(a)
    bm.free(a)
    bm.check_invariants([])
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    assert len(bm.lookup_prefix(make_seq(2, [1, 2, 3, 4, 7]))) == 2
    # three fresh blocks: two plain free ones, then the LRU cached one (the prefix's tail block)
    c = make_seq(3, [9, 9, 9, 9, 9])
    bm.allocate(c, 5, [])
    bm.check_invariants([c])
    assert bm.num_free_blocks == 1 and bm.can_append(c, 8) and not bm.can_append(c, 9)
    b = make_seq(5, [1, 2, 3, 4, 7])
    hits = bm.lookup_prefix(b)
    assert len(hits) == 1 and not bm.can_allocate(b, 3, hits)
    bm.free(c)
    bm.allocate(b, 3, hits)
    assert b.num_computed_tokens == 2 and b.block_table[0] == hits[0]
    bm.check_invariants([b])


def test_blocks_before_every_window_are_given_back_and_shared_ones_kept():
    bm = BlockManager(num_blocks=12, block_size=2, enable_prefix_caching=True, window=4)
    prompt = list(range(11))
    a = make_seq(1, prompt)
    bm.allocate(a, 11, [])
    a.num_computed_tokens = 11
    bm.commit(a)
    b = make_seq(2, prompt[:9] + [50, 51])  # shares a's first four blocks; from token 8 on, sees tokens 5..8
    hits = bm.lookup_prefix(b)
    assert hits == [FREED, FREED, *a.block_table[2:4]]  # blocks 0-1: before its window, not taken
    bm.allocate(b, 3, hits)
    assert b.num_freed_blocks == 2 and b.num_computed_tokens == 8
    free_before = bm.num_free_blocks
    bm.free_outside_window(a)  # the next query (position 11) sees 8..11: blocks 0-3 (tokens 0-7) are past
    assert a.block_table[:4] == [FREED] * 4 and a.num_freed_blocks == 4 and FREED not in a.block_table[4:]
    assert bm.num_free_blocks == free_before + 2  # blocks 2-3: b still holds them
    bm.check_invariants([a, b])
    bm.free_outside_window(b)  # nothing more to give back yet
    assert b.num_freed_blocks == 2 and bm.num_free_blocks == free_before + 2
    assert len(bm.lookup_prefix(make_seq(3, prompt))) == 5  # given back, still cached for a prefix hit
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def test_a_windowed_prefix_hit_needs_only_the_blocks_its_window_reaches():
    bm = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=True, window=4)
    prompt = list(range(13))
    a = make_seq(1, prompt)
    bm.allocate(a, 13, [])
    a.num_computed_tokens = 13
    bm.commit(a)
    bm.free_outside_window(a)  # blocks 0-4 given back first, so they are the first evicted
    bm.free(a)
    bm.take_pages(6)  # three free pages, then the three least recently used cached blocks: 0, 1, 2
    b = make_seq(2, prompt)
    hits = bm.lookup_prefix(b)  # 12 tokens to reuse: the token at 12 sees 9..12, blocks 4 and 5
    assert hits[:4] == [FREED] * 4 and FREED not in hits[4:] and len(hits) == 6
    bm.allocate(b, 1, hits)
    assert b.num_computed_tokens == 12 and b.num_freed_blocks == 4
    bm.check_invariants([b])
    whole = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=True)  # no window: block 0 is needed
    whole.cached, whole.hashes = bm.cached, bm.hashes
    assert whole.lookup_prefix(make_seq(3, prompt)) == []
    bm.free(b)
    bm.check_invariants([])


def test_no_window_gives_nothing_back():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq(1, list(range(9)))
    bm.allocate(a, 9, [])
    a.num_computed_tokens = 9
    bm.free_outside_window(a)
    assert FREED not in a.block_table and a.num_freed_blocks == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    window = rng.choice([None, 1, 3, 8])
    bm = BlockManager(num_blocks=rng.randint(8, 40), block_size=bs, enable_prefix_caching=rng.random() < 0.8,
                      window=window)
    shadow = {}  # block id -> (adapter, tenant, tokens up to the block's end) it was computed for
    live, rid = [], 0
    chunks = {}  # seq_id -> the most tokens it was given slots for at once
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            rid += 1
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + [rng.randrange(5) for _ in range(rng.randint(1, 10))]
            seq = make_seq(rid, prompt, adapter=rng.choice([None, "x", "y"]), tenant=rng.choice("ab"))
            hits = bm.lookup_prefix(seq)
            for i, block_id in enumerate(hits):
                if block_id == FREED:  # before the window of the first token to compute
                    assert window is not None and i < bm._first_seen_block(len(hits) * bs)
                    continue
                assert shadow[block_id] == (seq.adapter, seq.tenant, tuple(seq.token_ids[: (i + 1) * bs]))
            n = rng.randint(1, seq.num_tokens - len(hits) * bs)
            if bm.can_allocate(seq, n, hits):
                bm.allocate(seq, n, hits)
                chunks[seq.seq_id] = n
                live.append(seq)
        elif op < 0.75 and live:
            seq = rng.choice(live)
            n = rng.randint(0, seq.num_tokens - seq.num_computed_tokens)
            if n and bm.can_append(seq, n):
                bm.append_slots(seq, n)
                chunks[seq.seq_id] = max(chunks.get(seq.seq_id, 0), n)
                if window is not None:  # what admission counts on, however long: the window's blocks and a chunk's
                    held = len(seq.block_table) - seq.num_freed_blocks
                    assert held <= bm.blocks_to_run(10**6, chunks[seq.seq_id])
                start = seq.num_computed_tokens
                seq.num_computed_tokens += n
                for i in range(start // bs, seq.num_computed_tokens // bs):
                    if bm.hashes[seq.block_table[i]] is None:
                        shadow[seq.block_table[i]] = (seq.adapter, seq.tenant, tuple(seq.token_ids[: (i + 1) * bs]))
                bm.commit(seq)
                bm.free_outside_window(seq)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(rng.randrange(5))
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks
