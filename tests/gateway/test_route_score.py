"""The routing score on plain data: the adapter's expected load time on each engine against its queue, the order of
the fixed affinity tiers, the spill past the load bound, prefix locality scoped to tenant and adapter, and that a
cold adapter has one favourite for every process."""

import subprocess
import sys

from engine.contract import PREFIX_CHUNK_CHARS, prompt_fingerprints
from engine.contract.state import LoadSeconds
from gateway.route_score import (
    COST,
    FIXED,
    Candidate,
    Fleet,
    Loads,
    Weights,
    candidate_from_state,
    choose,
    choose_route,
)
from tests.conftest import REPO
from tests.engine_states import adapters, engine_state

HOT = "a" * 64
COLD = "c" * 64


def names(fleet, index):
    return fleet.names[index]


def test_fixed_affinity_tiers_resident_then_loading_then_free_memory_then_none():
    fleet = Fleet([
        Candidate("none", capacity=8, adapter_free=0.0),
        Candidate("free", capacity=8, adapter_free=0.9),
        Candidate("loading", capacity=8, adapter_free=0.0, loading=frozenset({HOT})),
        Candidate("resident", capacity=8, adapter_free=0.0, resident=frozenset({HOT})),
    ], weights=FIXED)  # fmt: skip
    loads = [0, 0, 0, 0]
    order = []
    excluded: list[int] = []
    for _ in range(4):
        index = choose(fleet, adapter=HOT, fingerprints=[], loads=loads, exclude=excluded)
        order.append(fleet.names[index])
        excluded.append(index)
    assert order == ["resident", "loading", "free", "none"]
    assert choose(fleet, adapter=HOT, fingerprints=[], loads=loads, exclude=range(4)) is None
    assert choose(Fleet([]), adapter=HOT, fingerprints=[], loads=[]) is None


# Measured load times, as heartbeats carry them: an 84 MB adapter read from disk in 0.4 s, copied to the device in
# 0.03 s; a request holds one of 8 slots for 2 s, so one request ahead in the queue costs 2 / 8 = 0.25 s of TTFT.
MEASURED = {"capacity": 8, "load_seconds": (0.4, 0.03), "request_seconds": 2.0}


def test_cost_orders_the_tiers_device_host_loading_disk_when_queues_are_equal():
    fleet = Fleet([
        Candidate("absent", adapter_free=1.0, **MEASURED),
        Candidate("loading", loading=frozenset({HOT}), **MEASURED),
        Candidate("host", host=frozenset({HOT}), **MEASURED),
        Candidate("device", resident=frozenset({HOT}), **MEASURED),
    ], weights=COST)  # fmt: skip
    order, excluded = [], []
    for _ in range(4):
        index = choose(fleet, adapter=HOT, fingerprints=[], loads=[2, 2, 2, 2], exclude=excluded)
        order.append(fleet.names[index])
        excluded.append(index)
    assert order == ["device", "host", "loading", "absent"]


def test_cost_prefers_a_host_tier_engine_over_a_disk_tier_one_at_equal_queues():
    for digest in (f"{n:064x}" for n in range(50)):  # whatever the rendezvous term says for the adapter
        fleet = Fleet([Candidate("disk", adapter_free=1.0, **MEASURED), Candidate("host", host=frozenset({digest}),
                                                                                  adapter_free=0.0, **MEASURED)],
                      weights=COST)
        assert fleet.names[choose(fleet, adapter=digest, fingerprints=[], loads=[3, 3])] == "host"


