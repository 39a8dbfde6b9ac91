"""The lease table over a real BlockManager (engine/kv/lease.py): leased blocks survive eviction pressure, every way
a lease ends gives its blocks back to the prefix cache as evictable, and the pool's own counts and invariants show
no block leaked."""

import pytest

from engine.block_keys import chain, namespace
from engine.block_manager import BlockManager
from engine.kv.lease import LeaseTable
from engine.kv.transport import LeaseRefused

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def cached_prompt(bm: BlockManager, tokens: list[int], *, tenant: str = "t") -> list[bytes]:
    """Put the prompt's full blocks in the prefix cache (as an import would) and return their keys."""
    keys = chain(namespace("base", None, tenant), tokens, BLOCK)
    block_ids = bm.take_blocks(len(keys))
    bm.install(block_ids, keys)
    return keys


def assert_clean(bm: BlockManager) -> None:
    """No reference left: every page free or evictable, and the manager's own invariants hold."""
    bm.check_invariants([])
    assert not bm.held and sum(bm.ref_counts) == 0
    assert len(bm.free_ids) + len(bm.evictable) == bm.num_blocks


@pytest.fixture
def setup():
    bm = BlockManager(num_blocks=12, block_size=BLOCK, enable_prefix_caching=True)
    clock = Clock()
    return bm, LeaseTable(bm, clock=clock), clock


def test_leased_blocks_survive_eviction_pressure_and_return_as_evictable(setup):
    bm, table, _ = setup
    keys = cached_prompt(bm, list(range(10, 30)))  # 5 full blocks
    lease = table.grant(keys + [b"\x00" * 16], ttl_s=30)  # a key not cached: the lease holds the 5 before it
    assert lease.keys == keys and len(lease.block_ids) == 5 and lease.num_tokens == 20
    assert table.state()["held_blocks"] == 5 and bm.num_used_blocks == 5
    pressure = bm.take_blocks(bm.num_free_blocks)  # everything else taken: the leased blocks are not among them
    assert not set(pressure) & set(lease.block_ids)
    assert all(bm.cached[k] == b for k, b in zip(keys, lease.block_ids, strict=True))
    bm.release(pressure)
    assert table.release(lease.id, "done")
    assert not table.release(lease.id, "done")  # once
    assert all(b in bm.evictable for b in lease.block_ids)  # back in the prefix cache, evictable
    assert bm.hold(keys) == lease.block_ids  # and still hit
    bm.release(lease.block_ids)
    assert table.state() == {"active": 0, "held_blocks": 0, "granted": 1, "released": {"done": 1}, "blocks_sent": 0}
    assert_clean(bm)


def test_take_once_a_prefix_of_the_asked_keys(setup):
    bm, table, _ = setup
    keys = cached_prompt(bm, list(range(40, 56)))  # 4 blocks
    lease = table.grant(keys[:3], ttl_s=30)
    assert table.take(lease.id, keys[1:]) == keys[1:3]  # asked from the second: the lease holds two of them
    with pytest.raises(LeaseRefused) as pulled:
        table.take(lease.id, keys)
    assert pulled.value.code == "pulled"
    with pytest.raises(LeaseRefused) as unknown:
        table.take("f" * 32, keys)
    assert unknown.value.code == "unknown_lease"
    other = table.grant(keys, ttl_s=30)
    assert table.take(other.id, [b"\x01" * 16] + keys) == []  # a key it does not hold first: nothing
    table.release(lease.id, "done")
    table.release(other.id, "released")
    assert table.state()["blocks_sent"] == 2
    assert_clean(bm)


def test_expiry_drain_and_the_cap_release_everything(setup):
    bm, table, clock = setup
    keys = cached_prompt(bm, list(range(60, 72)))
    short, long = table.grant(keys, ttl_s=5), table.grant(keys[:1], ttl_s=50)
    assert bm.ref_counts[short.block_ids[0]] == 2  # both hold the first block
    clock.now += 5
    with pytest.raises(LeaseRefused) as expired:
        table.take(short.id, keys)
    assert expired.value.code == "expired" and short.id not in table.leases
    assert table.expire() == []
    clock.now += 50
    assert table.expire() == [long.id]
    capped = LeaseTable(bm, clock=clock, max_leases=2)
    first = capped.grant(keys, ttl_s=10)
    capped.grant(keys, ttl_s=20)
    capped.grant(keys, ttl_s=30)  # the cap: the one closest to expiry goes
    assert first.id not in capped.leases and len(capped.leases) == 2
    assert capped.release_all() == 2
    assert capped.state()["released"] == {"evicted": 1, "drain": 2}
    assert table.state()["released"] == {"expired": 2}
    assert_clean(bm)
    with pytest.raises(ValueError):
        table.grant(keys, ttl_s=0)


