"""`python -m engine --kv-host-cache-gb`: a prefix pushed out of the page pool comes back from the host tier, and
/v1/state and /metrics count hits and misses per tier."""

import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.conftest import launch_engine_server, random_prompts, wait_until_healthy
from tests.engine.test_server import BROKER, TOKEN, generate

BLOCK_BYTES = 2048  # the llama test checkpoint at block_size 4


@pytest.fixture(scope="module")
def host_tier_server(checkpoints, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("kv-host-engine-log") / "engine.log"
    client = launch_engine_server(
        ["--model", str(checkpoints["llama"]), "--broker-url", BROKER,
         "--usage-queue", f"usage-kv-host-test-{uuid.uuid4().hex}", "--usage-spool", str(log_path.parent / "u.jsonl"),
         "--block-size", "4", "--num-kv-blocks", "12", "--pool-adapter-bytes", "0",
         "--kv-host-cache-gb", str(64 * BLOCK_BYTES / 2**30), "--log-level", "warning"],
        log_path=log_path, token=TOKEN)  # fmt: skip
    process = client.process
    try:
        wait_until_healthy(process, client, log_path)
        yield client
    finally:
        process.kill()
        process.wait()
        client.close()


def test_host_tier_hits_show_in_state_and_metrics(host_tier_server):
    sampling = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    prompt, *fillers = random_prompts(70, [15, 30, 30])
    first = generate(host_tier_server, tenant="t1", prompt_token_ids=prompt, sampling=sampling)
    for filler in fillers:
        generate(host_tier_server, tenant="t1", prompt_token_ids=filler, sampling=sampling)
    again = generate(host_tier_server, tenant="t1", prompt_token_ids=prompt, sampling=sampling)
    assert again["usage"]["cached_tokens"] == 12 and again["token_ids"] == first["token_ids"]
    state = host_tier_server.get("/v1/state").json()
    host = state["kv_tiers"]["host"]
    assert host["hits"] == 3 and host["capacity_blocks"] == 64 and host["blocks"] > 0 and host["loads_in_flight"] == 0
    assert state["kv_tiers"]["device"]["misses"] > 0 and state["kv_blocks_used"] == 0
    families = {f.name: f for f in text_string_to_metric_families(host_tier_server.get("/metrics").text)}
    lookups = {(s.labels["tier"], s.labels["result"]): s.value
               for s in families["quilt_engine_kv_tier_lookups"].samples if s.name.endswith("_total")}
    assert lookups[("host", "hit")] == 3 and lookups[("device", "miss")] > 0
    blocks = {s.labels["tier"]: s.value for s in families["quilt_engine_kv_tier_blocks"].samples}
    assert blocks["host"] > 0
