"""Per-adapter residency in Prometheus metrics agrees with the adapter pool, read through its public API: one
`quilt_engine_adapter_resident` series per adapter and memory tier (pinned when pinned always-warm in that tier,
never merely because a running request uses it; its rank), gone once the adapter leaves the tier; a `quilt_engine_adapter_load_seconds` observation per move; a
`quilt_engine_adapter_wait_seconds` observation per request, from its arrival until its adapter is in memory; and
in /v1/state and the heartbeat, the mean time a request holds a slot (`request_seconds`), which routing weighs."""

import json
import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

import adapters
from engine import SamplingParams
from engine.config import EngineConfig
from engine.contract import state_read
from engine.llm_engine import LLMEngine
from engine.server.adapter_registry import AdapterRegistry
from engine.server.app import EngineAPI, build_app
from engine.server.engine_loop import EngineLoop
from engine.server.metrics import EngineMetrics
from tests.engine.conftest import build_adapter, random_prompts

RANKS = {"running": 4, "prefetched": 8, "host": 2}


@pytest.fixture(scope="module")
def stored(checkpoints, tmp_path_factory):
    """name -> (digest, canonical folder): each adapter as the control plane stores it."""
    root, base = tmp_path_factory.mktemp("metrics"), checkpoints["llama"]
    base_config = json.loads((base / "config.json").read_text())
    out = {}
    for seed, (name, rank) in enumerate(RANKS.items()):
        peft_dir = build_adapter(base, root / f"peft-{name}", seed=90 + seed, r=rank, targets=["q_proj", "down_proj"])
        adapter = adapters.load_adapter(peft_dir, base_config)
        out[name] = adapter.digest, adapter.save(root / name)
    return out


def scrape(metrics: EngineMetrics) -> dict:
    return {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}


def resident_series(metrics: EngineMetrics) -> set[tuple[str, str, str, str]]:
    return {(s.labels["adapter"], s.labels["tier"], s.labels["pinned"], s.labels["rank"])
            for s in scrape(metrics)["quilt_engine_adapter_resident"].samples if s.value == 1}


def expected_series(engine: LLMEngine, ranks: dict[str, int]) -> set[tuple[str, str, str, str]]:
    """What the pool's public API says: the digests in each memory tier and the tier each pin holds."""
    pool = engine.adapter_pool
    pins = pool.pins()
    return {(digest[:12], tier, str(pins.get(digest) == tier).lower(), str(ranks[digest]))
            for tier, digests in pool.resident().items() for digest in digests}


def load_counts(metrics: EngineMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["from_tier"], s.labels["to_tier"]): s.value
            for s in scrape(metrics)["quilt_engine_adapter_load_seconds"].samples if s.name.endswith("_count")}


def test_residency_metrics_agree_with_the_pool(checkpoints, stored):
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    metrics = EngineMetrics()
    digests = {name: digest for name, (digest, _) in stored.items()}
    ranks = {digests[name]: rank for name, rank in RANKS.items()}
    for name in ("running", "prefetched"):
        engine.register_adapter(*stored[name])
    assert engine.add_adapter(stored["host"][1]) == digests["host"]  # read now: host tier only
    engine.add_request("long", random_prompts(91, [5])[0], SamplingParams(max_tokens=200, ignore_eos=True),
                       adapter=digests["running"])
    while engine.adapter_pool.tier(digests["running"]) != "device":  # loaded in the background, then admitted
        engine.step()
    engine.prefetch_adapter(digests["prefetched"], "host")  # starts its load
    while engine.adapter_pool.tier(digests["prefetched"]) != "host":
        time.sleep(0.002)
    assert engine.prefetch_adapter(digests["prefetched"], "device") == ["device", "host"]
    metrics.observe_adapters(engine.adapter_pool)
    series = resident_series(metrics)
    assert series == expected_series(engine, ranks)
    assert (digests["running"][:12], "device", "false", "4") in series  # in use, not pinned
    assert (digests["prefetched"][:12], "device", "false", "8") in series
    assert (digests["host"][:12], "host", "false", "2") in series
    pool = engine.adapter_pool
    assert load_counts(metrics) == {("disk", "host"): pool.num_loads["host"], ("host", "device"): pool.num_loads["device"]}

    assert engine.evict_adapter(digests["prefetched"]) == ["device", "host"]
    engine.abort("long")
    engine.step()
    metrics.observe_adapters(pool)
    series = resident_series(metrics)
    assert series == expected_series(engine, ranks)
    assert not any(labels[0] == digests["prefetched"][:12] for labels in series)  # its series are gone
    assert (digests["running"][:12], "device", "false", "4") in series
    engine.pin_adapter(digests["running"], "device")
    metrics.observe_adapters(pool)
    assert (digests["running"][:12], "device", "true", "4") in resident_series(metrics)
    assert resident_series(metrics) == expected_series(engine, ranks)
    assert load_counts(metrics) == {("disk", "host"): pool.num_loads["host"], ("host", "device"): pool.num_loads["device"]}
    engine.shutdown()


