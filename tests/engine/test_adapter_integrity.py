"""A stored adapter is checked on every read from disk, even when the engine knows its digest: a file whose bytes
changed after it was stored fails its own requests (adapter_unavailable), sits in no memory tier, and is read
again on the next request; other adapters and the base model keep serving, as transformers + PEFT do."""

import json
import struct

import pytest

import adapters
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.conftest import Oracle, build_adapter, random_prompts, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"


def flip_last_byte(data: bytearray) -> None:
    data[-1] ^= 0xFF


def flip_mid_tensor(data: bytearray) -> None:
    """One byte in the middle of the data of the tensor stored first (a lora_A, by name order)."""
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_size])
    header.pop("__metadata__", None)
    begin, end = min(entry["data_offsets"] for entry in header.values())
    data[8 + header_size + (begin + end) // 2] ^= 0x40


FLIPS = {"end-of-file": flip_last_byte, "mid-tensor": flip_mid_tensor}


def drop_checksums(path) -> None:
    """The sidecar as Quilt wrote it before it kept checksums: the digest is recomputed on each read instead."""
    sidecar = json.loads((path / "quilt_adapter.json").read_text())
    del sidecar["checksums"]
    (path / "quilt_adapter.json").write_text(json.dumps(sidecar))


@pytest.fixture(scope="module")
def peft_dirs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    return {
        "good": build_adapter(checkpoints["llama"], root / "good", seed=70, r=4, targets=TARGETS),
        "flipped": build_adapter(checkpoints["llama"], root / "flipped", seed=71, r=8, targets=TARGETS),
    }


@pytest.fixture(scope="module")
def oracle(checkpoints, peft_dirs):
    return Oracle(checkpoints["llama"], peft_dirs)


def stored(engine: LLMEngine, peft_dir, out) -> tuple[str, object]:
    """The adapter as the control plane stores it (the canonical folder), and the digest it is registered by."""
    adapter = adapters.load_adapter(peft_dir, engine.hf_config)
    return adapter.digest, adapter.save(out)


@pytest.mark.parametrize("sidecar", ["checksums", "old"])
@pytest.mark.parametrize("flip", list(FLIPS))
def test_a_stored_file_with_flipped_bytes_fails_only_its_requests(checkpoints, peft_dirs, oracle, tmp_path, flip,
                                                                  sidecar):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    good_digest, good_path = stored(engine, peft_dirs["good"], tmp_path / "good")
    bad_digest, bad_path = stored(engine, peft_dirs["flipped"], tmp_path / "flipped")
    if sidecar == "old":
        drop_checksums(bad_path)
    weights = bad_path / WEIGHTS
    intact = weights.read_bytes()
    data = bytearray(intact)
    FLIPS[flip](data)
    weights.write_bytes(data)
    engine.register_adapter(good_digest, good_path)
    engine.register_adapter(bad_digest, bad_path)
    prompts = random_prompts(72, [6, 5, 7, 4])
    engine.add_request("bad", prompts[0], GREEDY, adapter=bad_digest)
    engine.add_request("bad-too", prompts[3], GREEDY, adapter=bad_digest)
    engine.add_request("good", prompts[1], GREEDY, adapter=good_digest)
    engine.add_request("base", prompts[2], GREEDY)
    outputs = run_all(engine)
    for request_id in ("bad", "bad-too"):
        bad = outputs[request_id]
        assert (bad.finish_reason, bad.error_type, bad.token_ids) == ("error", "adapter_unavailable", []), bad
        assert bad.error.startswith(f"adapter {bad_digest[:12]} could not be loaded: ")
        assert str(tmp_path) not in bad.error
    assert outputs["good"].token_ids == oracle.greedy(prompts[1], "good", 4)
    assert outputs["base"].token_ids == oracle.greedy(prompts[2], None, 4)
    pool = engine.adapter_pool
    assert bad_digest not in pool.resident()["host"] and bad_digest not in pool.resident()["device"]
    # the next request reads the file again: still corrupt, it fails again; repaired, it serves
    engine.add_request("bad-again", prompts[0], GREEDY, adapter=bad_digest)
    assert run_all(engine)["bad-again"].error_type == "adapter_unavailable"
    weights.write_bytes(intact)
    engine.add_request("repaired", prompts[0], GREEDY, adapter=bad_digest)
    assert run_all(engine)["repaired"].token_ids == oracle.greedy(prompts[0], "flipped", 4)
    engine.block_manager.check_invariants([])


def test_a_file_corrupted_after_it_served_is_caught_when_read_again(checkpoints, peft_dirs, oracle, tmp_path):
    """Evicted from memory, then changed on disk (bit rot, a bad copy): the next read refuses it."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    digest, path = stored(engine, peft_dirs["flipped"], tmp_path / "flipped")
    engine.register_adapter(digest, path)
    prompt = random_prompts(73, [5])[0]
    expected = oracle.greedy(prompt, "flipped", 4)
    engine.add_request("first", prompt, GREEDY, adapter=digest)
    assert run_all(engine)["first"].token_ids == expected
    assert "host" in engine.evict_adapter(digest)
    data = bytearray((path / WEIGHTS).read_bytes())
    flip_mid_tensor(data)
    (path / WEIGHTS).write_bytes(data)
    engine.add_request("second", prompt, GREEDY, adapter=digest)
    engine.add_request("base", prompt, GREEDY)
    outputs = run_all(engine)
    assert outputs["second"].error_type == "adapter_unavailable"
    assert outputs["base"].token_ids == oracle.greedy(prompt, None, 4)
