"""An adapter the engine cannot read fails its own requests only, names the adapter and no server path,
takes no pages, and leaves the engine serving everyone else (in Quilt's stored format and PEFT's)."""

import json

import pytest
import safetensors.torch
import torch

import adapters
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.conftest import Oracle, build_adapter, random_prompts, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def good(checkpoints, tmp_path_factory):
    return build_adapter(checkpoints["llama"], tmp_path_factory.mktemp("faults") / "good", seed=50, r=4,
                         targets=TARGETS)


@pytest.fixture(scope="module")
def other(checkpoints, tmp_path_factory):
    """The adapter the faults are made of (not the good one: its digest must differ)."""
    return build_adapter(checkpoints["llama"], tmp_path_factory.mktemp("faults") / "other", seed=53, r=3,
                         targets=["q_proj", "v_proj", "down_proj"])


def stored(adapter_dir, base_config, out):
    """The adapter in Quilt's stored (canonical) format."""
    return adapters.load_adapter(adapter_dir, base_config).save(out)


def wrong_shape_stored(adapter_dir, base_config, out):
    """A valid stored adapter whose q_proj A has the wrong input width for this base (digest made to match)."""
    adapter = adapters.load_adapter(adapter_dir, base_config)
    tensors = dict(adapter.tensors)
    tensors["layers.0.q_proj.lora_A"] = torch.randn(adapter.ranks["layers.0.q_proj"], 32)
    ranks = dict(adapter.ranks)
    alphas = {name: adapter.config["alphas"][name] for name in ranks}
    return adapters.LoadedAdapter.build(tensors=tensors, ranks=ranks, alphas=alphas, scaling=dict(adapter.scaling),
                                        alpha=adapter.alpha, use_rslora=False, base_model_name_or_path=None).save(out)


def wrong_shape_peft(adapter_dir, base_config, out):
    """A PEFT folder whose v_proj B has the wrong output width."""
    out.mkdir()
    (out / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    tensors = safetensors.torch.load_file(adapter_dir / "adapter_model.safetensors")
    key = next(k for k in tensors if "v_proj.lora_B" in k)
    tensors[key] = torch.randn(48, tensors[key].shape[1])
    safetensors.torch.save_file(tensors, out / "adapter_model.safetensors")
    return out


def deleted_weights(adapter_dir, base_config, out):
    path = stored(adapter_dir, base_config, out)
    (path / "adapter_model.safetensors").unlink()
    return path


def corrupt_stored(adapter_dir, base_config, out):
    path = stored(adapter_dir, base_config, out)
    (path / "adapter_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}")
    return path


FAULTS = {
    "wrong-shape-stored": (wrong_shape_stored, "shape"),
    "wrong-shape-peft": (wrong_shape_peft, "shape"),
    "deleted-weights-file": (deleted_weights, ""),
    "corrupt-stored": (corrupt_stored, ""),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_unreadable_adapter_fails_only_its_requests(checkpoints, good, other, tmp_path, fault):
    make, words = FAULTS[fault]
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    bad_path = make(other, engine.hf_config, tmp_path / fault)
    sidecar = bad_path / "quilt_adapter.json"
    bad_digest = json.loads(sidecar.read_text())["digest"] if sidecar.exists() else "ab" * 32
    engine.register_adapter(bad_digest, bad_path)
    good_digest = engine.add_adapter(good)
    prompts = random_prompts(51, [6, 5, 7])
    engine.add_request("bad", prompts[0], GREEDY, adapter=bad_digest)
    engine.add_request("good", prompts[1], GREEDY, adapter=good_digest)
    engine.add_request("base", prompts[2], GREEDY)
    outputs = run_all(engine)
    bad = outputs["bad"]
    assert bad.finish_reason == "error" and bad.error_type == "adapter_unavailable" and bad.token_ids == []
    assert bad.error.startswith(f"adapter {bad_digest[:12]} could not be loaded: ") and words in bad.error
    assert str(tmp_path) not in bad.error and "/tmp" not in bad.error and fault not in bad.error
    oracle = Oracle(checkpoints["llama"], {"good": good})
    assert outputs["good"].token_ids == oracle.greedy(prompts[1], "good", 4)
    assert outputs["base"].token_ids == oracle.greedy(prompts[2], None, 4)
    # nothing held for the failed adapter: only the good one's pages are taken, the rest is free
    bm = engine.block_manager
    assert engine.adapter_pool.tier(bad_digest) == "failed" and bad_digest not in engine.adapter_pool.resident()["host"]
    assert bm.num_free_blocks + len(bm.adapter_pages) == bm.num_blocks
    assert len(bm.adapter_pages) == engine.adapter_pool.plan(adapters.load_adapter(good, engine.hf_config)).num_pages
    bm.check_invariants([])


def test_a_loader_exception_is_contained(checkpoints, good, tmp_path, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    path = stored(good, engine.hf_config, tmp_path / "stored")
    digest = json.loads((path / "quilt_adapter.json").read_text())["digest"]

    def explode(directory, **_):
        raise KeyError(f"internal state at {directory}")

    monkeypatch.setattr(adapters, "load_canonical", explode)  # any exception inside the loader
    engine.register_adapter(digest, path)
    prompts = random_prompts(52, [5, 6])
    engine.add_request("bad", prompts[0], GREEDY, adapter=digest)
    engine.add_request("base", prompts[1], GREEDY)
    outputs = run_all(engine)
    assert outputs["bad"].error == f"adapter {digest[:12]} could not be loaded: the loader failed (KeyError)"
    assert outputs["base"].finish_reason == "length"
    monkeypatch.undo()  # registered again (e.g. after a fix), the same adapter loads and serves
    engine.register_adapter(digest, path)
    engine.add_request("again", prompts[0], GREEDY, adapter=digest)
    assert run_all(engine)["again"].finish_reason == "length"
