import random

import pytest

from engine.block_manager import BlockManager
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


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    bm = BlockManager(num_blocks=rng.randint(8, 40), block_size=bs, enable_prefix_caching=rng.random() < 0.8)
    shadow = {}  # block id -> (adapter, tenant, tokens up to the block's end) it was computed for
    live, rid = [], 0
    prefixes = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            rid += 1
            prompt = rng.choice(prefixes)[: rng.randint(0, 12)] + [rng.randrange(5) for _ in range(rng.randint(1, 10))]
            seq = make_seq(rid, prompt, adapter=rng.choice([None, "x", "y"]), tenant=rng.choice("ab"))
            hits = bm.lookup_prefix(seq)
            for i, block_id in enumerate(hits):
                assert shadow[block_id] == (seq.adapter, seq.tenant, tuple(seq.token_ids[: (i + 1) * bs]))
            n = rng.randint(1, seq.num_tokens - len(hits) * bs)
            if bm.can_allocate(seq, n, hits):
                bm.allocate(seq, n, hits)
                live.append(seq)
        elif op < 0.75 and live:
            seq = rng.choice(live)
            n = rng.randint(0, seq.num_tokens - seq.num_computed_tokens)
            if n and bm.can_append(seq, n):
                bm.append_slots(seq, n)
                start = seq.num_computed_tokens
                seq.num_computed_tokens += n
                for i in range(start // bs, seq.num_computed_tokens // bs):
                    if bm.hashes[seq.block_table[i]] is None:
                        shadow[seq.block_table[i]] = (seq.adapter, seq.tenant, tuple(seq.token_ids[: (i + 1) * bs]))
                bm.commit(seq)
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
