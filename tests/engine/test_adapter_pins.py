"""Pins: an adapter pinned always-warm stays in its tier under pressure that evicts unpinned adapters, and its tokens
are still transformers + PEFT's; a pin that the tier's budget cannot hold is refused, with the numbers, and evicts
nothing; `/v1/state`, `/metrics` and the pool say the same of pins; the HTTP API answers a refused pin with an
OpenAI-shaped 409."""

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import adapters
from engine import SamplingParams
from engine.adapter_pool import PinRefused
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.server.adapter_registry import AdapterRegistry
from engine.server.app import EngineAPI, build_app
from engine.server.engine_loop import EngineLoop
from engine.server.metrics import EngineMetrics
from tests.engine.conftest import Oracle, build_adapter, random_prompts

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
NAMES = ("pinned", "one", "two", "three")
AUTH = {"Authorization": "Bearer t"}


@pytest.fixture(scope="module")
def stored(checkpoints, tmp_path_factory):
    """name -> (digest, canonical folder, PEFT folder): four adapters of one size, rank 8 on every projection."""
    root, base = tmp_path_factory.mktemp("pins"), checkpoints["llama"]
    base_config = json.loads((base / "config.json").read_text())
    out = {}
    for seed, name in enumerate(NAMES):
        peft_dir = build_adapter(base, root / f"peft-{name}", seed=70 + seed, r=RANK, targets=ALL)
        adapter = adapters.load_adapter(peft_dir, base_config)
        out[name] = adapter.digest, adapter.save(root / name), peft_dir
    return out


def small_engine(checkpoints, **config) -> LLMEngine:
    """Pages for two adapters of rank 8 (the pins' device budget) on top of 8 KV blocks: two or three adapters
    resident at most, so a fourth evicts one."""
    return LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=8,
                                  max_adapter_rank=RANK, pool_adapters_at_max_rank=2, **config))


def run(engine: LLMEngine, request_id: str, prompt: list[int], adapter: str, max_tokens: int = 3) -> list[int]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, greedy, adapter=adapter)
    tokens = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                tokens = list(out.token_ids)
        time.sleep(0.001)
    return tokens


def in_host(engine: LLMEngine, digest: str) -> None:
    engine.prefetch_adapter(digest, "host")  # starts its read
    while engine.adapter_pool.tier(digest) == "loading":
        time.sleep(0.002)


def test_a_pinned_adapter_survives_pressure_that_evicts_unpinned_ones(checkpoints, stored):
    engine = small_engine(checkpoints)
    pool = engine.adapter_pool
    digests = {name: digest for name, (digest, *_) in stored.items()}
    for digest, folder, _ in stored.values():
        engine.register_adapter(digest, folder)
    in_host(engine, digests["pinned"])
    assert pool.pages_to_place(digests["pinned"]) * 2 == pool.pin_pages  # the budget holds two such adapters
    assert engine.pin_adapter(digests["pinned"], "device") == ["device", "host"]

    prompts = random_prompts(71, [5, 4, 6, 5, 4, 6])
    outputs = {}
    for index, name in enumerate(["one", "two", "three", "one", "two", "three"]):  # three unpinned adapters through the rest
        outputs[(name, index)] = run(engine, f"{name}{index}", prompts[index], digests[name])
        assert pool.tier(digests["pinned"]) == "device"
    assert pool.num_evictions["device"] >= 3  # the others were evicted for each other
    pinned_tokens = run(engine, "pinned", prompts[0], digests["pinned"])
    assert pool.num_loads["device"] >= 4 and pool.tier(digests["pinned"]) == "device"
    with pytest.raises(RuntimeError, match="pinned in the device tier"):
        engine.evict_adapter(digests["pinned"])

    oracle = Oracle(checkpoints["llama"], {name: peft_dir for name, (_, _, peft_dir) in stored.items()})
    assert pinned_tokens == oracle.greedy(prompts[0], "pinned", 3)
    for (name, index), tokens in outputs.items():
        assert tokens == oracle.greedy(prompts[index], name, 3), (name, index)

    assert engine.unpin_adapter(digests["pinned"]) == "device"
    assert engine.evict_adapter(digests["pinned"])[0] == "device"  # evictable once unpinned
    engine.shutdown()


