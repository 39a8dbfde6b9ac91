"""Tensor parallelism on CPU with 2 ranks over gloo: greedy tokens against transformers + PEFT and against one
rank, and what happens when a rank dies."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from starlette.testclient import TestClient
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import tensor_parallel
from benchmarks.quantization import agreement
from engine import LLM, SamplingParams
from engine.__main__ import main as cli_main
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.adapter_registry import AdapterRegistry
from engine.server.app import EngineAPI, build_app
from engine.server.engine_loop import EngineLoop
from engine.server.metrics import EngineMetrics
from engine.workers.worker_group import RankFailed
from tests.engine.conftest import FAMILIES, VOCAB, Oracle, build_adapter, build_tokenizer, random_prompts

REPO = Path(__file__).resolve().parents[2]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# one small pool for every check: 4-token pages, KV and adapters sharing 96 of them, 12 tokens a step
CONFIG = {"block_size": 4, "num_kv_blocks": 96, "pool_adapter_bytes": 0, "max_num_batched_tokens": 12,
          "max_adapter_rank": 16}


@pytest.fixture(scope="module")
def tp_adapters(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("tp-adapters"), checkpoints["llama"]
    return {
        "qv": build_adapter(base, root / "qv", seed=30, r=4, targets=["q_proj", "v_proj"]),
        "all1": build_adapter(base, root / "all1", seed=31, r=1, targets=ALL, alpha=2.0),
        "mlp": build_adapter(base, root / "mlp", seed=32, r=8, targets=["o_proj", "gate_proj", "up_proj",
                             "down_proj"], use_rslora=True),
        "pattern": build_adapter(base, root / "pattern", seed=33, r=2, targets=ALL,
                                 rank_pattern={"down_proj": 6, "k_proj": 3}, alpha_pattern={"o_proj": 5.0}),
    }


@pytest.fixture(scope="module")
def oracle(checkpoints, tp_adapters):
    return Oracle(checkpoints["llama"], tp_adapters)


def make_llm(model_dir, adapters, *, tp: int) -> LLM:
    llm = LLM(model_dir, device="cpu", tensor_parallel_size=tp, **CONFIG)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def engines(checkpoints, tp_adapters):
    """One engine of each size for every check below (a worker takes seconds to start)."""
    one, two = make_llm(checkpoints["llama"], tp_adapters, tp=1), make_llm(checkpoints["llama"], tp_adapters, tp=2)
    yield one, two
    two.engine.shutdown()


def generate_both(engines, oracle, prompts, names, sampling=GREEDY, tenants=None):
    one, two = engines
    first = two.generate(prompts, sampling, adapters=names, tenants=tenants)
    single = one.generate(prompts, sampling, adapters=names, tenants=tenants)
    for prompt, name, out, ref in zip(prompts, names, first, single, strict=True):
        expected = oracle.greedy(prompt, name, sampling.max_tokens)
        assert out.token_ids == expected, f"tp=2, adapter {name}, prompt {prompt}"
        assert ref.token_ids == expected, f"tp=1, adapter {name}, prompt {prompt}"
    return first


def test_mixed_adapters_and_ranks_match_peft_and_one_rank(engines, oracle):
    names = ["qv", None, "all1", "mlp", "pattern", None, "qv", "mlp", "pattern"]
    prompts = random_prompts(40, [3, 17, 9, 1, 12, 6, 25, 4, 10])
    generate_both(engines, oracle, prompts, names)
    # the adapters matter on both ranks' halves: one prompt, five different continuations
    same = [prompts[0]] * 5
    tokens = [o.token_ids for o in engines[1].generate(same, GREEDY, adapters=[None, "qv", "all1", "mlp", "pattern"])]
    assert len({tuple(t) for t in tokens}) == 5


def test_prefix_hits_match_peft(engines, oracle):
    system = random_prompts(41, [14])[0]
    p0, p1, p2 = [system + tail for tail in random_prompts(42, [3, 5, 2])]
    first = generate_both(engines, oracle, [p0], ["pattern"], tenants=["t1"])
    assert first[0].usage.cached_tokens == 0
    second = generate_both(engines, oracle, [p1, p2], ["pattern", "mlp"], tenants=["t1", "t1"])
    assert [o.usage.cached_tokens for o in second] == [12, 0]  # same adapter and tenant only


def test_preemption_and_chunked_prefill_match_peft(engines, oracle):
    names = ["all1", None, "qv", "pattern", "mlp", "qv", None, "all1"]
    prompts = random_prompts(43, [30, 5, 22, 11, 2, 17, 28, 19])
    before = engines[1].engine.num_preemptions
    generate_both(engines, oracle, prompts, names, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert engines[1].engine.num_preemptions > before
    bm = engines[1].engine.block_manager
    assert bm.num_free_blocks + len(bm.adapter_pages) == bm.num_blocks  # nothing leaked
    bm.check_invariants([])


def llama_with_biases(directory):
    """Biases on every projection: the row-parallel ones (o, down) must be added once, not once per rank."""
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.15,
                         attention_bias=True, mlp_bias=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.5)
    model.save_pretrained(directory)
    build_tokenizer(directory)
    return directory


@pytest.mark.parametrize("arch", ["mistral", "llama-biases"])
def test_other_architectures_match_peft(checkpoints, tmp_path, arch):
    """Mistral (tied embeddings, a checkpoint in many files, each rank reading its slices); Llama with biases on
    every projection (q/k/v and gate/up split, o/down added once)."""
    base = llama_with_biases(tmp_path / "base") if arch == "llama-biases" else checkpoints[arch]
    adapters = {"all": build_adapter(base, tmp_path / "all", seed=50, r=4, targets=ALL)}
    llm = make_llm(base, adapters, tp=2)
    try:
        names = ["all", None, "all"]
        prompts = random_prompts(51, [9, 14, 3])
        outputs = llm.generate(prompts, GREEDY, adapters=names)
    finally:
        llm.engine.shutdown()
    assert not any(p.is_alive() for p in llm.engine.workers.processes)  # a clean shutdown stops them
    oracle = Oracle(base, adapters)
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens), f"{arch}, adapter {name}"


@pytest.mark.parametrize("arch", FAMILIES)
def test_families_on_two_ranks_equal_one_and_peft(checkpoints, tmp_path, arch):
    """Qwen3's and Gemma 3's per-head q/k norms and Gemma's four norms replicated, each rank its heads with
    their windows and soft-caps: the same tokens and log-probabilities as one rank, and as PEFT."""
    base = checkpoints[arch]
    adapters = {"all": build_adapter(base, tmp_path / "all", seed=52, r=4, targets=ALL)}
    one, two = make_llm(base, adapters, tp=1), make_llm(base, adapters, tp=2)
    names = ["all", None, "all"]
    prompts = random_prompts(53, [13, 20, 3])  # two longer than the window (8)
    sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    try:
        split = two.generate(prompts, sampling, adapters=names)
    finally:
        two.engine.shutdown()
    whole = one.generate(prompts, sampling, adapters=names)
    oracle = Oracle(base, adapters)
    for prompt, name, out, ref in zip(prompts, names, split, whole, strict=True):
        assert out.token_ids == ref.token_ids == oracle.greedy(prompt, name, 8), f"{arch}, adapter {name}"
        assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


def test_quantized_shards_agree_with_one_quantized_rank(checkpoints, tp_adapters):
    """int8 weights and an fp8 KV cache on 2 ranks: each rank quantizes its own shard (a row-parallel shard's
    scales are its own columns' maxima, so the result is close to one rank's, not equal) and keeps fp8 pages."""
    config = {**CONFIG, "block_size": 16, "quantization": "int8", "kv_cache_dtype": "fp8"}  # fp8 pages hold
    # a quarter as many float32 adapter values
    one = LLM(checkpoints["llama"], **config)
    two = LLM(checkpoints["llama"], tensor_parallel_size=2, **config)
    try:
        for llm in (one, two):
            for name in ("qv", "mlp"):
                llm.add_adapter(name, tp_adapters[name])
        prompts = random_prompts(60, [4 + (i * 7) % 19 for i in range(8)])
        names = [[None, "qv", "mlp"][i % 3] for i in range(8)]
        result = agreement(one, two, prompts, names, max_tokens=12)
    finally:
        two.engine.shutdown()
    assert two.engine.memory.kv_dtype == torch.float8_e4m3fn
    assert result["tokens"] == 96 and result["agreement"] >= 0.95
    assert result["mean_abs_dlogprob"] < 0.02  # measured 0.011; a worker left unquantized agrees on 0.91 only


def test_speculative_verification_on_two_ranks_matches_peft(checkpoints, tp_adapters, oracle):
    """A draft model on rank 0 proposes, both ranks verify several tokens per sequence in one forward pass."""
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, speculative_method="draft",
              speculative_model=str(checkpoints["llama"]), num_speculative_tokens=3, **CONFIG)
    try:
        for name in ("qv", "pattern"):
            llm.add_adapter(name, tp_adapters[name])
        names = ["qv", None, "pattern", "qv"]
        prompts = random_prompts(70, [5, 11, 3, 16])
        outputs = llm.generate(prompts, GREEDY, adapters=names)
        accepted = llm.engine.speculation_state()["accepted_tokens"]
    finally:
        llm.engine.shutdown()
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        assert out.token_ids == oracle.greedy(prompt, name, GREEDY.max_tokens), f"adapter {name}"
    assert accepted > 0


def test_shards_are_halves(engines):
    one, two = (llm.engine for llm in engines)
    assert two.memory.chunk * 2 == one.memory.chunk  # one of the two KV heads per rank
    qkv = two.runner.model.model.layers[0].self_attn.qkv_proj.base
    assert qkv.out_slices == [32, 16, 16]  # 2 of 4 heads, 1 of 2 KV heads, head_dim 16
    assert two.state()["tensor_parallel_size"] == 2


def test_heads_must_divide(checkpoints, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"attention heads \(4\), key/value heads \(2\) and intermediate size \(96\);"
                                         r" it does not divide the attention heads nor the key/value heads"):
        LLMEngine(EngineConfig(model=str(checkpoints["llama"]), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model=str(checkpoints["llama"]), tensor_parallel_size=0)
    monkeypatch.setenv("QUILT_ENGINE_TOKEN", "t")
    assert cli_main(["--model", str(checkpoints["llama"]), "--tensor-parallel-size", "3"]) == 2
    assert "invalid engine configuration: tensor_parallel_size 3 must divide" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_adapter_files_changed_after_rank0_read_them(checkpoints, tp_adapters, oracle, tmp_path):
    """Rank 0 reads an adapter once and every rank uses those bytes: files replaced or removed after rank 0 read
    them change nothing, even for a worker slow to get there (a busy machine). An adapter rank 0 cannot read fails
    its own requests only."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), tensor_parallel_size=2, **CONFIG))
    worker = engine.workers.processes[0].pid
    replaced = shutil.copytree(tp_adapters["qv"], tmp_path / "replaced")
    removed = shutil.copytree(tp_adapters["mlp"], tmp_path / "removed")
    try:
        os.kill(worker, signal.SIGSTOP)  # the worker is slow ...
        resume = threading.Timer(2.0, os.kill, (worker, signal.SIGCONT))
        resume.start()
        digests = {"replaced": engine.add_adapter(replaced), "removed": engine.add_adapter(removed)}
        shutil.rmtree(replaced)  # ... and meanwhile the files change: another adapter under the same path
        shutil.copytree(tp_adapters["all1"], replaced)
        shutil.rmtree(removed)
        resume.join()
        missing = "f" * 64
        engine.register_adapter(missing, tmp_path / "never-written")  # read lazily, by rank 0 alone
        prompts = random_prompts(80, [6, 11, 4, 9])
        names = ["replaced", None, "removed", "missing"]
        for i, (prompt, name) in enumerate(zip(prompts, names, strict=True)):
            engine.add_request(f"r{i}", prompt, GREEDY, adapter=digests.get(name, missing if name else None))
        final = {}
        deadline = time.monotonic() + 120
        while engine.has_unfinished() and time.monotonic() < deadline:
            final.update({o.request_id: o for o in engine.step() if o.finished})
            time.sleep(0.001)
        assert engine.failure() is None
    finally:
        engine.shutdown()
    assert final["r3"].finish_reason == "error" and "could not be loaded" in final["r3"].error
    for i, adapter in enumerate(["qv", None, "mlp"]):
        assert final[f"r{i}"].token_ids == oracle.greedy(prompts[i], adapter, GREEDY.max_tokens), names[i]