def test_cost_sends_an_adapter_to_a_light_engine_without_it_when_its_load_is_shorter_than_the_queue_difference():
    unbounded = Weights(bounded=False)  # the cost alone, without the spill past the load bound
    fleet = Fleet([Candidate("heavy", resident=frozenset({HOT}), **MEASURED), Candidate("light", **MEASURED)],
                  weights=unbounded)
    # 4 requests more ahead on "heavy": 4 × 0.25 s = 1 s of queue, against 0.43 s to load it on "light" from disk
    # (plus at most HASH, 0.5 s here, that an engine holding the adapter scores in place of its rendezvous term)
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[5, 1])] == "light"
    # 1 more ahead (0.25 s) is less than the load (0.43 s): it stays where it is resident
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[2, 1])] == "heavy"
    # a slower disk (2 s a read) outweighs the 1 s of queue
    slow = {**MEASURED, "load_seconds": (2.0, 0.03)}
    fleet = Fleet([Candidate("heavy", resident=frozenset({HOT}), **slow), Candidate("light", **slow)],
                  weights=unbounded)
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[5, 1])] == "heavy"
    # the fixed bonus (RESIDENT 4 against 2 × 4 / 8 = 1 of load) keeps it on "heavy" whatever the load time
    fixed = Fleet(fleet.candidates, weights=Weights(cost=False, bounded=False))
    assert fixed.names[choose(fixed, adapter=HOT, fingerprints=[], loads=[5, 1])] == "heavy"
    fast = Fleet([Candidate("heavy", resident=frozenset({HOT}), **MEASURED), Candidate("light", **MEASURED)],
                 weights=Weights(cost=False, bounded=False))
    assert fast.names[choose(fast, adapter=HOT, fingerprints=[], loads=[5, 1])] == "heavy"


def test_cold_adapters_do_not_herd_onto_the_engine_whose_pool_looked_emptiest():
    """Every gateway process scores on the same heartbeat, seconds old. An 84 MB adapter's load (0.1 s here) is worth
    a whole engine's queue (128 requests of 0.1 s on 128 slots); were it weighed more on an engine whose page pool
    is full (it evicts first), every cold adapter of every process would go to the one engine with free pages until
    the next heartbeat (benchmarks/fleet_sim.py: TTFT p99 1.8x fixed weights', busiest/mean load 7.8). The load costs
    the same everywhere: the rendezvous term spreads cold adapters, the queue decides."""
    slow = {"capacity": 128, "load_seconds": (0.1, 0.004), "request_seconds": 0.1}
    fleet = Fleet([Candidate("empty", adapter_free=1.0, **slow),
                   *(Candidate(f"full-{i}", adapter_free=0.0, **slow) for i in range(9))], weights=COST)
    picks = [choose(fleet, adapter=f"{n:064x}", fingerprints=[], loads=[0] * 10) for n in range(500)]
    assert picks.count(0) < 2 * 500 / 10, picks.count(0)  # about a tenth each, as on equal engines
    assert len(set(picks)) == 10


def test_a_hot_adapter_spills_when_its_engine_runs_ahead_of_the_bound():
    fleet = Fleet([Candidate(f"e{i}", capacity=64, resident=frozenset({HOT}) if i == 0 else frozenset())
                   for i in range(4)])  # fmt: skip
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[2, 2, 2, 2])] == "e0"  # within the bound
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[0, 0, 0, 0])] == "e0"
    # mean with this request 1.5, cap max(1.1 × 1.5, 1.5 + 0.25) = 1.75, less half a request: e0 at 2 is past it
    # (and is not among the least loaded), so it loses its affinity
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[2, 1, 1, 1])] != "e0"
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[10, 0, 0, 0])] != "e0"
    only_affinity = Fleet(fleet.candidates, weights=Weights(cost=False, bounded=False))
    assert only_affinity.names[choose(only_affinity, adapter=HOT, fingerprints=[], loads=[10, 0, 0, 0])] == "e0"
    # without the bound, the cost alone: 30 requests ahead on 64 slots of 2 s (0.94 s) outweigh a 0.22 s load and
    # the rendezvous term's most (HASH, 0.5 s here: one second scores LOAD / 2 s = 1); 6 requests (0.19 s) do not
    only_cost = Fleet(fleet.candidates, weights=Weights(bounded=False))
    assert only_cost.names[choose(only_cost, adapter=HOT, fingerprints=[], loads=[30, 0, 0, 0])] != "e0"
    assert only_cost.names[choose(only_cost, adapter=HOT, fingerprints=[], loads=[6, 0, 0, 0])] == "e0"