def test_a_pin_that_does_not_fit_is_refused_and_evicts_nothing(checkpoints, stored):
    digests = {name: digest for name, (digest, *_) in stored.items()}
    engine = small_engine(checkpoints)
    pool = engine.adapter_pool
    for digest, folder, _ in stored.values():
        engine.register_adapter(digest, folder)
        in_host(engine, digest)
    one = pool.state()["host_bytes"] // 4  # each adapter's bytes in host memory (all of one size)

    engine.pin_adapter(digests["one"], "device")
    engine.pin_adapter(digests["two"], "device")
    resident, evictions = pool.resident()["device"], pool.num_evictions["device"]
    with pytest.raises(PinRefused, match=f"device pins would hold .* the pool has {pool.pin_pages} pages"):
        engine.pin_adapter(digests["three"], "device")
    assert pool.resident()["device"] == resident and pool.num_evictions["device"] == evictions
    assert pool.pins() == {digests["one"]: "device", digests["two"]: "device"}
    engine.shutdown()

    engine = small_engine(checkpoints, host_adapter_cache_bytes=one * 5 // 2)  # room for two pins, not three
    pool = engine.adapter_pool
    for digest, folder, _ in stored.values():
        engine.register_adapter(digest, folder)
    for name in ("three", "pinned"):
        in_host(engine, digests[name])
        engine.pin_adapter(digests[name], "host")
    in_host(engine, digests["one"])
    with pytest.raises(PinRefused, match=f"host pins would hold {one * 3} bytes .* holds {one * 5 // 2}"):
        engine.pin_adapter(digests["one"], "host")
    in_host(engine, digests["two"])  # an unpinned newcomer evicts the unpinned, never the pinned
    assert set(pool.resident()["host"]) == {digests["three"], digests["pinned"], digests["two"]}
    assert pool.pins() == {digests["three"]: "host", digests["pinned"]: "host"}

    # on the device only (its host copy let go): a host pin reads it from disk again, then takes it
    assert engine.unpin_adapter(digests["three"]) == "host"
    engine.prefetch_adapter(digests["two"], "device")
    in_host(engine, digests["one"])  # evicts the least recently used unpinned host copy: "two"'s
    assert pool.tier(digests["two"]) == "device" and digests["two"] not in pool.resident()["host"]
    with pytest.raises(RuntimeError, match="not in host memory yet"):
        engine.pin_adapter(digests["two"], "host")
    while pool.is_loading(digests["two"]):
        time.sleep(0.002)
    assert engine.pin_adapter(digests["two"], "host") == ["device", "host"]
    assert pool.pins() == {digests["two"]: "host", digests["pinned"]: "host"}
    engine.shutdown()


def scrape(client: TestClient) -> set[tuple[str, str, str]]:
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics", headers=AUTH).text)}
    return {(s.labels["adapter"], s.labels["tier"], s.labels["pinned"])
            for s in families["quilt_engine_adapter_resident"].samples if s.value == 1}


def test_pins_over_http_agree_with_state_and_metrics(checkpoints, stored):
    engine = small_engine(checkpoints)
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    registry = AdapterRegistry(loop, store=None)
    app = build_app(EngineAPI(loop, registry=registry, model_name="tiny", drain_timeout_s=1.0), token="t")
    ref = {name: {"digest": digest, "path": str(folder)} for name, (digest, folder, _) in stored.items()}
    with TestClient(app) as client:
        for name in ("one", "two"):
            answer = client.post("/v1/adapters/pin", json={**ref[name], "tier": "gpu"}, headers=AUTH)
            assert answer.status_code == 200 and answer.json()["resident"] == ["gpu", "host"], answer.text
        answer = client.post("/v1/adapters/pin", json={**ref["three"], "tier": "gpu"}, headers=AUTH)
        assert answer.status_code == 409
        error = answer.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("conflict_error", "pin_refused", "tier")
        assert "device pins would hold" in error["message"]
        answer = client.post("/v1/adapters/pin", json={**ref["three"], "tier": "host"}, headers=AUTH)
        assert answer.status_code == 200, answer.text
        assert client.delete(f"/v1/adapters/{ref['one']['digest']}", headers=AUTH).status_code == 409  # pinned

        state = client.get("/v1/state", headers=AUTH).json()["adapters"]
        assert state["pinned"] == {ref["one"]["digest"]: "device", ref["two"]["digest"]: "device",
                                   ref["three"]["digest"]: "host"}
        pins = {digest[:12]: tier for digest, tier in state["pinned"].items()}
        expected = {(d[:12], "device", str(pins.get(d[:12]) == "device").lower()) for d in state["gpu"]} | \
            {(d[:12], "host", str(pins.get(d[:12]) == "host").lower()) for d in state["host"]}
        assert scrape(client) == expected
        assert (ref["one"]["digest"][:12], "device", "true") in expected
        assert (ref["three"]["digest"][:12], "host", "true") in expected

        answer = client.post("/v1/adapters/unpin", json={"digest": ref["one"]["digest"]}, headers=AUTH)
        assert answer.json() == {"digest": ref["one"]["digest"], "unpinned": "gpu"}
        assert (ref["one"]["digest"][:12], "device", "false") in scrape(client)
        assert client.post("/v1/adapters/unpin", json={"digest": "x"}, headers=AUTH).status_code == 400
        assert client.post("/v1/adapters/pin", json={**ref["one"], "tier": "disk"}, headers=AUTH).status_code == 400
