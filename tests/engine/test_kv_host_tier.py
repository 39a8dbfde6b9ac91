"""The KV host tier: prefix blocks pushed out of a small page pool come back from host memory, and the
request then runs as a prefix hit, token for token as transformers + PEFT (mixed adapters, the Triton
launchers), fp8 pages with their scales; never across adapter content or tenants; a failed load recomputes;
no block leaks."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.engine.conftest import Oracle, build_adapter, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
BLOCK_BYTES = 2048  # llama test checkpoint, block_size 4: 2 layers x (K, V) x 4 tokens x 2 heads x 16 x 4 bytes


@pytest.fixture(scope="module")
def adapter_dirs(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("host-tier-adapters"), checkpoints["llama"]
    return {
        "qv": build_adapter(base, root / "qv", seed=40, r=4, targets=["q_proj", "v_proj"]),
        "kv": build_adapter(base, root / "kv", seed=41, r=2, targets=["k_proj", "v_proj", "o_proj"]),
        "kv-retrained": build_adapter(base, root / "kv2", seed=42, r=2, targets=["k_proj", "v_proj", "o_proj"]),
    }


@pytest.fixture(scope="module")
def oracle(checkpoints, adapter_dirs):
    return Oracle(checkpoints["llama"], adapter_dirs)


def make_llm(checkpoints, adapter_dirs, *, host_blocks=64, **config):
    config = {"block_size": 4, "num_kv_blocks": 12, "pool_adapter_bytes": 7 * BLOCK_BYTES,  # qv and kv: 4 + 3 pages
              "kv_host_cache_gb": host_blocks * BLOCK_BYTES / 2**30, **config}
    llm = LLM(checkpoints["llama"], device="cpu", **config)
    for name in ("qv", "kv"):
        llm.add_adapter(name, adapter_dirs[name])
    return llm


def assert_balanced(llm):
    """Every page is free, cached-evictable or an adapter page: no sequence, load or hold left any."""
    bm, scheduler = llm.engine.block_manager, llm.engine.scheduler
    assert not scheduler.loading and not scheduler.loaded and not scheduler.load_failed and not bm.held
    assert bm.num_free_blocks + len(bm.adapter_pages) == bm.num_blocks
    bm.check_invariants([])
    assert not llm.engine.host_tier.loads_in_flight and not +llm.engine.host_tier.reading


def push_out(llm, seed, length=20):
    """Fill the pool with other prompts, so earlier prefix blocks leave the device."""
    for prompt in random_prompts(seed, [length, length]):
        llm.generate([prompt], GREEDY)


def test_host_tier_hits_match_peft_with_mixed_adapters(checkpoints, adapter_dirs, oracle):
    llm = make_llm(checkpoints, adapter_dirs)
    system = random_prompts(50, [12])[0]
    prompts = [system + tail for tail in random_prompts(51, [3, 2, 1])]
    names = ["qv", None, "kv"]
    first = [llm.generate([p], GREEDY, adapters=[n])[0] for p, n in zip(prompts, names, strict=True)]
    push_out(llm, 52)
    bm = llm.engine.block_manager
    assert not any(k in bm.cached for p, n in zip(prompts, names, strict=True) for k in llm.engine.kv_keys(
        p, adapter=llm.adapters.get(n)))  # all gone from the device
    again = llm.generate(prompts, GREEDY, adapters=names)  # one batch: each waits for its own load
    assert [o.usage.cached_tokens for o in again] == [12, 12, 12]
    for prompt, name, a, b in zip(prompts, names, first, again, strict=True):
        assert a.token_ids == b.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens)
    tiers = llm.engine.state()["kv_tiers"]
    assert tiers["host"]["hits"] == 9 and tiers["host"]["loaded"] >= 9
    assert tiers["device"]["misses"] >= 9 and tiers["host"]["saved"] > 0
    assert_balanced(llm)


def test_no_hit_across_adapter_content_or_tenant(checkpoints, adapter_dirs, oracle):
    llm = make_llm(checkpoints, adapter_dirs)
    prompt = random_prompts(53, [15])[0]
    llm.generate([prompt], GREEDY, adapters=["kv"], tenants=["t1"])
    push_out(llm, 54)
    # the same name, other content (a promoted version): its keys differ, nothing of the old KV is served
    llm.add_adapter("kv", adapter_dirs["kv-retrained"])
    out = llm.generate([prompt], GREEDY, adapters=["kv"], tenants=["t1"])[0]
    assert out.usage.cached_tokens == 0
    assert out.token_ids == oracle.greedy(prompt, "kv-retrained", GREEDY.max_tokens)
    other_tenant = llm.generate([prompt], GREEDY, adapters=["kv"], tenants=["t2"])[0]
    assert other_tenant.usage.cached_tokens == 0
    assert llm.engine.state()["kv_tiers"]["host"]["hits"] == 0
    assert llm.engine.host_tier.lookup(llm.engine.kv_keys(prompt, adapter=llm.adapters["qv"])) == 0  # dropped
    assert_balanced(llm)


def test_a_waiting_load_never_stalls_other_sequences(checkpoints, adapter_dirs, oracle):
    llm = make_llm(checkpoints, adapter_dirs)
    engine = llm.engine
    prompt = random_prompts(55, [13])[0]
    llm.generate([prompt], GREEDY, adapters=["qv"])
    push_out(llm, 56)
    long_run = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    other = random_prompts(57, [3])[0]
    engine.add_request("other", other, long_run)
    engine.step()  # other is running
    engine.add_request("again", prompt, GREEDY, adapter=llm.adapters["qv"])
    before = engine.requests["other"][0].num_tokens
    engine.step()
    again = engine.requests["again"][0]
    assert again.seq_id in engine.scheduler.loading and again.num_computed_tokens == 0  # waits for its blocks
    assert engine.requests["other"][0].num_tokens == before + 1  # the step ran without it
    tokens = {"other": [], "again": []}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert again.num_cached_tokens == 12
    assert tokens["again"] == oracle.greedy(prompt, "qv", GREEDY.max_tokens)
    assert_balanced(llm)


def test_fp8_pages_come_back_with_their_scales(checkpoints, adapter_dirs):
    fp8 = {"kv_cache_dtype": "fp8", "block_size": 16, "num_kv_blocks": 6}  # a page must hold an adapter row
    llm = make_llm(checkpoints, adapter_dirs, host_blocks=16, **fp8)
    colocated = make_llm(checkpoints, adapter_dirs, host_blocks=16, **fp8)
    prompts = random_prompts(58, [35, 40])
    names = ["kv", None]
    for p, n in zip(prompts, names, strict=True):
        llm.generate([p], GREEDY, adapters=[n])
    for prompt in random_prompts(59, [60, 60]):
        llm.generate([prompt], GREEDY)
    hits = llm.generate(prompts, GREEDY, adapters=names)
    assert [o.usage.cached_tokens for o in hits] == [32, 32]
    assert llm.engine.state()["kv_tiers"]["host"]["hits"] == 4
    cold = colocated.generate(prompts, GREEDY, adapters=names)  # fp8 KV is the engine's own numerics: its
    assert [o.token_ids for o in hits] == [o.token_ids for o in cold]  # colocated run is the reference
    assert_balanced(llm)


def test_host_tier_with_every_op_on_its_triton_launcher(checkpoints, adapter_dirs, oracle, triton_launchers):
    llm = make_llm(checkpoints, adapter_dirs)
    system = random_prompts(60, [8])[0]
    prompts = [system + tail for tail in random_prompts(61, [2, 3])]
    names = ["kv", "qv"]
    for p, n in zip(prompts, names, strict=True):
        llm.generate([p], GREEDY, adapters=[n])
    push_out(llm, 62)
    again = llm.generate(prompts, GREEDY, adapters=names)
    assert [o.usage.cached_tokens for o in again] == [8, 8]
    for prompt, name, out in zip(prompts, names, again, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens)
    assert_balanced(llm)


def test_the_host_tier_flag_is_checked(checkpoints):
    with pytest.raises(ValueError, match="kv_host_cache_gb must be >= 0"):
        EngineConfig(model=str(checkpoints["llama"]), kv_host_cache_gb=-1)
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(model=str(checkpoints["llama"]), kv_host_cache_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="holds no block"):
        LLM(checkpoints["llama"], device="cpu", block_size=4, num_kv_blocks=8, kv_host_cache_gb=1 / 2**30)


def test_a_failed_load_recomputes_and_leaks_nothing(checkpoints, adapter_dirs, oracle, monkeypatch):
    llm = make_llm(checkpoints, adapter_dirs)
    prompt = random_prompts(63, [14])[0]
    llm.generate([prompt], GREEDY, adapters=["qv"])
    push_out(llm, 64, length=30)

    def broken(*args, **kwargs):
        raise RuntimeError("host memory unreadable")

    monkeypatch.setattr("engine.kv.host_tier.write_pages", broken)  # the copy into pages fails in its thread
    out = llm.generate([prompt], GREEDY, adapters=["qv"])[0]
    assert out.usage.cached_tokens == 0 and out.token_ids == oracle.greedy(prompt, "qv", GREEDY.max_tokens)
    assert llm.engine.state()["kv_tiers"]["host"]["hits"] == 0
    assert llm.engine.host_tier.lookup(llm.engine.kv_keys(prompt, adapter=llm.adapters["qv"])) == 0  # dropped
    assert_balanced(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_host_tier_on_cuda_equals_a_colocated_run(checkpoints, adapter_dirs, kv_cache_dtype):
    """Pinned slots, saves on the current stream, loads on a side stream: the hit run's tokens are the colocated
    run's (bfloat16: both are the engine's own numerics on this device)."""
    cuda = {"device": "cuda", "dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype, "block_size": 16}
    probe = LLM(checkpoints["llama"], **cuda, num_kv_blocks=8, pool_adapter_bytes=0)
    pages = sum(probe.engine.adapter_pool.pages_to_place(probe.add_adapter(n, adapter_dirs[n])) for n in ("qv", "kv"))
    adapter_bytes = pages * probe.engine.memory.page_bytes  # room for both adapters, none for more KV
    llm = LLM(checkpoints["llama"], **cuda, num_kv_blocks=8, pool_adapter_bytes=adapter_bytes,
              kv_host_cache_gb=1 / 1024)
    colocated = LLM(checkpoints["llama"], **cuda, num_kv_blocks=64)
    for engine in (llm, colocated):
        for name in ("qv", "kv"):
            engine.add_adapter(name, adapter_dirs[name])
    prompts, names = random_prompts(65, [40, 50, 33]), ["qv", None, "kv"]
    for p, n in zip(prompts, names, strict=True):
        llm.generate([p], GREEDY, adapters=[n])
    for prompt in random_prompts(66, [100, 100]):
        llm.generate([prompt], GREEDY)
    hits = [llm.generate([p], GREEDY, adapters=[n])[0] for p, n in zip(prompts, names, strict=True)]
    assert [o.usage.cached_tokens for o in hits] == [32, 48, 32]
    assert llm.engine.state()["kv_tiers"]["host"]["hits"] == 7
    cold = colocated.generate(prompts, GREEDY, adapters=names)
    assert [o.token_ids for o in hits] == [o.token_ids for o in cold]
    assert_balanced(llm)
