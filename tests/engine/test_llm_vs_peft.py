"""Greedy tokens and prompt log-probabilities of the engine against transformers + PEFT."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.conftest import Oracle, build_adapter, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_adapters(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("llama-adapters"), checkpoints["llama"]
    return {
        "qv": build_adapter(base, root / "qv", seed=10, r=4, targets=["q_proj", "v_proj"]),
        "all1": build_adapter(base, root / "all1", seed=11, r=1, targets=ALL, alpha=2.0),
        "big": build_adapter(base, root / "big", seed=12, r=64, targets=["k_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"], use_rslora=True),
        "pattern": build_adapter(base, root / "pattern", seed=13, r=16, targets=ALL,
                                 rank_pattern={"q_proj": 2, "down_proj": 32}, alpha_pattern={"v_proj": 4.0}),
    }


@pytest.fixture(scope="module")
def llama_oracle(checkpoints, llama_adapters):
    return Oracle(checkpoints["llama"], llama_adapters)


def make_llm(model_dir, adapters, **config):
    llm = LLM(model_dir, device="cpu", max_adapter_rank=64, **config)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


def assert_matches(oracle, prompts, names, outputs, max_tokens=GREEDY.max_tokens):
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, max_tokens), f"adapter {name}, prompt {prompt}"


def test_mixed_adapter_batch_matches_peft(checkpoints, llama_adapters, llama_oracle):
    llm = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=128)
    names = ["qv", None, "all1", "big", "pattern", None, "qv", "big", "pattern"]
    prompts = random_prompts(0, [3, 17, 9, 1, 12, 6, 25, 4, 10])
    outputs = llm.generate(prompts, GREEDY, adapters=names)
    assert_matches(llama_oracle, prompts, names, outputs)
    # the adapters matter: the same prompt differs across them
    same = [prompts[0]] * 5
    tokens = [o.token_ids for o in llm.generate(same, GREEDY, adapters=[None, "qv", "all1", "big", "pattern"])]
    assert len({tuple(t) for t in tokens}) == 5


def test_prefix_cache_hits_match_peft(checkpoints, llama_adapters, llama_oracle):
    llm = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=128)
    system = random_prompts(1, [14])[0]  # three full blocks of 4, then two tokens shared with each tail
    p0, p1, p2, p3 = [system + tail for tail in random_prompts(2, [3, 5, 2, 7])]
    first = llm.generate([p0, p2], GREEDY, adapters=["qv", None], tenants=["t1", "t1"])
    assert [o.usage.cached_tokens for o in first] == [0, 0]
    prompts, names = [p1, p3, p2, p1], ["qv", "big", None, "qv"]
    second = llm.generate(prompts, GREEDY, adapters=names, tenants=["t1", "t1", "t2", "t3"])
    assert_matches(llama_oracle, prompts, names, second)
    # a hit needs the same tokens, adapter and tenant
    assert [o.usage.cached_tokens for o in second] == [12, 0, 0, 0]
    third = llm.generate([p0], GREEDY, adapters=["qv"], tenants=["t1"])
    assert third[0].usage.cached_tokens == 16 and third[0].token_ids == first[0].token_ids
    assert llm.engine.state()["prefix_cache_hit_rate"] > 0


def test_chunked_prefill_and_preemption_match_peft(checkpoints, llama_adapters, llama_oracle):
    names = ["all1", None, "qv", "all1", "qv", "qv"]
    prompts = random_prompts(3, [30, 5, 22, 11, 2, 17])
    # 20 pages for KV plus what qv and all1 take (4 + 5 pages of 2 KiB): adapters and KV share them
    llm = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=20, max_num_batched_tokens=8,
                   pool_adapter_bytes=9 * 2048)
    sampling = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, adapters=names)
    assert_matches(llama_oracle, prompts, names, outputs, max_tokens=10)
    assert llm.engine.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks + len(bm.adapter_pages) == bm.num_blocks  # nothing leaked
    bm.check_invariants([])


def test_adapter_page_eviction_and_host_cache(checkpoints, llama_adapters, llama_oracle):
    # pages for one big adapter at a time and a host cache too small for even one: every swap goes back to disk
    llm = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=64,
                   pool_adapter_bytes=210 * 2048, host_adapter_cache_bytes=0)
    names = ["qv", "all1", "big", "pattern", None, "big", "qv", "pattern"]
    prompts = random_prompts(4, [5, 8, 3, 11, 6, 9, 2, 7])
    outputs = llm.generate(prompts, GREEDY, adapters=names)
    assert_matches(llama_oracle, prompts, names, outputs)
    assert llm.engine.adapter_pool.num_evictions["device"] > 0


def test_requests_added_while_others_run(checkpoints, llama_adapters, llama_oracle):
    engine = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=128).engine
    digests = {name: engine.add_adapter(path) for name, path in llama_adapters.items()}
    prompts = random_prompts(5, [7, 13, 4, 9, 15, 3])
    names = ["big", None, "qv", "pattern", "all1", "qv"]
    tokens: dict[str, list[int]] = {}
    added = 0
    for step in range(200):
        if added < len(prompts) and step % 2 == 0:
            engine.add_request(str(added), prompts[added], GREEDY, adapter=names[added] and digests[names[added]])
            added += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.token_ids == tokens[out.request_id]
        if added == len(prompts) and not engine.has_unfinished():
            break
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        assert tokens[str(i)] == llama_oracle.greedy(prompt, name, GREEDY.max_tokens)


@pytest.mark.parametrize(("budget", "blocks"), [(64, 64), (5, 64), (64, 7)], ids=["one-step", "chunked", "preempted"])
def test_prompt_logprobs_match_transformers(checkpoints, llama_adapters, llama_oracle, budget, blocks):
    llm = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=blocks,
                   max_num_batched_tokens=budget, pool_adapter_bytes=(69 + 200 + 3) * 2048)  # pattern and big, 3 to spare
    names = ["pattern", None, "big"]
    prompts = random_prompts(6, [9, 14, 6])
    sampling = SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=3, logprobs=5, ignore_eos=True)
    outputs = llm.generate(prompts, sampling, adapters=names)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        reference = torch.log_softmax(llama_oracle.logits(prompt + out.token_ids, name), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert entry.token_id == prompt[pos]
            assert abs(entry.logprob - float(reference[pos - 1, prompt[pos]])) < 1e-4
            top = reference[pos - 1].topk(3)
            assert sorted(entry.top) == sorted(top.indices.tolist())
        for i, entry in enumerate(out.logprobs):  # the sampled tokens' log-probabilities
            row = reference[len(prompt) - 1 + i]
            assert abs(entry.logprob - float(row[out.token_ids[i]])) < 1e-4
            assert sorted(entry.top) == sorted(row.topk(5).indices.tolist())
    assert (llm.engine.num_preemptions > 0) == (blocks == 7)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_other_architectures_match_peft(checkpoints, tmp_path_factory, arch):
    root, base = tmp_path_factory.mktemp(f"{arch}-adapters"), checkpoints[arch]
    adapters = {
        "qv": build_adapter(base, root / "qv", seed=20, r=8, targets=["q_proj", "v_proj"]),
        "mlp": build_adapter(base, root / "mlp", seed=21, r=3, targets=["gate_proj", "up_proj", "down_proj", "o_proj"]),
    }
    if arch == "mistral":
        assert (base / "model.safetensors.index.json").exists()  # sharded checkpoint
    oracle = Oracle(base, adapters)
    llm = make_llm(base, adapters, block_size=8, num_kv_blocks=64)
    names = ["qv", None, "mlp", "qv", "mlp"]
    prompts = random_prompts(7, [6, 11, 3, 19, 8])
    assert_matches(oracle, prompts, names, llm.generate(prompts, GREEDY, adapters=names))


def test_usage_splits_busy_time(checkpoints, llama_adapters):
    llm = make_llm(checkpoints["llama"], llama_adapters, block_size=4, num_kv_blocks=64)
    engine: LLMEngine = llm.engine
    busy = engine.busy_ms
    outputs = llm.generate(random_prompts(8, [5, 9, 2]), GREEDY, adapters=["qv", None, "big"])
    assert sum(o.usage.gpu_ms for o in outputs) == pytest.approx(engine.busy_ms - busy, rel=1e-9)
    for out in outputs:
        assert out.usage.prompt_tokens == len(out.prompt_token_ids)
        assert out.usage.completion_tokens == 6 and out.finish_reason == "length"
        assert out.usage.ttft_ms >= out.usage.queue_ms >= 0


MANY = [  # rank, targets, extra LoRA settings: ranks 1 to 128, rank/alpha patterns, rsLoRA, base requests mixed in
    (1, ALL, {}), (2, ["q_proj", "v_proj"], {}), (3, ["o_proj", "down_proj"], {}), (5, ["gate_proj", "up_proj"], {}),
    (8, ALL, {"alpha": 4.0}), (13, ["k_proj"], {}), (21, ["q_proj", "k_proj", "v_proj"], {}), (34, ["down_proj"], {}),
    (128, ["q_proj", "v_proj"], {}), (4, ALL, {"rank_pattern": {"k_proj": 9, "up_proj": 1}, "alpha_pattern": {"o_proj": 3.0}}),
    (6, ["v_proj", "up_proj"], {"use_rslora": True}), (2, ALL, {"alpha": 1.0}),
]


@pytest.fixture(scope="module")
def many_adapters(checkpoints):
    root, base = checkpoints["llama"].parent / "many", checkpoints["llama"]
    return {f"m{i}": build_adapter(base, root / f"m{i}", seed=100 + i, r=r, targets=targets, **extra)
            for i, (r, targets, extra) in enumerate(MANY)}


@pytest.mark.parametrize(("kv_blocks", "adapter_pages"), [(256, None), (4, 70)], ids=["roomy", "evict-and-preempt"])
def test_more_distinct_adapters_than_old_slots_match_peft(checkpoints, many_adapters, kv_blocks, adapter_pages):
    page_bytes = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, block 8, 2 KV heads of 16, float32
    memory = None if adapter_pages is None else adapter_pages * page_bytes
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=8, num_kv_blocks=kv_blocks,
                                    max_adapter_rank=128, pool_adapter_bytes=memory, max_num_batched_tokens=64))
    assert engine.memory.page_bytes == page_bytes
    digests = {name: engine.add_adapter(path) for name, path in many_adapters.items()}
    names = list(many_adapters) + [None, None]
    prompts = random_prompts(60, [3 + (5 * i) % 17 for i in range(len(names))])
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        engine.add_request(str(i), prompt, GREEDY, adapter=name and digests[name])
    tokens: dict[str, list[int]] = {}
    most = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        most = max(most, len(engine.scheduler.running_adapters()))
    oracle = Oracle(checkpoints["llama"], many_adapters)
    for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
        assert tokens[str(i)] == oracle.greedy(prompt, name, GREEDY.max_tokens), f"adapter {name}"
    if adapter_pages is None:
        assert most > 8  # more distinct adapters in one step than the old slot count
    else:
        assert engine.num_preemptions > 0 and engine.adapter_pool.num_evictions["device"] > 0
    engine.block_manager.check_invariants([])
