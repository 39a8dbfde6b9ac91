"""Speculative decoding end to end: greedy output equal to speculation off and to transformers + PEFT, with
mixed adapters, both proposers, preemption and prefix-cache hits; stops, limits and logprobs per token."""

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.adapter_registry import AdapterRegistry
from engine.server.app import EngineAPI, build_app
from engine.server.engine_loop import EngineLoop
from engine.server.metrics import EngineMetrics
from tests.engine.conftest import Oracle, build_adapter, build_checkpoint, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
NAMES = ["a", None, "b", None, "a", "b"]


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("spec-adapters"), checkpoints["llama"]
    return {
        "a": build_adapter(base, root / "a", seed=21, r=4, targets=["q_proj", "v_proj", "down_proj"]),
        "b": build_adapter(base, root / "b", seed=22, r=8, targets=["k_proj", "o_proj", "gate_proj"]),
    }


@pytest.fixture(scope="module")
def oracle(checkpoints, adapters):
    return Oracle(checkpoints["llama"], adapters)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("draft") / "d", "llama", seed=9, num_layers=1)


def prompts():
    # some prompts repeat themselves, so that n-gram lookup finds something to propose
    base = random_prompts(40, [3, 11, 7, 5, 9, 6])
    return [p + p if i % 2 else p for i, p in enumerate(base)]


def make(model, adapters, **config) -> LLM:
    config = {"block_size": 4, "num_kv_blocks": 160, "max_adapter_rank": 8, "speculative_min_acceptance": 0.0,
              **config}
    llm = LLM(model, **config)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-small"])
def test_greedy_equals_speculation_off_and_peft(checkpoints, adapters, oracle, small_draft, method):
    model = checkpoints["llama"]
    config = {"speculative_method": "ngram"} if method == "ngram" else {
        "speculative_method": "draft", "speculative_model": str(model if method == "draft-self" else small_draft)}
    on = make(model, adapters, num_speculative_tokens=3, **config)
    outs = on.generate(prompts(), GREEDY, adapters=NAMES)
    spec = on.engine.speculation_state()
    assert spec["proposed_tokens"] > 0, spec
    if method != "draft-small":  # an unrelated random draft is (nearly) always rejected: the rollback path
        assert spec["accepted_tokens"] > 0, spec
    if method == "draft-self":  # the draft is the model itself (without adapters): base-model rows accept all
        base = [o.usage for o, name in zip(outs, NAMES, strict=True) if name is None]
        assert all(u.spec_accepted_tokens == u.spec_proposed_tokens > 0 for u in base)
    for prompt, name, out in zip(prompts(), NAMES, outs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens), (method, name, prompt)
    off = make(model, adapters).generate(prompts(), GREEDY, adapters=NAMES)
    assert [o.token_ids for o in outs] == [o.token_ids for o in off]
    assert sum(o.usage.spec_accepted_tokens for o in outs) == spec["accepted_tokens"]
    bm = on.engine.block_manager
    bm.check_invariants([])
    assert bm.num_used_blocks == 0  # every lookahead block came back


def test_preemption_and_prefix_hits_stay_exact(checkpoints, adapters, oracle):
    model = checkpoints["llama"]
    llm = LLM(model, block_size=4, num_kv_blocks=14, max_adapter_rank=8, pool_adapter_bytes=0,
              speculative_method="draft", speculative_model=str(model), num_speculative_tokens=4,
              speculative_min_acceptance=0.0)
    batch = random_prompts(41, [9, 6, 10, 7])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(batch, params)
    assert llm.engine.num_preemptions > 0 and llm.engine.speculation_state()["accepted_tokens"] > 0
    again = llm.generate(batch, params)  # the prompts' full blocks are prefix-cache hits now
    assert any(o.usage.cached_tokens for o in again)
    for prompt, a, b in zip(batch, first, again, strict=True):
        assert a.token_ids == b.token_ids == oracle.greedy(prompt, None, params.max_tokens)
    llm.engine.block_manager.check_invariants([])


def test_stops_limits_and_logprobs_per_token(checkpoints, adapters):
    model = checkpoints["llama"]
    on = make(model, adapters, speculative_method="draft", speculative_model=str(model), num_speculative_tokens=4)
    off = make(model, adapters)
    prompt = random_prompts(42, [8])[0]
    free = off.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    cases = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[5]], logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8, stop_token_ids=[free[2]], ignore_eos=True),
    ]
    for params in cases:
        a, b = on.generate([prompt], params)[0], off.generate([prompt], params)[0]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, params
        assert len(a.token_ids) <= params.max_tokens
        if params.logprobs is not None:
            assert [lp.token_id for lp in a.logprobs] == a.token_ids
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert x.top.keys() == y.top.keys()
    assert on.engine.speculation_state()["accepted_tokens"] > 0