def test_least_load_without_affinity():
    fleet = Fleet([Candidate(f"e{i}", capacity=8, resident=frozenset({HOT})) for i in range(3)],
                  weights=Weights(affinity=False))
    assert fleet.names[choose(fleet, adapter=HOT, fingerprints=[], loads=[3, 1, 2])] == "e1"


def test_prefix_locality_is_scoped_to_tenant_and_adapter():
    system = "You are a helpful assistant. " * 40  # several whole chunks
    assert len(system) > 3 * PREFIX_CHUNK_CHARS
    mine = prompt_fingerprints(tenant="1", adapter=None, messages=[{"role": "system", "content": system},
                                                                    {"role": "user", "content": "hi"}])
    again = prompt_fingerprints(tenant="1", adapter=None, messages=[{"role": "system", "content": system},
                                                                     {"role": "user", "content": "other question"}])
    theirs = prompt_fingerprints(tenant="2", adapter=None, messages=[{"role": "system", "content": system}])
    other_adapter = prompt_fingerprints(tenant="1", adapter=HOT, messages=[{"role": "system", "content": system}])
    assert len(mine) >= 3 and mine[:3] == again[:3]
    assert not set(mine) & set(theirs) and not set(mine) & set(other_adapter)
    assert prompt_fingerprints(tenant="1", adapter=None, prompt="short") == []

    fleet = Fleet([Candidate("cold", capacity=8), Candidate("warm", capacity=8, prefixes=frozenset(mine[:3]))])
    assert fleet.names[choose(fleet, adapter=None, fingerprints=again, loads=[0.2, 0.4])] == "warm"
    assert fleet.names[choose(fleet, adapter=None, fingerprints=theirs, loads=[0.2, 0.4])] == "cold"


def test_loads_scale_this_process_share_by_the_fleet_ratio():
    # the heartbeats say 8 and 4 running; this process had sent 2 and 1 of them: it sees a quarter of the traffic
    loads = Loads(reported=[8, 4, 0], in_flight=[2, 1, 0])
    assert loads.ratio == 4.0 and loads.values == [8.0, 4.0, 0.0]
    loads.started(2)
    assert loads.values[2] == 4.0  # one more from here stands for four from the whole fleet
    loads.ended(0)
    loads.ended(0)
    assert loads.values[0] == 0.0
    fresh = Loads(reported=[3, 0], in_flight=[0, 0])  # nothing in flight from here: the heartbeats, plus what it sends
    fresh.started(1)
    assert fresh.values == [3, 1]


def test_kv_usage_and_queue_break_ties():
    fleet = Fleet([Candidate("full", capacity=8, kv_usage=0.95), Candidate("empty", capacity=8, kv_usage=0.1)])
    assert fleet.names[choose(fleet, adapter=None, fingerprints=[], loads=[1, 1])] == "empty"
    assert fleet.names[choose(fleet, adapter=None, fingerprints=[], loads=[0, 6])] == "full"


def test_served_counts_until_the_next_heartbeat():
    fleet = Fleet([Candidate(f"e{i}", capacity=8, adapter_free=0.0) for i in range(5)])
    first = choose(fleet, adapter=COLD, fingerprints=[], loads=[0] * 5)
    fleet.served(first, adapter=COLD, fingerprints=[])
    assert choose(fleet, adapter=COLD, fingerprints=[], loads=[1] * 5) == first  # loading there beats the others


def test_cold_adapters_spread_and_every_process_agrees():
    fleet = Fleet([Candidate(f"engine-{i}", capacity=8) for i in range(10)])
    digests = [f"{n:064x}" for n in range(2000)]
    picks = [choose(fleet, adapter=d, fingerprints=[], loads=[0] * 10) for d in digests]
    counts = [picks.count(i) for i in range(10)]
    assert min(counts) > 120 and max(counts) < 300, counts  # about 200 each
    script = ("import sys; sys.path.insert(0, 'platform'); from gateway.route_score import *; "
              "f = Fleet([Candidate(f'engine-{i}', capacity=8) for i in range(10)]); "
              "print([choose(f, adapter=f'{n:064x}', fingerprints=[], loads=[0]*10) for n in range(50)])")
    other = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert other.stdout.strip() == str(picks[:50])  # no Django, no database, no per-process hash salt


