import random

import pytest

from engine.fairness import FirstComeFirstServed, VirtualTokenCounter
from tests.engine.sim import make_seq, new_scheduler, step


def drain(sched, limit=2000):
    outs = []
    for _ in range(limit):
        if not sched.num_unfinished:
            return outs
        outs.append(step(sched))
    raise AssertionError("scheduler did not drain")


def test_chunked_prefill_mixes_with_decodes():
    sched = new_scheduler(budget=8)
    a = make_seq(1, list(range(3)), max_tokens=10)
    sched.add(a)
    step(sched)
    b = make_seq(2, list(range(30)), max_tokens=2)
    sched.add(b)
    out = step(sched)
    assert out.num_tokens == {a.seq_id: 1, b.seq_id: 7}
    outs = drain(sched)
    assert all(out.total_tokens <= 8 for out in outs)
    assert a.num_completion_tokens == 10 and b.num_completion_tokens == 2


def test_preemption_recomputes_newest_and_everything_finishes():
    sched = new_scheduler(num_blocks=10, block_size=4, budget=64)
    seqs = [make_seq(i, [i] * 9, max_tokens=12) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    outs = drain(sched)
    preempted = [victim for out in outs for victim in out.preempted]
    assert preempted, "the cache is too small for all four; something must be preempted"
    assert seqs[0] not in preempted  # the oldest is never the newest running
    assert all(seq.num_completion_tokens == 12 and seq.finish_reason == "length" for seq in seqs)
    assert sched.block_manager.num_free_blocks == 10


def test_no_cap_on_distinct_adapters_and_unready_adapter_waits():
    ready = set("abcdefghijkl")
    sched = new_scheduler(num_blocks=200, budget=64, max_seqs=16, ready=ready)
    seqs = [make_seq(i, [1, 2, 3], adapter=ad, max_tokens=3) for i, ad in enumerate("abcdefghijklm")]
    for seq in seqs:
        sched.add(seq)
    step(sched)  # their copies into pages start
    assert not sched.running
    step(sched)
    assert len(sched.running_adapters()) == 12  # as many as fit in memory: no slot cap
    for _ in range(30):
        step(sched)
    assert all(seq.is_finished for seq in seqs[:12]) and not seqs[12].is_finished
    ready.add("m")
    drain(sched)
    assert seqs[12].is_finished


def test_adapter_pages_are_reclaimed_for_kv_before_anyone_is_preempted():
    # 24 pages: three adapters of 4 pages each stay resident after their requests end, then a long
    # base-model request needs the pages they hold
    sched = new_scheduler(num_blocks=24, block_size=4, budget=64, adapter_pages=4)
    for i, ad in enumerate("abc"):
        sched.add(make_seq(i, [1, 2, 3], adapter=ad, max_tokens=2))
    drain(sched)
    assert len(sched.block_manager.adapter_pages) == 12
    long = make_seq("long", list(range(40)), max_tokens=30)
    sched.add(long)
    outs = drain(sched)
    assert long.is_finished and not any(out.preempted for out in outs)
    assert sched.adapters.evictions >= 2


def test_a_resident_adapters_sequence_steps_while_another_adapter_is_copied_into_pages():
    sched = new_scheduler(num_blocks=64, budget=64, adapter_pages=4, copy_steps=5)
    hot = make_seq("hot", [1, 2, 3], adapter="a", max_tokens=12)
    sched.add(hot)
    step(sched)  # a's copy starts
    step(sched)
    while not hot.num_completion_tokens:
        step(sched)
    cold = make_seq("cold", [4, 5, 6], adapter="b", max_tokens=2)
    sched.add(cold)
    ran_while_copying = 0
    while cold not in sched.running:
        before = hot.num_completion_tokens
        out = step(sched)
        if "b" in sched.adapters.placing:  # the copy was under way through this step
            assert cold in sched.waiting and cold not in out.seqs
            ran_while_copying += hot.num_completion_tokens > before
    assert ran_while_copying >= 4  # every step of the copy decoded the resident adapter's sequence
    assert cold in out.seqs and hot in out.seqs  # admitted the step after its copy, beside the running one
    drain(sched)


def test_eviction_spares_adapters_that_waiting_sequences_need():
    # 16 pages: b, c, a resident and idle (4 pages each, b least recently used); a waiting sequence of b is held back by max_num_seqs
    # while d's sequence waits for its pages: d takes c's (no one needs c), never b's
    sched = new_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=1, adapter_pages=4, caching=False)
    for i, ad in enumerate("bca"):  # b least recently used
        sched.add(make_seq(f"warm-{i}", [1, 2, 3], adapter=ad, max_tokens=1))
    drain(sched)
    assert set(sched.adapters.resident) == {"a", "b", "c"} and sched.adapters.evictions == 0
    runner = make_seq("runner", [1, 2, 3], adapter="a", max_tokens=6)
    sched.add(runner)
    step(sched)
    for seq in (make_seq("d", [1, 2, 3], adapter="d", max_tokens=1), make_seq("b", [1, 2, 3], adapter="b",
                                                                             max_tokens=1)):
        sched.add(seq)
    step(sched)
    assert sched.adapters.evicted == ["c"] and "d" in sched.adapters.placing
    drain(sched)