def test_a_request_waits_for_its_adapter_until_it_is_in_memory(checkpoints, stored):
    """Known to the server but on disk only (as after an eviction from memory): the first request waits while the
    engine reads it, the second finds it in memory and waits 0."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    registry = AdapterRegistry(loop, store=None)
    digest, path = stored["host"]
    engine.register_adapter(digest, path)
    registry.known[digest] = path
    app = build_app(EngineAPI(loop, registry=registry, model_name="tiny", drain_timeout_s=1.0), token="t")
    body = {"prompt_token_ids": [7, 8, 9], "stream": False, "adapter": {"digest": digest, "path": str(path)},
            "sampling": {"temperature": 0, "max_tokens": 2, "ignore_eos": True}}
    with TestClient(app) as client:
        for _ in range(2):
            assert client.post("/v1/generate", json=body, headers={"Authorization": "Bearer t"}).status_code == 200
        families = {f.name: f for f in text_string_to_metric_families(
            client.get("/metrics", headers={"Authorization": "Bearer t"}).text)}
        state = client.get("/v1/state", headers={"Authorization": "Bearer t"}).json()
    samples = {(s.name.rsplit("_", 1)[-1], s.labels.get("le")): s.value
               for s in families["quilt_engine_adapter_wait_seconds"].samples}
    assert samples[("count", None)] == 2 and samples[("bucket", "0.0")] == 1 and samples[("sum", None)] > 0
    loads = {(s.labels["from_tier"], s.labels["to_tier"]): s.value
             for s in families["quilt_engine_adapter_load_seconds"].samples if s.name.endswith("_count")}
    assert loads[("disk", "host")] == 1 and loads[("host", "device")] == 1
    # /v1/state (and the heartbeat, for routing) carry each move's mean: here the one move of each kind observed
    sums = {(s.labels["from_tier"], s.labels["to_tier"]): s.value
            for s in families["quilt_engine_adapter_load_seconds"].samples if s.name.endswith("_sum")}
    means = state["adapters"]["load_seconds"]
    assert means.keys() == {"disk_host", "host_device"} and min(means.values()) > 0
    assert means["disk_host"] == pytest.approx(sums[("disk", "host")])
    assert means["host_device"] == pytest.approx(sums[("host", "device")])
    heartbeat = loop.state(model="tiny", prefixes=[])  # the heartbeat's state (the engine thread is stopped here)
    assert msgspec.to_builtins(heartbeat.adapters.load_seconds) == means


def test_state_and_heartbeat_carry_the_mean_time_a_request_holds_a_slot(checkpoints):
    """Routing weighs an engine's queue in seconds: each request ahead per slot holds it `request_seconds`, the time
    from a sequence's first step to its finish, measured here against the wall clock around the steps."""
    engine = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), block_size=4, num_kv_blocks=64))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    assert engine.state()["request_seconds"] is None and loop.state(model="tiny", prefixes=[]).request_seconds is None
    engine.add_request("one", random_prompts(92, [6])[0], SamplingParams(max_tokens=12, ignore_eos=True))
    before_first = time.monotonic()
    engine.step()
    after_first = time.monotonic()  # its first step began in between
    before_last = after_last = after_first
    while engine.has_unfinished():
        before_last = time.monotonic()
        engine.step()
        after_last = time.monotonic()  # it finished in the last step
    held = engine.state()["request_seconds"]
    assert before_last - after_first <= held <= after_last - before_first
    heartbeat = loop.state(model="tiny", prefixes=[])  # the heartbeat's state, the head of /v1/state's
    assert heartbeat.request_seconds == held and state_read(msgspec.to_builtins(heartbeat)).request_seconds == held

    engine.add_request("waits", random_prompts(93, [6])[0], SamplingParams(max_tokens=4))
    engine.abort("waits")  # never scheduled: it held no slot, and the mean is unchanged
    assert engine.state()["request_seconds"] == held
    engine.shutdown()
