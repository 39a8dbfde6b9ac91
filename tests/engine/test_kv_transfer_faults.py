"""A source that fails halfway, stalls past the puller's timeout, or delivers a corrupted block, over each transport
(engine/kv/faults.py: `--kv-transfer-fault`). The decode engine recomputes every time, says why, and serves
transformers + PEFT's tokens; on both engines every lease ends and no page leaks. Over NIXL, a stalled source's late
write lands in landing slots that rest, never in pages a sequence reads."""

import pytest

from tests.engine import kv_engines as kv
from tests.engine.conftest import metric, random_prompts, wait_until_healthy

pytestmark = pytest.mark.slow
BACKENDS = ["nixl", "shm", "tcp"]
FAULTS = {"fail-halfway": "closed", "stall": "timeout", "corrupt": "payload"}  # fault -> the decode engine's reason


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A prefill engine per fault (each offers every transport: NIXL, shared memory, TCP) and a decode engine per
    backend."""
    pytest.importorskip("nixl_cu12")
    base, refs, oracle = kv.build_model(tmp_path_factory.mktemp("kv-faults"))
    engines = kv.Engines(base, tmp_path_factory.mktemp("kv-faults-logs"))
    sources = {fault: engines.launch(f"prefill-{fault}", "--role", "prefill", "--kv-transfer-fault", fault)
               for fault in FAULTS}
    pullers = {backend: engines.launch(f"decode-{backend}", "--role", "decode", "--kv-transfer-backend", backend)
               for backend in BACKENDS}
    for client in [*sources.values(), *pullers.values()]:
        wait_until_healthy(client.process, client, client.log_path)
    yield sources, pullers, refs, oracle
    engines.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_transfer_recomputes_and_never_serves_what_it_got(fleet, fault, backend):
    sources, pullers, refs, oracle = fleet
    source, decode = sources[fault], pullers[backend]
    block_size = decode.get("/v1/state").json()["block_size"]
    prompt = random_prompts(len(fault) * 7 + len(backend), [6 * block_size + 3])[0]
    before = metric(decode, "quilt_engine_kv_recomputes_total", reason=FAULTS[fault])
    lease = kv.prefill_hop(source, prompt, refs["a"], f"tenant-{backend}")
    answer = kv.decode_hop(decode, prompt, refs["a"], f"tenant-{backend}", lease)
    assert answer["usage"]["kv_transfer"]["recomputed"] is True
    assert answer["token_ids"] == oracle.greedy(prompt, "a", kv.MAX_TOKENS)
    assert metric(decode, "quilt_engine_kv_recomputes_total", reason=FAULTS[fault]) == before + 1
    assert metric(decode, "quilt_engine_kv_pulls_total", outcome="recomputed", via=backend) >= 1
    released = kv.leases_ended(source)["released"]
    assert sum(released.values()) == released.get("closed", 0) + released.get("released", 0) >= 1, released
    kv.pool_clean(source)
    kv.pool_clean(decode)