def test_a_lease_of_nothing_cached_holds_nothing(setup):
    bm, table, _ = setup
    lease = table.grant(chain(namespace("base", None, "t"), list(range(8)), BLOCK), ttl_s=30)
    assert lease.block_ids == [] and lease.num_tokens == 0
    assert table.take(lease.id, lease.keys) == []
    assert table.release(lease.id, "done")
    assert_clean(bm)


def test_leases_never_hold_more_than_their_share_of_the_pool(setup):
    bm, _, clock = setup
    table = LeaseTable(bm, clock=clock, max_held_fraction=0.5)  # 6 of 12 pages
    first = cached_prompt(bm, list(range(100, 116)))  # 4 blocks
    second = cached_prompt(bm, list(range(200, 212)))  # 3 blocks
    old = table.grant(first, ttl_s=10)
    new = table.grant(second, ttl_s=20)  # 4 + 3 > 6: the lease closest to expiry ends
    assert old.id not in table.leases and table.state()["held_blocks"] == 3
    huge = cached_prompt(bm, list(range(300, 320)))  # 5 blocks, and 3 held: the other lease goes too
    assert len(table.grant(huge, ttl_s=30).block_ids) == 5 and new.id not in table.leases
    bm.release(bm.take_blocks(bm.num_free_blocks))  # (evicts the unheld cached blocks)
    capped = LeaseTable(bm, clock=clock, max_held_fraction=0.25)  # 3 pages: a lease of what fits
    assert table.release_all() == 1
    huge = cached_prompt(bm, list(range(300, 320)))
    lease = capped.grant(huge, ttl_s=30)
    assert lease.keys == huge[:3] and lease.num_tokens == 3 * BLOCK and capped.state()["held_blocks"] == 3
    assert table.state()["released"] == {"evicted": 2, "drain": 1}
    capped.release_all()
    assert_clean(bm)


def test_a_prefill_hops_abort_ends_its_unpulled_lease(setup):
    bm, table, _ = setup
    keys = cached_prompt(bm, list(range(10, 22)))
    lease = table.grant(keys, ttl_s=30, request_id="r-1")
    assert not table.release_request("r-other")
    assert table.release_request("r-1") and lease.id not in table.leases
    assert not table.release_request("r-1")
    pulled = table.grant(keys, ttl_s=30, request_id="r-2")
    table.take(pulled.id, keys)  # being pulled: the puller ends it, not an abort
    assert not table.release_request("r-2")
    assert table.release(pulled.id, "done")
    assert table.state()["released"] == {"released": 1, "done": 1}
    assert_clean(bm)


def test_an_unpulled_lease_gives_its_blocks_to_a_request_that_needs_them(checkpoints):
    """A 20-page pool, half of it leased to a puller that has not come: a request needing more than the free half
    waited for the lease's TTL (20 s and more). Admission now ends the leases closest to expiry for the pages it
    needs (reason "needed"), and the request runs at once, its tokens those of transformers."""
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.engine.conftest import Oracle, random_prompts

    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=20,
                                    pool_adapter_bytes=0))
    assert engine.block_manager.num_blocks == 20
    leased_prompt, big_prompt = random_prompts(61, [41, 50])
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    engine.add_request("prefill-hop", leased_prompt, SamplingParams(temperature=0.0, max_tokens=1), tenant="t")
    while engine.has_unfinished():
        engine.step()
    lease = engine.leases.grant(engine.kv_keys(leased_prompt, adapter=None, tenant="t"), ttl_s=600.0)
    assert len(lease.block_ids) == 10  # half the pool: the most leases may hold
    engine.add_request("big", big_prompt, greedy, tenant="u")  # 55 tokens: 14 pages, 10 free
    outputs = {}
    for _ in range(30):  # a handful of steps; the lease's TTL never passes here (nothing expires it)
        outputs |= {out.request_id: out for out in engine.step() if out.finished}
        if not engine.has_unfinished():
            break
    assert "big" in outputs, "the request waited behind an unpulled lease"
    assert outputs["big"].token_ids == Oracle(checkpoints["llama"], {}).greedy(big_prompt, None, 5)
    assert lease.id not in engine.leases.leases
    assert engine.leases.state()["released"] == {"needed": 1}
    engine.block_manager.check_invariants([])