def test_candidate_from_an_engines_state():
    beat = candidate_from_state("b", engine_state(
        running=2, waiting=1, capacity=16, kv_blocks_used=32, kv_blocks_free=16, kv_blocks_total=64,
        adapters=adapters(gpu=[HOT], host=[COLD], load_seconds=LoadSeconds(disk_host=0.4, host_device=0.03)),
        request_seconds=1.5, prefixes=["ab12ab12ab12ab12"]))  # fmt: skip
    assert (beat.load, beat.capacity, beat.kv_usage, beat.adapter_free) == (3, 16, 0.5, 0.25)
    assert beat.resident == {HOT} and beat.host == {COLD} and not beat.loading and beat.prefixes == {"ab12ab12ab12ab12"}
    assert beat.load_seconds == (0.4, 0.03) and beat.request_seconds == 1.5
    fresh = candidate_from_state("s", engine_state(kv_blocks_total=0))
    assert fresh.kv_usage == 0.0 and fresh.adapter_free == 1.0
    assert fresh.load_seconds == (None, None) and fresh.request_seconds is None  # Weights' defaults stand in


def test_an_engine_with_no_measured_or_non_finite_times_is_still_routed_on_the_default_cost_score():
    """The gateway's default is the cost score. An engine that has timed nothing yet (just started), or whose
    heartbeat carries a time that is not a finite positive number, is weighed with Weights' defaults: it is never
    scored out of routing, alone or beside one that holds the adapter."""
    assert Fleet([]).weights == COST
    measured = engine_state(capacity=8, adapters=adapters(gpu=[HOT], load_seconds=LoadSeconds(0.4, 0.03)),
                            request_seconds=2.0)  # fmt: skip
    for odd in (LoadSeconds(), LoadSeconds(float("inf"), float("nan")), LoadSeconds(0.0, -1.0)):
        fresh = engine_state(capacity=8, adapters=adapters(load_seconds=odd), request_seconds=float("inf"))
        fleet = Fleet([candidate_from_state("old", measured), candidate_from_state("fresh", fresh)])
        assert fleet.candidates[1].load_seconds == (None, None) and fleet.candidates[1].request_seconds is None
        for adapter in (HOT, COLD, None):
            assert fleet.names[choose(fleet, adapter=adapter, fingerprints=[], loads=[3, 0], exclude=[0])] == "fresh"
            assert fleet.names[choose(fleet, adapter=adapter, fingerprints=[], loads=[0, 30])] == "old"
        assert choose(Fleet([fleet.candidates[1]]), adapter=HOT, fingerprints=[], loads=[0]) == 0


# Disaggregated prefill/decode: the same scoring picks the serving (decode) engine, then the prefill engine.
LONG = 2000 * 4  # characters: about 2,000 tokens at route_score.CHARS_PER_TOKEN
ROUTE = {"adapter": HOT, "loads": [0, 0, 0], "min_uncached_tokens": 256}


def roles(*pairs):
    return Fleet([Candidate(name, capacity=8, role=role) for name, role in pairs])


def test_a_long_uncached_prompt_gets_a_prefill_hop_on_a_fleet_with_roles():
    fleet = roles(("both", "both"), ("decode", "decode"), ("prefill", "prefill"))
    route = choose_route(fleet, fingerprints=[], prompt_chars=LONG, **ROUTE)
    assert fleet.names[route.serving] != "prefill" and fleet.names[route.prefill] == "prefill"
    assert route.reason == "disaggregated" and route.uncached_tokens == 2000
    # a token-id prompt counts its tokens
    assert choose_route(fleet, fingerprints=[], prompt_tokens=300, **ROUTE).reason == "disaggregated"