def test_sampling_with_speculation_runs_seeded(checkpoints, adapters):
    model = checkpoints["llama"]
    llm = make(model, adapters, speculative_method="draft", speculative_model=str(model), num_speculative_tokens=3)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True, n=2)
    a = llm.generate(random_prompts(43, [5, 8]), params, adapters=["a", None])
    b = llm.generate(random_prompts(43, [5, 8]), params, adapters=["a", None])
    assert [c.token_ids for o in a for c in o.choices] == [c.token_ids for o in b for c in o.choices]
    assert all(len(c.token_ids) == 9 for o in a for c in o.choices)


def test_bad_speculative_configuration_is_refused(checkpoints, tmp_path):
    model = str(checkpoints["llama"])
    for fields, message in [
        ({"speculative_method": "medusa"}, "speculative_method must be one of"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
        ({"speculative_method": "draft"}, "needs speculative_model"),
        ({"speculative_method": "draft", "speculative_model": str(tmp_path / "nope")}, "directory not found"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=model, **fields)
    other = build_checkpoint(tmp_path / "other", "llama", seed=4)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"w7"', '"x7"'))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model, speculative_method="draft", speculative_model=str(other))


def test_rejected_tokens_give_their_blocks_back_each_step(checkpoints, small_draft):
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64,
                                    speculative_method="draft", speculative_model=str(small_draft),
                                    num_speculative_tokens=5, speculative_min_acceptance=0.0))
    for i, prompt in enumerate(random_prompts(44, [5, 8, 3])):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    bm, lookahead_steps = engine.block_manager, 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        bm.check_invariants(running)
        lookahead_steps += any(s.num_spec_proposed for s in running)
        for seq in running:  # the lookahead blocks of rejected tokens are gone: just the next token's slot is held
            assert len(seq.block_table) <= bm.blocks_needed(seq.num_tokens), seq
    assert lookahead_steps and engine.speculation_state()["proposed_tokens"] > engine.speculation_state()["accepted_tokens"]


def test_acceptance_reaches_metrics_and_usage_events(checkpoints):
    import msgspec

    from engine.contract import UsageEvent, now_utc, usage_event_read
    from engine.server.metrics import EngineMetrics

    model = str(checkpoints["llama"])
    llm = LLM(model, block_size=4, num_kv_blocks=64, speculative_method="draft", speculative_model=model)
    out = llm.generate(random_prompts(45, [6]), GREEDY)[0]
    state = llm.engine.state()["speculation"]
    assert out.usage.spec_accepted_tokens == state["accepted_tokens"] > 0
    assert state["tokens_per_step"] > 1.0
    assert out.usage.completion_tokens == GREEDY.max_tokens > out.usage.sampling_steps  # several tokens a step
    metrics = EngineMetrics()
    metrics.observe_state(llm.engine.state())
    metrics.observe_state(llm.engine.state())  # totals: observing twice counts once
    text = metrics.render().decode()
    assert f'quilt_engine_spec_tokens_total{{kind="accepted"}} {float(state["accepted_tokens"])}' in text
    assert "quilt_engine_spec_acceptance_rate" in text and "quilt_engine_tokens_per_step" in text
    event = UsageEvent(request_id="r", tenant="t", api_key_id=None, adapter_digest=None, base_model="m",
                       prompt_tokens=6, cached_tokens=0, completion_tokens=10, gpu_ms=1.0, queue_ms=0.0, ttft_ms=1.0,
                       e2e_ms=2.0, finish_reason="length", finished_at=now_utc(),
                       spec_proposed_tokens=out.usage.spec_proposed_tokens,
                       spec_accepted_tokens=out.usage.spec_accepted_tokens, sampling_steps=out.usage.sampling_steps)
    sent = msgspec.to_builtins(event)
    assert usage_event_read(sent) == event
    older = {k: v for k, v in sent.items() if not k.startswith("spec_")}
    assert usage_event_read(older).spec_proposed_tokens == 0
    older.pop("sampling_steps")
    assert usage_event_read(older).sampling_steps == 0
    with pytest.raises(ValueError, match="spec_accepted_tokens"):
        usage_event_read({**sent, "spec_accepted_tokens": event.spec_proposed_tokens + 1})


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_filters_that_keep_one_token_verify_like_greedy(checkpoints, adapters, oracle, method):
    model = checkpoints["llama"]
    config = {"speculative_method": method, **({"speculative_model": str(model)} if method == "draft" else {})}
    llm = make(model, adapters, num_speculative_tokens=3, **config)
    params = SamplingParams(temperature=1.3, top_k=1, max_tokens=8, ignore_eos=True)  # p is one-hot: rejection
    outs = llm.generate(prompts()[:4], params, adapters=NAMES[:4])  # sampling must give the argmax
    assert llm.engine.speculation_state()["accepted_tokens"] > 0
    for prompt, name, out in zip(prompts()[:4], NAMES[:4], outs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, params.max_tokens), (method, name)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_on_a_quantized_model_with_fp8_pages_equals_it_off(checkpoints, adapters, method):
    model = checkpoints["llama"]
    quant = {"quantization": "int8", "kv_cache_dtype": "fp8", "block_size": 16}
    spec = {"speculative_method": method, **({"speculative_model": str(model)} if method == "draft" else {})}
    on = make(model, adapters, num_speculative_tokens=3, **quant, **spec)
    off = make(model, adapters, **quant)
    a = on.generate(prompts(), GREEDY, adapters=NAMES)
    assert [o.token_ids for o in a] == [o.token_ids for o in off.generate(prompts(), GREEDY, adapters=NAMES)]
    assert on.engine.speculation_state()["accepted_tokens"] > 0


