"""Adapter cold start at the floor: the content digest is computed once, when an adapter is first
made known, never again on a load; the safetensors file is read into memory once, without a second copy; on
CUDA the host copy is laid out straight into pinned memory and placed on a side stream."""

import json

import pytest
import torch

import adapters
import adapters.loaded
from adapters.safetensors_check import read_tensors
from engine import LLM, SamplingParams
from engine.adapter_pool import read_adapter
from tests.engine.conftest import build_adapter

SAMPLING = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def canonical(checkpoints, tmp_path_factory):
    """A PEFT adapter converted once to Quilt's canonical folder (what the control plane stores at upload)."""
    root, base = tmp_path_factory.mktemp("cold-start"), checkpoints["llama"]
    peft_dir = build_adapter(base, root / "peft", seed=80, r=8, targets=ALL)
    loaded = adapters.load_adapter(peft_dir, json.loads((base / "config.json").read_text()))
    return base, loaded.save(root / "canonical"), loaded.digest


@pytest.fixture
def hashes(monkeypatch):
    """How many times an adapter's content digest is computed (the real function, counted)."""
    calls = []
    real = adapters.loaded.adapter_digest

    def counted(tensors, scaling):
        calls.append(len(tensors))
        return real(tensors, scaling)

    monkeypatch.setattr(adapters.loaded, "adapter_digest", counted)
    return calls


def _reload_from_disk(llm: LLM, digest: str, name: str | None) -> None:
    """Drop the adapter from both memory tiers, then run a request that needs it: the pool reads it again."""
    assert "host" in llm.engine.evict_adapter(digest)
    out = llm.generate([[5, 6, 7]], SAMPLING, adapters=[name])
    assert len(out[0].token_ids) == 2 and out[0].finish_reason == "length"


def test_add_adapter_hashes_once_and_reloads_never(canonical, hashes):
    base, path, digest = canonical
    llm = LLM(base, block_size=16, num_kv_blocks=32)
    assert llm.add_adapter("all", path) == digest  # made known by its path alone: the digest is computed here
    assert len(hashes) == 1
    llm.generate([[5, 6, 7]], SAMPLING, adapters=["all"])
    for _ in range(2):
        _reload_from_disk(llm, digest, "all")
    assert len(hashes) == 1
    llm.close()


def test_a_registered_digest_is_never_recomputed(canonical, hashes):
    """The control plane computed the digest at upload; the engine is told it and trusts the store's sidecar."""
    base, path, digest = canonical
    llm = LLM(base, block_size=16, num_kv_blocks=32)
    llm.engine.register_adapter(digest, path)
    llm.adapters["all"] = digest
    llm.generate([[5, 6, 7]], SAMPLING, adapters=["all"])
    _reload_from_disk(llm, digest, "all")
    assert hashes == []
    llm.close()


def test_a_registered_digest_the_sidecar_does_not_name_fails_that_adapter(canonical, hashes):
    base, path, _ = canonical
    with pytest.raises(adapters.AdapterError, match="digest") as refused:
        adapters.load_canonical(path, digest="f" * 64)
    assert refused.value.code == "digest_mismatch"
    assert hashes == []


def test_without_a_digest_the_content_is_hashed_and_checked(canonical):
    """load_canonical with no digest given verifies the content, as before (tests/adapters covers the cases)."""
    _, path, digest = canonical
    assert adapters.load_canonical(path).digest == digest


def test_read_tensors_copies_the_file_once(canonical):
    """Every tensor is a view of one buffer holding the file's data, in memory this process owns."""
    _, path, _ = canonical
    weights = path / "adapter_model.safetensors"
    tensors = read_tensors(weights)
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert len(storages) == 1
    size = next(iter(tensors.values())).untyped_storage().nbytes()
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    assert data <= size <= weights.stat().st_size


def test_a_load_allocates_the_file_and_the_layout_once(canonical):
    """Reading and laying out an adapter allocates, on the host, its file's bytes and its packed chunks, and not
    a second copy of either (torch's profiler counts every CPU allocation)."""
    base, path, digest = canonical
    base_config = json.loads((base / "config.json").read_text())
    llm = LLM(base, block_size=16, num_kv_blocks=32)
    plan_of = llm.engine.adapter_pool.plan
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        plan = plan_of(read_adapter(path, base_config, 64, digest=digest))
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    file_bytes = (path / "adapter_model.safetensors").stat().st_size
    assert allocated <= file_bytes + plan.num_bytes + 16 * 1024, (allocated, file_bytes, plan.num_bytes)
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_host_copy_is_pinned_and_placed_on_a_side_stream(canonical):
    base, path, digest = canonical
    with LLM(base, device="cuda", block_size=16, num_kv_blocks=64) as llm:
        llm.engine.register_adapter(digest, path)
        pool = llm.engine.adapter_pool
        pool.ready(digest)
        while pool.tier(digest) != "host":
            torch.cuda.synchronize()
        assert pool._host[digest].chunks.is_pinned()
        pool.place(digest)
        copy = pool._placing[digest].copy
        assert len(copy.layers) == 2  # an event per layer, recorded on the side stream
        copy.result()
        assert pool.ready(digest)
        llm.adapters["all"] = digest
        warm = llm.generate([[5, 6, 7]], SAMPLING, adapters=["all"])
        assert warm[0].finish_reason == "length"