def test_a_short_or_cached_prompt_skips_the_prefill_hop():
    fleet = roles(("decode", "decode"), ("prefill", "prefill"))
    loads = {"loads": [0, 0]}
    short = choose_route(fleet, fingerprints=[], prompt_chars=255 * 4, **ROUTE | loads)
    assert (fleet.names[short.serving], short.prefill, short.reason) == ("decode", None, "short")
    # the same long prompt, once the decode engine's summary holds all but its last 200 characters
    system = "x" * (16 * PREFIX_CHUNK_CHARS)
    fingerprints = prompt_fingerprints(tenant="1", adapter=HOT, prompt=system + "y" * 200)
    fleet.served(0, adapter=HOT, fingerprints=fingerprints)
    cached = choose_route(fleet, fingerprints=fingerprints, prompt_chars=len(system) + 200, **ROUTE | loads)
    assert (cached.prefill, cached.reason, cached.uncached_tokens) == (None, "short", 50)
    # a prefill engine that holds the prefix does not make the decode engine's copy: the decode engine's counts
    other = roles(("decode", "decode"), ("prefill", "prefill"))
    other.served(1, adapter=HOT, fingerprints=fingerprints)
    assert choose_route(other, fingerprints=fingerprints, prompt_chars=len(system) + 200,
                        **ROUTE | loads).reason == "disaggregated"


def test_a_fleet_without_roles_never_splits_and_prefill_engines_serve_whole_only_as_a_last_resort():
    plain = roles(("a", "both"), ("b", "both"))
    route = choose_route(plain, fingerprints=[], prompt_chars=LONG, **ROUTE | {"loads": [0, 0]})
    assert (route.prefill, route.reason) == (None, "colocated")
    fleet = roles(("decode", "decode"), ("prefill", "prefill"))
    alone = choose_route(fleet, fingerprints=[], prompt_chars=LONG, exclude=[0], **ROUTE | {"loads": [0, 0]})
    assert (fleet.names[alone.serving], alone.prefill, alone.reason) == ("prefill", None, "prefill_only")
    # the decode engine busy far past the prefill engine: short requests still go to it (a role is a preference
    # that load does not override; the prefill engine's queue is the long prompts')
    busy = choose_route(fleet, fingerprints=[], prompt_chars=40, **ROUTE | {"loads": [8, 0]})
    assert fleet.names[busy.serving] == "decode"
    unplaced = choose_route(fleet, fingerprints=[], prompt_chars=LONG, exclude=[1], **ROUTE | {"loads": [0, 0]})
    assert (unplaced.prefill, unplaced.reason) == (None, "no_prefill_engine")
    assert choose_route(fleet, fingerprints=[], prompt_chars=LONG, disaggregate=False,
                        **ROUTE | {"loads": [0, 0]}).reason == "colocated"
    assert choose_route(fleet, fingerprints=[], prompt_chars=LONG, exclude=[0, 1], **ROUTE | {"loads": [0, 0]}) is None


def test_a_both_engine_prefills_when_no_prefill_engine_is_left_and_load_picks_among_prefill_engines():
    fleet = roles(("both", "both"), ("decode", "decode"))
    route = choose_route(fleet, fingerprints=[], prompt_chars=LONG, **ROUTE | {"loads": [0, 0]})
    assert (fleet.names[route.serving], fleet.names[route.prefill]) == ("decode", "both")
    two = roles(("decode", "decode"), ("p1", "prefill"), ("p2", "prefill"))
    assert two.names[choose_route(two, fingerprints=[], prompt_chars=LONG, adapter=None, loads=[0, 6, 0],
                                  min_uncached_tokens=256).prefill] == "p2"


def test_the_role_comes_from_the_engines_state():
    assert candidate_from_state("e", engine_state(role="prefill")).role == "prefill"
    assert candidate_from_state("e", engine_state()).role == "both"