def test_admission_frees_the_pages_of_adapters_only_waiting_sequences_need_rather_than_wait_forever():
    # 8 pages, both held by idle adapters x and y that waiting sequences need: admitting x's sequence must
    # evict y (needed only by a waiting sequence) for its KV block, or nothing would ever run
    sched = new_scheduler(num_blocks=8, block_size=4, budget=64, adapter_pages=4, caching=False)
    for ad in "xy":
        sched.adapters.place(ad)
    sched.adapters.tick()
    assert set(sched.adapters.resident) == {"x", "y"} and sched.block_manager.num_free_blocks == 0
    seqs = [make_seq(f"s-{ad}", [1, 2, 3], adapter=ad, max_tokens=2) for ad in "xy"]
    for seq in seqs:
        sched.add(seq)
    drain(sched)
    assert all(seq.finish_reason == "length" for seq in seqs)


def test_vtc_charges_a_token_once_even_when_recomputed_after_preemption():
    policy = VirtualTokenCounter()
    sched = new_scheduler(num_blocks=10, block_size=4, budget=64, policy=policy, caching=False)
    seqs = [make_seq(i, list(range(3 + i)), max_tokens=12, tenant=f"t{i}") for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    outs = drain(sched)
    assert any(out.preempted for out in outs), "the cache is too small for all four; something is preempted"
    for i, seq in enumerate(seqs):  # each token of prompt and completion charged once, at cost 1
        assert policy.counters[f"t{i}"] == pytest.approx(len(seq.prompt_token_ids) + 12 - 1)


def test_abort_frees_everything():
    sched = new_scheduler(num_blocks=32)
    seqs = [make_seq(i, list(range(5 + i)), max_tokens=50, tenant="ab"[i % 2]) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(5):
        step(sched)
    assert sched.running and sched.waiting
    for seq in seqs:
        sched.finish(seq, "abort")
    assert not sched.num_unfinished
    assert sched.block_manager.num_free_blocks == 32
    sched.block_manager.check_invariants([])


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_invariants(seed):
    rng = random.Random(seed)
    sched = new_scheduler(
        num_blocks=rng.randint(12, 40), budget=rng.choice([4, 16, 64]), max_seqs=rng.randint(1, 8),
        long_prefill_token_threshold=rng.choice([0, 5]), caching=rng.random() < 0.7,
    )
    live, rid = [], 0
    for _ in range(300):
        if rng.random() < 0.3:
            rid += 1
            seq = make_seq(rid, [rng.randrange(4) for _ in range(rng.randint(1, 20))], max_tokens=rng.randint(1, 8),
                           adapter=rng.choice([None, "x", "y", "z"]), tenant=rng.choice("ab"))
            sched.add(seq)
            live.append(seq)
        if rng.random() < 0.05 and live:
            sched.finish(live.pop(rng.randrange(len(live))), "abort")
        step(sched)
    drain(sched)
    sched.adapters.drop_all()  # idle adapters keep their pages until needed
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_with_a_host_tier(seed):
    """Loads that take a few steps or fail, aborts while loading, preemption: every sequence finishes, the pages'
    references always match the block tables and the holds, and at the end every page is free again."""
    rng = random.Random(seed)
    sched = new_scheduler(num_blocks=rng.randint(10, 30), budget=rng.choice([4, 16, 64]), max_seqs=rng.randint(1, 8),
                          long_prefill_token_threshold=rng.choice([0, 5]), host_blocks=rng.randint(4, 64), rng=rng)
    prompts = [[rng.randrange(3) for _ in range(rng.randint(4, 20))] for _ in range(6)]  # revisited: prefix hits
    live, rid, began_loading = [], 0, set()
    for _ in range(300):
        if rng.random() < 0.3:
            rid += 1
            seq = make_seq(rid, rng.choice(prompts) + [rng.randrange(3)], max_tokens=rng.randint(1, 6),
                           adapter=rng.choice([None, "x"]), tenant=rng.choice("ab"))
            sched.add(seq)
            live.append(seq)
        if rng.random() < 0.05 and live:
            sched.finish(live.pop(rng.randrange(len(live))), "abort")
        step(sched)
        began_loading |= set(sched.loading)
        for seq in live:
            assert seq.seq_id not in sched.loading or seq in sched.waiting
        live = [s for s in live if not s.is_finished]
    drain(sched)
    while sched.loading:  # loads of aborted sequences still finish
        sched.schedule()
    sched.adapters.drop_all()
    bm = sched.block_manager
    assert not bm.held and bm.num_free_blocks == bm.num_blocks and not sched.loaded and not sched.load_failed
    bm.check_invariants([])
    assert began_loading and sched.connector.loaded  # the workload does exercise the tier


def served_gap(policy, weights=(1.0, 1.0)):
    budget = 32
    sched = new_scheduler(num_blocks=200, budget=budget, max_seqs=6, policy=policy)
    for i in range(40):  # tenant a floods the queue first
        sched.add(make_seq(f"a{i}", [1] * 10, max_tokens=6, tenant="a", weight=weights[0]))
    for i in range(40):
        sched.add(make_seq(f"b{i}", [2] * 10, max_tokens=6, tenant="b", weight=weights[1]))
    served = {"a": 0.0, "b": 0.0}
    worst = 0.0
    while all(any(s.tenant == t for s in sched.waiting) for t in "ab"):
        out = step(sched)
        for seq in out.seqs:
            served[seq.tenant] += out.num_tokens[seq.seq_id] / seq.weight
        worst = max(worst, abs(served["a"] - served["b"]))
    return worst, budget


def test_vtc_keeps_tenants_within_one_step_budget():
    worst, budget = served_gap(VirtualTokenCounter())
    assert worst <= budget
    fcfs_worst, _ = served_gap(FirstComeFirstServed())
    assert fcfs_worst > 4 * budget  # the same workload is unfair without VTC


def test_vtc_weights_share():
    worst, budget = served_gap(VirtualTokenCounter(), weights=(2.0, 1.0))
    assert worst <= budget  # weighted tokens stay level, so tenant a got about twice the raw tokens


def test_lookahead_slots_are_reserved_then_rolled_back_and_never_preempt():
    sched = new_scheduler(num_blocks=4, block_size=4, budget=32, policy=VirtualTokenCounter(),
                          lookahead=lambda seq, batch_size: 6)
    bm, a = sched.block_manager, make_seq(1, [1, 2, 3], max_tokens=20)
    sched.add(a)
    step(sched)  # prefill: no lookahead
    out = sched.schedule()
    assert out.num_tokens == {a.seq_id: 1} and out.lookahead == {a.seq_id: 6}
    assert len(a.block_table) == bm.blocks_needed(3 + 1 + 6)  # slots up to the sixth proposed token
    sched.on_step_done(out, {a.seq_id: 2})  # two of six accepted; the engine then appends them and one more
    a.token_ids += [7, 8, 9]
    assert a.num_computed_tokens == 6 and len(a.block_table) == bm.blocks_needed(7)
    assert a.num_charged_tokens == 6 and sched.policy.counters["t"] == 6  # accepted tokens are charged
    bm.check_invariants(sched.running)
    b = make_seq(2, list(range(8)), max_tokens=20)  # takes the two free pages
    sched.add(b)
    out = sched.schedule()
    assert b.seq_id in out.new_seq_ids and not out.preempted  # admission before guesses
    assert out.lookahead[a.seq_id] == 1  # what a's own blocks hold: no page is left
    bm.check_invariants(sched.running)


def test_a_prefill_chunk_never_ends_inside_an_unsplit_run():
    """Two images of 16 tokens attended both ways (runs [4, 20) and [24, 40)) under an 18-token budget shared
    with a decoding sequence: every chunk stops before a run or takes all of it, and the prompt is all computed.
    The same prompt again starts from a prefix hit inside the second run and takes the rest of it whole."""
    sched = new_scheduler(budget=18)
    decoding = make_seq(0, [1, 2, 3], max_tokens=30)
    sched.add(decoding)
    step(sched)
    runs = ((4, 20), (24, 40))
    chunks = []
    for request_id in (1, 2):
        seq = make_seq(request_id, list(range(44)), max_tokens=2)
        seq.unsplit = runs
        sched.add(seq)
        while not seq.is_finished:
            out = step(sched)
            end = seq.num_computed_tokens
            if seq.seq_id in out.num_tokens and not seq.is_finished and end <= seq.num_prompt_tokens:
                chunks.append((request_id, end - out.num_tokens[seq.seq_id], end))
    assert all(out.total_tokens <= 18 for out in drain(sched))
    ends = [end for _, _, end in chunks]
    assert not [end for end in ends for first, last in runs if first < end < last], chunks
    first_request = [(start, end) for request_id, start, end in chunks if request_id == 1]
    assert first_request[0] == (0, 4) and first_request[-1][1] == 44
    again = [(start, end) for request_id, start, end in chunks if request_id == 2]
    assert again[0][0] > 24 and again[0][1] >= 40  # from a hit inside the second run, to its end at least


def test_an_unsplit_run_wider_than_the_budget_is_never_cut():
    sched = new_scheduler(budget=8)
    seq = make_seq(1, list(range(20)), max_tokens=1)
    seq.unsplit = ((2, 12),)
    sched.add(seq)
    out = step(sched)
    assert out.num_tokens == {seq.seq_id: 2}
    assert step(sched).is_empty  # the run never fits: the engine refuses such a prompt (LLMEngine.add_request)
