"""An LLM that is closed or dropped frees its model, KV pool and adapter pool (else, on an H200, the next
LLM in the same process runs out of memory). Weak references tell whether the tensors are gone."""

import gc
import threading
import weakref

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import build_adapter

SAMPLING = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model_and_adapter(checkpoints, tmp_path_factory):
    base = checkpoints["llama"]
    return base, build_adapter(base, tmp_path_factory.mktemp("lifetime") / "qv", seed=70, r=4,
                               targets=["q_proj", "v_proj"])


def _used_llm(base, adapter, **config) -> LLM:
    """An LLM that has run: an adapter read by the background loader and placed in pages, requests done."""
    llm = LLM(base, block_size=16, **({"num_kv_blocks": 32} | config))
    digest = llm.add_adapter("qv", adapter)
    llm.engine.register_adapter("0" * 64, adapter)  # a second name the loader thread reads (and refuses)
    llm.engine.adapter_pool.ready("0" * 64)
    llm.generate([[5, 6, 7], [8, 9]], SAMPLING, adapters=["qv", None])
    assert llm.engine.adapter_pool.tier(digest) == "device"
    return llm


def _loader(llm: LLM) -> threading.Thread:
    return llm.engine.adapter_pool._thread


def _weak_parts(llm: LLM) -> dict[str, weakref.ref]:
    engine = llm.engine
    return {
        "engine": weakref.ref(engine),
        "a model parameter": weakref.ref(next(engine.runner.model.parameters())),
        "the KV pool": weakref.ref(engine.memory.layers[0]),
        "the adapter pool": weakref.ref(engine.adapter_pool),
    }


def _alive(parts: dict[str, weakref.ref]) -> list[str]:
    return [name for name, ref in parts.items() if ref() is not None]


def test_close_frees_the_engine_while_the_llm_is_still_held(model_and_adapter):
    base, adapter = model_and_adapter
    llm = _used_llm(base, adapter)
    parts, loader = _weak_parts(llm), _loader(llm)
    llm.close()
    assert _alive(parts) == []  # refcounts alone: no gc.collect()
    assert not loader.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 6]], SAMPLING)
    llm.close()  # a second close does nothing


def test_a_dropped_llm_is_freed_by_reference_counting_alone(model_and_adapter):
    base, adapter = model_and_adapter
    gc.collect()
    gc.disable()  # a reference cycle would keep everything until the collector happened to run
    try:
        llm = _used_llm(base, adapter)
        parts, loader = _weak_parts(llm), _loader(llm)
        del llm
        assert _alive(parts) == []
    finally:
        gc.enable()
    loader.join(timeout=5)  # it ends on its own once its pool is gone
    assert not loader.is_alive()


def test_llm_as_a_context_manager_closes(model_and_adapter):
    base, adapter = model_and_adapter
    with LLM(base, block_size=16, num_kv_blocks=32) as llm:
        out = llm.generate([[5, 6, 7]], SAMPLING)
        parts = _weak_parts(llm)
    assert len(out[0].token_ids) == 3
    assert _alive(parts) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ending", ["close", "del"])
def test_cuda_memory_comes_back_after_an_llm(model_and_adapter, ending):
    """Each LLM sizes its page pool from a quarter of the free memory (the suite runs 4 test files at once); what
    it held comes back when it ends, so the second one finds as much as the first (on an H200 the second ran out
    of memory)."""
    base, adapter = model_and_adapter
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    for _ in range(2):
        llm = _used_llm(base, adapter, device="cuda", num_kv_blocks=None, kv_cache_memory_fraction=0.25)
        assert torch.cuda.memory_allocated() - baseline > 2**30  # the pool
        if ending == "close":
            llm.close()
        del llm
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - baseline < 2**20  # a few cached index tensors of the kernels
