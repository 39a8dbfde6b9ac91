"""The online engine: background adapter loading, failed loads, aborts and state."""

import shutil

import pytest

import adapters
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.conftest import Oracle, build_adapter, random_prompts, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(checkpoints, tmp_path_factory):
    root, base = tmp_path_factory.mktemp("online-adapters"), checkpoints["llama"]
    good = build_adapter(base, root / "good", seed=40, r=8, targets=["q_proj", "k_proj", "v_proj", "down_proj"])
    broken = root / "broken"
    shutil.copytree(good, broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    return {"good": good, "broken": broken}


def test_background_load_and_failed_load_fail_only_their_requests(checkpoints, adapter_dirs):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    config = engine.hf_config
    good_digest = adapters.load_adapter(adapter_dirs["good"], config).digest
    engine.register_adapter(good_digest, adapter_dirs["good"])
    engine.register_adapter("0" * 64, adapter_dirs["broken"])
    prompts = random_prompts(40, [5, 7, 3])
    engine.add_request("good", prompts[0], GREEDY, adapter=good_digest, tenant="a")
    engine.add_request("broken", prompts[1], GREEDY, adapter="0" * 64, tenant="b")
    engine.add_request("base", prompts[2], GREEDY, tenant="b")
    with pytest.raises(ValueError, match="not registered"):
        engine.add_request("unknown", prompts[2], GREEDY, adapter="f" * 64)
    outputs = run_all(engine)
    broken = outputs["broken"]
    assert broken.finish_reason == "error" and broken.error_type == "adapter_unavailable"
    assert broken.error.startswith("adapter 000000000000 could not be loaded: ") and "/" not in broken.error
    engine.add_request("broken-again", prompts[1], GREEDY, adapter="0" * 64, tenant="b")
    assert run_all(engine)["broken-again"].finish_reason == "error"
    oracle = Oracle(checkpoints["llama"], {"good": adapter_dirs["good"]})
    assert outputs["good"].token_ids == oracle.greedy(prompts[0], "good", 5)
    assert outputs["base"].token_ids == oracle.greedy(prompts[2], None, 5)
    state = engine.state()
    assert good_digest in state["adapters"]["device"] and "0" * 64 in state["adapters"]["failed"]
    assert state["kv_blocks_used"] == 0 and state["kv_blocks_free"] + state["adapter_pages"] == state["kv_blocks_total"]


def test_abort_frees_everything(checkpoints):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=32, max_num_seqs=2))
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(41, [9, 6, 12, 4])):
        engine.add_request(str(i), prompt, long, tenant="t")
    for _ in range(3):
        engine.step()
    assert engine.state()["running"] == 2 and engine.state()["waiting"] == 2
    for i in range(4):
        engine.abort(str(i))
    assert not engine.has_unfinished()
    engine.block_manager.check_invariants([])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and engine.step() == []


def test_abort_and_fail_all_return_final_outputs(checkpoints):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=32, max_num_seqs=1))
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=2)
    prompts = random_prompts(42, [5, 7, 4])
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, long)
    for _ in range(3):
        engine.step()
    aborted = engine.abort("0")
    assert sorted(o.index for o in aborted) == [0, 1] and all(o.finished and o.finish_reason == "abort" for o in aborted)
    assert engine.abort("0") == []
    failed = engine.fail_all("engine step failed")
    assert sorted((o.request_id, o.index) for o in failed) == [("1", 0), ("1", 1), ("2", 0), ("2", 1)]
    assert all(o.finish_reason == "error" and o.error == "engine step failed" for o in failed)
    assert not engine.has_unfinished() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_block_size_too_small_for_adapter_rows_is_refused_with_the_fix(checkpoints):
    # chunk = 2 tokens * 2 KV heads * 16 = 64 values; gate/up rows are 96 wide
    with pytest.raises(ValueError, match="use block_size 4 or more"):
        LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=2, num_kv_blocks=64))
