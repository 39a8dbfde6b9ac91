"""Loads never stall a step: an adapter read from a slow disk (the engine's own paced reader,
`adapter_read_bytes_per_second`, the setting a shared volume is served with) loads in the background from its
request's arrival, while the requests of a resident adapter keep stepping (several steps in the time of the read);
its request runs once it is resident.
Every token is transformers + PEFT's, with the torch launchers and with the Triton kernels under the interpreter."""

import json
import time

import pytest

import adapters
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.conftest import Oracle, build_adapter, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLD_READ_S = {"torch": 5.0, "triton-interpreter": 10.0}  # how long the paced read of the cold adapter's weights
# takes: several steps, even of interpreted kernels on a busy machine
HOT_TOKENS = 5


@pytest.fixture(scope="module")
def stored(checkpoints, tmp_path_factory):
    """hot: a small adapter; cold: rank 16 on every projection, ~40x its bytes. name -> (digest, canonical folder,
    PEFT folder, weights bytes)."""
    root, base = tmp_path_factory.mktemp("residency"), checkpoints["llama"]
    base_config = json.loads((base / "config.json").read_text())
    out = {}
    for name, seed, rank, targets in (("hot", 31, 2, ["q_proj"]), ("cold", 32, 16, ALL)):
        peft_dir = build_adapter(base, root / f"peft-{name}", seed=seed, r=rank, targets=targets)
        adapter = adapters.load_adapter(peft_dir, base_config)
        folder = adapter.save(root / name)
        out[name] = adapter.digest, folder, peft_dir, (folder / "adapter_model.safetensors").stat().st_size
    return out


@pytest.fixture(scope="module")
def oracle(checkpoints, stored):
    return Oracle(checkpoints["llama"], {name: peft_dir for name, (_, _, peft_dir, _) in stored.items()})


@pytest.mark.parametrize("launchers", ["torch", "triton-interpreter"])
def test_a_resident_adapter_keeps_stepping_while_a_slow_load_is_under_way(checkpoints, stored, oracle, launchers,
                                                                          request):
    if launchers == "triton-interpreter":
        request.getfixturevalue("triton_launchers")
    rate = int(stored["cold"][3] / COLD_READ_S[launchers])
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64,
                                    adapter_read_bytes_per_second=rate))
    digests = {name: digest for name, (digest, *_) in stored.items()}
    for digest, folder, _, _ in stored.values():
        engine.register_adapter(digest, folder)
    hot_prompt, cold_prompt, warm_prompt = random_prompts(33, [6, 5, 3])
    greedy = SamplingParams(temperature=0.0, max_tokens=HOT_TOKENS, ignore_eos=True)
    engine.add_request("warm", warm_prompt, SamplingParams(max_tokens=1), adapter=digests["hot"])
    while engine.has_unfinished():  # the hot adapter read (its few bytes) and placed
        engine.step()
        time.sleep(0.001)
    assert engine.adapter_pool.tier(digests["hot"]) == "device"

    engine.add_request("cold", cold_prompt, greedy, adapter=digests["cold"])
    assert engine.adapter_pool.tier(digests["cold"]) == "loading"  # from its arrival, before any step
    engine.add_request("hot", hot_prompt, greedy, adapter=digests["hot"])
    outputs, steps, started = {}, engine.num_steps, time.monotonic()
    while engine.adapter_pool.tier(digests["cold"]) == "loading":
        for out in engine.step():
            outputs[out.request_id] = out
        time.sleep(0.001)
    steps, read_s = engine.num_steps - steps, time.monotonic() - started
    hot_tokens = len(outputs["hot"].token_ids) if "hot" in outputs else 0
    # it kept decoding while the cold one loaded: several steps ran in the time of one read (a step that waited for
    # the read would have been the only one)
    assert hot_tokens >= 2 and steps >= 3 and "cold" not in outputs, (hot_tokens, steps, read_s)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
        time.sleep(0.001)
    load_times = engine.adapter_pool.take_load_times()
    assert max(t.seconds for t in load_times if t.from_tier == "disk") >= COLD_READ_S[launchers] * 0.9  # a slow disk
    assert {(t.from_tier, t.to_tier) for t in load_times} == {("disk", "host"), ("host", "device")}
    for name, prompt in (("hot", hot_prompt), ("cold", cold_prompt)):
        assert list(outputs[name].token_ids) == oracle.greedy(prompt, name, HOT_TOKENS), name
    engine.shutdown()
