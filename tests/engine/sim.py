"""A stand-in for the model in scheduler tests: each step 'computes' the scheduled tokens and
samples a deterministic next token for every sequence whose tokens are all computed."""

from engine.block_manager import BlockManager
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


def step(sched: Scheduler) -> SchedulerOutput:
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
    assert len(sched.running_adapters()) <= sched.max_adapters
    assert len({s.seq_id for s in out.seqs}) == len(out.seqs)
    for seq in out.seqs:
        assert seq in sched.running
        n = out.num_tokens[seq.seq_id]
        assert 1 <= n <= seq.num_tokens - seq.num_computed_tokens
        assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_computed_tokens + n


def new_scheduler(*, num_blocks=64, block_size=4, budget=32, max_seqs=8, max_adapters=2, caching=True, **kw):
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=caching)
    return Scheduler(
        block_manager=bm, max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_adapters=max_adapters, **kw
    )