def test_sampled_tokens_follow_the_model_when_the_draft_disagrees(checkpoints, adapters, oracle):
    import collections

    model = checkpoints["llama"]  # the draft is the base model; the requests run on adapter "b": p and q differ
    llm = make(model, adapters, num_kv_blocks=2048, max_num_seqs=256, speculative_method="draft",
               speculative_model=str(model), num_speculative_tokens=2, speculative_max_batch=256)
    prompt = random_prompts(46, [5])[0]
    params = SamplingParams(n=3000, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=11)
    out = llm.generate([prompt], params, adapters=["b"])[0]
    spec = llm.engine.speculation_state()
    assert 0 < spec["accepted_tokens"] < spec["proposed_tokens"]  # the draft's guesses are both kept and rejected
    first = collections.Counter(c.token_ids[0] for c in out.choices).most_common(1)[0][0]
    seconds = collections.Counter(c.token_ids[1] for c in out.choices if c.token_ids[0] == first)
    values, ids = oracle.logits(prompt + [first], "b")[-1].topk(3)
    expected = dict(zip(ids.tolist(), values.softmax(-1).tolist(), strict=True))
    total = sum(seconds.values())
    assert set(seconds) <= set(expected) and total > 1000
    tv = 0.5 * sum(abs(seconds[t] / total - p) for t, p in expected.items())
    # four times the bound on a correct sampler's expected distance over 3 tokens, 0.5 * sqrt(4 / (pi n))
    assert tv < 2.26 / total**0.5, (tv, total, seconds, expected)


def test_inter_token_metric_counts_every_token_of_a_speculative_step(checkpoints):
    """A step that accepts k speculative tokens after a gap g is k inter-token gaps of g/k: the histogram counts
    completion_tokens - 1 gaps per request (not one per step), summing to the time from first token to last."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64,
                                    speculative_method="draft", speculative_model=str(checkpoints["llama"]),
                                    num_speculative_tokens=3, speculative_min_acceptance=0.0))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    app = build_app(EngineAPI(loop, registry=AdapterRegistry(loop, store=None), model_name="tiny",
                              drain_timeout_s=1.0), token="t")
    auth = {"Authorization": "Bearer t"}
    body = {"prompt_token_ids": [7, 8, 9, 10, 11], "stream": False, "tenant": "itl",
            "sampling": {"temperature": 0, "max_tokens": 13, "ignore_eos": True}}
    with TestClient(app) as client:
        answer = client.post("/v1/generate", json=body, headers=auth).json()
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics", headers=auth).text)}
    assert len(answer["token_ids"]) == 13
    assert engine.speculation_state()["tokens_per_step"] > 2  # the draft is the model: every proposal accepted
    itl = families["quilt_engine_inter_token_seconds"]
    samples = {s.name: s.value for s in itl.samples if s.labels.get("tenant") == "itl" and "le" not in s.labels}
    assert samples["quilt_engine_inter_token_seconds_count"] == 12
    decode_s = (answer["usage"]["e2e_ms"] - answer["usage"]["ttft_ms"]) / 1000.0
    assert 0 < samples["quilt_engine_inter_token_seconds_sum"] <= decode_s * 1.1 + 0.01
    assert "k tokens" in itl.documentation  # the choice is in the help text


def test_time_to_first_token_is_one_observation_per_request(checkpoints):
    """n completions share their prompt: the request has one first token, and each completion n - 1 gaps."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    app = build_app(EngineAPI(loop, registry=AdapterRegistry(loop, store=None), model_name="tiny",
                              drain_timeout_s=1.0), token="t")
    body = {"prompt_token_ids": [7, 8, 9], "stream": False, "tenant": "ttft",
            "sampling": {"n": 3, "temperature": 1.0, "seed": 5, "max_tokens": 4, "ignore_eos": True}}
    with TestClient(app) as client:
        assert client.post("/v1/generate", json=body, headers={"Authorization": "Bearer t"}).status_code == 200
        text = client.get("/metrics", headers={"Authorization": "Bearer t"}).text
    counts = {f.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name.endswith("_count") and s.labels.get("tenant") == "ttft"}
    assert counts["quilt_engine_ttft_seconds"] == 1
    assert counts["quilt_engine_inter_token_seconds"] == 3 * 3
