"""Disaggregated prefill and decode with every op on its Triton launcher (Triton's interpreter on CPU tensors): two
engines in one process, each behind its own server, the blocks moving over NIXL (float32) and over TCP (an fp8 KV
cache); greedy tokens equal transformers + PEFT's with mixed adapters, and with fp8 the colocated run's."""

import contextlib
import json

import pytest
from starlette.testclient import TestClient

import adapters
import kernels
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.adapter_registry import AdapterRegistry
from engine.server.app import EngineAPI, build_app
from engine.server.engine_loop import EngineLoop
from engine.server.kv_transfer import KVTransfers
from engine.server.metrics import EngineMetrics
from tests.engine.conftest import Oracle, build_adapter, random_prompts

AUTH = {"Authorization": "Bearer t"}
MAX_TOKENS = 3


@contextlib.contextmanager
def served(base, name: str, backend: str, **config):
    engine = LLMEngine(EngineConfig(model=str(base), num_kv_blocks=24, **config))  # the smallest block that fits
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    kv = KVTransfers(loop, engine_id=name, host="127.0.0.1", advertise_host="127.0.0.1", shm=False, timeout_s=60,
                     backend=backend)
    api = EngineAPI(loop, registry=AdapterRegistry(loop, store=None), model_name="tiny", drain_timeout_s=1.0, kv=kv)
    with TestClient(build_app(api, token="t")) as client:
        yield client, engine


def generate(client, prompt, adapter, tenant, **extra) -> dict:
    body = {"prompt_token_ids": prompt, "adapter": adapter, "tenant": tenant, "stream": False,
            "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}} | extra
    response = client.post("/v1/generate", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(("kv_cache_dtype", "backend"), [("auto", "nixl"), ("fp8", "tcp")])
def test_disaggregated_on_the_triton_launchers(checkpoints, tmp_path, triton_launchers, kv_cache_dtype, backend):
    if backend == "nixl":
        pytest.importorskip("nixl_cu12")
    base = checkpoints["llama"]
    paths = {"kv": build_adapter(base, tmp_path / "kv", seed=90, r=4, targets=["k_proj", "v_proj", "o_proj"])}
    config = json.loads((base / "config.json").read_text())
    refs = {"kv": {"digest": adapters.load_adapter(paths["kv"], config).digest, "path": str(paths["kv"])}, None: None}
    names = ["kv", None]
    prompts = random_prompts(91, [37, 19])
    with served(base, "p", backend, kv_cache_dtype=kv_cache_dtype) as (prefill, p_engine), \
            served(base, "d", backend, kv_cache_dtype=kv_cache_dtype) as (decode, d_engine):
        assert kernels.backend_for(d_engine.memory.layers[0]) == "triton"
        block = d_engine.config.block_size
        results = []
        for prompt, name in zip(prompts, names, strict=True):
            lease = generate(prefill, prompt, refs[name], "t", kv_transfer={"mode": "prefill"})["kv_lease"]
            assert lease["num_blocks"] == len(prompt) // block
            assert bool(lease["transport"]["nixl"]) == (backend == "nixl")
            answer = generate(decode, prompt, refs[name], "t", kv_transfer={"mode": "decode", "lease": lease})
            assert answer["usage"]["kv_transfer"]["blocks_pulled"] == (len(prompt) - 1) // block
            assert answer["usage"]["kv_transfer"]["recomputed"] is False
            results.append((answer["token_ids"], generate(decode, prompt, refs[name], "colocated")["token_ids"]))
        for engine in (p_engine, d_engine):
            engine.block_manager.check_invariants([])
            assert not engine.block_manager.held
    for (disaggregated, colocated), prompt, name in zip(results, prompts, names, strict=True):
        assert disaggregated == colocated
        if kv_cache_dtype == "auto":
            assert disaggregated == Oracle(base, paths).greedy(prompt, name, MAX_TOKENS)