def kill_after_steps(engine: LLMEngine, steps: int) -> threading.Thread:
    def kill():
        deadline = time.monotonic() + 60
        while engine.num_steps < steps and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(engine.workers.processes[0].pid, signal.SIGKILL)
    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(120)
def test_killed_rank_fails_requests_and_health(checkpoints):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), tensor_parallel_size=2, **CONFIG))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    app = build_app(EngineAPI(loop, registry=AdapterRegistry(loop, store=None), model_name="tiny",
                              drain_timeout_s=1.0), token="t")
    auth = {"Authorization": "Bearer t"}
    body = {"prompt_token_ids": [7, 8, 9, 10], "stream": False,
            "sampling": {"temperature": 0, "max_tokens": 240, "ignore_eos": True}}
    worker = engine.workers.processes[0]
    with TestClient(app) as client:
        short = client.post("/v1/generate", json={**body, "sampling": {"max_tokens": 3}}, headers=auth).json()
        assert short["finish_reason"] == "length" and client.get("/v1/health", headers=auth).status_code == 200
        killer = kill_after_steps(engine, engine.num_steps + 5)
        started = time.monotonic()
        answer = client.post("/v1/generate", json=body, headers=auth).json()
        killer.join()
        assert time.monotonic() - started < 30  # an error, not a hang
        assert answer["finish_reason"] == "error"
        assert "tensor-parallel rank 1" in answer["error"] and "killed by signal 9" in answer["error"]
        assert 0 < len(answer["token_ids"]) < 240
        health = client.get("/v1/health", headers=auth)
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        again = client.post("/v1/generate", json=body, headers=auth)  # refused at once, same reason
        assert again.status_code == 503 and "rank 1" in again.json()["error"]["message"]
    assert not worker.is_alive()
    with pytest.raises(RankFailed, match="rank 1"):
        engine.add_request("late", [5, 6], GREEDY)
        engine.step()


@pytest.mark.timeout(120)
def test_killed_engine_leaves_no_orphan_worker(checkpoints, tmp_path):
    """Rank 0 killed outright (no cleanup of its own runs): its worker sees the pipe close and exits."""
    script = textwrap.dedent(f"""
        import os
        from engine import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(checkpoints["llama"])!r}, tensor_parallel_size=2, block_size=4, num_kv_blocks=16)
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
            print(llm.engine.workers.processes[0].pid, flush=True)
            os.kill(os.getpid(), 9)
    """)
    path = tmp_path / "tp_orphan.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=90)
    assert run.returncode == -9 and run.stdout.strip(), run.stdout + run.stderr[-2000:]
    pid = int(run.stdout.split()[0])
    assert wait_gone(pid, 10.0), f"worker {pid} outlived rank 0"


def test_benchmark_smoke(capsys):
    """benchmarks/tensor_parallel.py runs at tp 1 and 2, times the collectives, and finds the same tokens."""
    tensor_parallel.main(["--smoke"])
    printed = capsys.readouterr().out
    decode = next(line for line in printed.splitlines() if line.startswith("| 2 | decode |"))
    assert "(4)" in decode  # 2 layers, 2 all-reduces each, per step
    assert "identical across sizes: yes" in printed


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX":  # exited, not yet reaped
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False
