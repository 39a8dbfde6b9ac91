"""Disaggregated prefill and decode with real engine processes that the tests start, stop and kill themselves
(docs/kv-tiers.md): a prefill hop leases a prompt's KV blocks, a decode hop pulls them and serves as a prefix hit.
The whole module runs once per transport: NIXL (over UCX's TCP transport, as on a machine without RDMA), shared
memory on this host, and TCP. Greedy tokens equal the colocated run's and transformers + PEFT's, with mixed
adapters and with an fp8 KV cache. When the prefill engine is killed mid-transfer, the transfer times out, the
client aborts during it, the adapter is promoted in between or the lease expired, the decode engine recomputes and
the tokens are still right; leases end on both sides and the pools' own counts show no block leaked."""

import concurrent.futures
import json
import signal
import socket

import pytest

from tests.engine.conftest import (
    metric,
    random_prompts,
    wait_until_healthy,
)
from tests.engine.kv_engines import (
    MAX_TOKENS,
    TOKEN,
    Engines,
    body,
    build_model,
    colocated,
    decode_hop,
    leases_ended,
    pool_clean,
    prefill_hop,
    wait_until,
)

pytestmark = pytest.mark.slow
BACKENDS = ["nixl", "shm", "tcp"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("kv-disagg"))


@pytest.fixture(scope="module", params=BACKENDS)
def engines(model, tmp_path_factory, request):
    """A prefill engine and a decode engine, started together, both with --kv-transfer-backend of the param (NIXL
    over UCX's TCP transport: what a machine without RDMA or GPUs uses)."""
    base, _, _ = model
    if request.param == "nixl":
        pytest.importorskip("nixl_cu12")
    fleet = Engines(base, tmp_path_factory.mktemp(f"kv-disagg-{request.param}-logs"), backend=request.param)
    prefill = fleet.launch("prefill", "--role", "prefill")
    decode = fleet.launch("decode", "--role", "decode")
    for client in (prefill, decode):
        wait_until_healthy(client.process, client, client.log_path)
    fleet.prefill, fleet.decode = prefill, decode
    yield fleet
    fleet.close()


def test_the_role_is_in_the_state(engines):
    assert engines.prefill.get("/v1/state").json()["role"] == "prefill"
    assert engines.decode.get("/v1/state").json()["role"] == "decode"


def test_disaggregated_greedy_tokens_equal_colocated_and_peft_with_mixed_adapters(engines, model):
    _, refs, oracle = model
    prefill, decode = engines.prefill, engines.decode
    block_size = decode.get("/v1/state").json()["block_size"]
    names = [None, "a", "b", "big", "a", None]
    prompts = random_prompts(5, [40, 4 * block_size, 3 * block_size + 1, 97, 150, 9])
    sent_before = metric(decode, "quilt_engine_kv_pulls_total", outcome="ok", via=engines.backend)
    leases = [prefill_hop(prefill, p, refs.get(n), "tenant-d") for p, n in zip(prompts, names, strict=True)]
    for prompt, lease in zip(prompts, leases, strict=True):
        assert lease["num_blocks"] == len(prompt) // block_size and lease["engine_id"] == "prefill"
        assert lease["num_tokens"] == lease["num_blocks"] * block_size
        assert bool(lease["transport"]["shm"]) == (engines.backend != "tcp")
        assert bool(lease["transport"]["nixl"]) == (engines.backend == "nixl")
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # one batch, mixed adapters
        disaggregated = list(pool.map(lambda args: decode_hop(decode, *args), [
            (p, refs.get(n), "tenant-d", lease) for p, n, lease in zip(prompts, names, leases, strict=True)]))
        together = list(pool.map(lambda args: colocated(decode, *args), [
            (p, refs.get(n), "tenant-c") for p, n in zip(prompts, names, strict=True)]))
    for prompt, name, answer, tokens in zip(prompts, names, disaggregated, together, strict=True):
        usable = (len(prompt) - 1) // block_size  # the last token is always computed
        assert answer["usage"]["kv_transfer"]["blocks_pulled"] == usable
        assert answer["usage"]["kv_transfer"]["recomputed"] is False
        assert answer["usage"]["cached_tokens"] == usable * block_size
        assert answer["token_ids"] == tokens == oracle.greedy(prompt, name, MAX_TOKENS), name
    pulled = sum(1 for p in prompts if (len(p) - 1) // block_size)
    assert metric(decode, "quilt_engine_kv_pulls_total", outcome="ok", via=engines.backend) - sent_before == pulled
    assert leases_ended(prefill)["released"].get("done", 0) >= pulled
    pool_clean(prefill)
    pool_clean(decode)


def test_fp8_kv_cache_moves_as_fp8_and_never_across_numerics(engines, model):
    """fp8 pages move as fp8 with their scales (over TCP where the backend would use shared memory)."""
    _, refs, _ = model
    prefill = engines.launch("prefill-fp8", "--kv-cache-dtype", "fp8", "--no-kv-transfer-shm")
    decode = engines.launch("decode-fp8", "--kv-cache-dtype", "fp8")
    for client in (prefill, decode):
        wait_until_healthy(client.process, client, client.log_path)
    block_size = decode.get("/v1/state").json()["block_size"]
    names = ["big", None, "a", "b"]
    prompts = random_prompts(8, [70, 3 * block_size, 120, 33])
    leases = [prefill_hop(prefill, p, refs.get(n), "tenant-8") for p, n in zip(prompts, names, strict=True)]
    assert all(lease["transport"]["shm"] is None for lease in leases)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        disaggregated = list(pool.map(lambda args: decode_hop(decode, *args), [
            (p, refs.get(n), "tenant-8", lease) for p, n, lease in zip(prompts, names, leases, strict=True)]))
        together = list(pool.map(lambda args: colocated(decode, *args), [
            (p, refs.get(n), "tenant-c") for p, n in zip(prompts, names, strict=True)]))
    for prompt, answer, tokens in zip(prompts, disaggregated, together, strict=True):
        assert answer["usage"]["kv_transfer"] == {"lease_id": answer["usage"]["kv_transfer"]["lease_id"],
                                                  "blocks_pulled": (len(prompt) - 1) // block_size,
                                                  "recomputed": False}
        assert answer["token_ids"] == tokens
    via = "nixl" if engines.backend == "nixl" else "tcp"
    assert metric(decode, "quilt_engine_kv_pulls_total", outcome="ok", via=via) == len(prompts)
    # an fp8 engine's blocks are not the float32 engine's: other keys (the base digest names the KV dtype)
    prompt = prompts[0]
    lease = prefill_hop(prefill, prompt, refs["big"], "tenant-x")
    answer = decode_hop(engines.decode, prompt, refs["big"], "tenant-x", lease)
    assert answer["usage"]["kv_transfer"]["recomputed"] is True and answer["usage"]["kv_transfer"]["blocks_pulled"] == 0
    assert answer["token_ids"] == colocated(engines.decode, prompt, refs["big"], "tenant-y")
    assert metric(engines.decode, "quilt_engine_kv_recomputes_total", reason="not_leased") >= 1
    for client in (prefill, decode, engines.decode):
        pool_clean(client)
    # drain: a lease nobody pulled is released as the engine stops
    prefill_hop(prefill, prompt, None, "tenant-z")
    assert prefill.get("/v1/state").json()["kv_leases"]["active"] == 1
    prefill.process.send_signal(signal.SIGTERM)
    assert prefill.process.wait(timeout=60) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal it drained on)
    assert "released 1 KV leases on drain" in prefill.log_path.read_text()


def test_a_decode_engine_pulls_only_what_its_own_host_tier_lacks(engines, model):
    """Blocks the decode engine keeps in its host tier come back from there at admission: the pull asks the source
    for the rest alone (before, it pulled every block it lacked in its pool, over the wire)."""
    _, refs, oracle = model
    decode = engines.launch("decode-host-tier", "--role", "decode", "--num-kv-blocks", "24", "--pool-adapter-bytes",
                            "0", "--kv-host-cache-gb", str(2**20 / 2**30))  # a pool of 24 pages, adapters' included
    wait_until_healthy(decode.process, decode, decode.log_path)
    block_size = decode.get("/v1/state").json()["block_size"]
    shared, tail, *fillers = random_prompts(31, [3 * block_size, 3 * block_size, 14 * block_size, 14 * block_size])
    colocated(decode, shared + tail[:1], refs["a"], "tenant-h")  # shared's 3 blocks cached in the pool...
    for filler in fillers:
        colocated(decode, filler, refs["a"], "tenant-h")  # ...and pushed out of it into the host tier
    hits_before = decode.get("/v1/state").json()["kv_tiers"]["host"]["hits"]
    prompt = shared + tail + [42]  # 6 blocks a prefix hit can use: 3 in the decode engine's host tier, 3 new
    lease = prefill_hop(engines.prefill, prompt, refs["a"], "tenant-h")
    assert lease["num_blocks"] == 6
    answer = decode_hop(decode, prompt, refs["a"], "tenant-h", lease)
    assert answer["usage"]["kv_transfer"] == {"lease_id": lease["id"], "blocks_pulled": 3, "recomputed": False}
    assert answer["usage"]["cached_tokens"] == 6 * block_size
    assert answer["token_ids"] == oracle.greedy(prompt, "a", MAX_TOKENS)
    assert decode.get("/v1/state").json()["kv_tiers"]["host"]["hits"] == hits_before + 3
    leases_ended(engines.prefill)
    pool_clean(decode)
    pool_clean(engines.prefill)


def test_the_prefill_engine_killed_mid_transfer(engines, model):
    _, refs, oracle = model
    source = engines.launch("prefill-doomed")
    wait_until_healthy(source.process, source, source.log_path)
    decode = engines.decode
    prompt = random_prompts(21, [130])[0]
    lease = prefill_hop(source, prompt, refs["b"], "tenant-k")
    closed_before = metric(decode, "quilt_engine_kv_recomputes_total", reason="closed")
    source.process.send_signal(signal.SIGSTOP)  # the pull connects and waits...
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(decode_hop, decode, prompt, refs["b"], "tenant-k", lease)
        wait_until(lambda: decode.get("/v1/state").json()["kv_pulls_in_flight"] == 1)
        source.process.kill()  # ...and the source dies under it
        answer = answer.result(timeout=60)
    source.process.wait()
    assert answer["usage"]["kv_transfer"] == {"lease_id": lease["id"], "blocks_pulled": 0, "recomputed": True}
    assert answer["usage"]["cached_tokens"] == 0 and answer["finish_reason"] == "length"
    assert answer["token_ids"] == oracle.greedy(prompt, "b", MAX_TOKENS)
    assert metric(decode, "quilt_engine_kv_recomputes_total", reason="closed") == closed_before + 1  # not a timeout
    assert "recomputes" in decode.log_path.read_text()
    pool_clean(decode)


def test_a_transfer_timeout_recomputes_and_the_source_releases_the_lease(engines, model):
    _, refs, oracle = model
    prefill, decode = engines.prefill, engines.decode
    prompt = random_prompts(22, [111])[0]
    lease = prefill_hop(prefill, prompt, refs["a"], "tenant-t")
    before = prefill.get("/v1/state").json()["kv_leases"]["released"].get("closed", 0)
    prefill.process.send_signal(signal.SIGSTOP)  # hung: accepts connections, answers nothing
    try:
        answer = decode_hop(decode, prompt, refs["a"], "tenant-t", lease)
    finally:
        prefill.process.send_signal(signal.SIGCONT)
    assert answer["usage"]["kv_transfer"] == {"lease_id": lease["id"], "blocks_pulled": 0, "recomputed": True}
    assert answer["token_ids"] == oracle.greedy(prompt, "a", MAX_TOKENS)
    assert metric(decode, "quilt_engine_kv_recomputes_total", reason="timeout") >= 1
    # the source wakes up, finds the puller gone, and ends the lease
    assert wait_until(lambda: leases_ended(prefill)["released"].get("closed", 0) == before + 1)
    pool_clean(prefill)
    pool_clean(decode)


def test_the_client_aborts_during_the_transfer(engines, model):
    _, refs, _ = model
    prefill, decode = engines.prefill, engines.decode
    prompts = random_prompts(23, [90, 100])
    leases = [prefill_hop(prefill, p, refs["big"], "tenant-a") for p in prompts]
    prefill.process.send_signal(signal.SIGSTOP)  # the pulls wait
    try:
        # POST /v1/abort while the pull waits: the request ends as any aborted request does
        request = body(prompts[0], refs["big"], "tenant-a", kv_transfer={"mode": "decode", "lease": leases[0]})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(decode.post, "/v1/generate", json=request)
            wait_until(lambda: decode.get("/v1/state").json()["kv_pulls_in_flight"] == 1)
            aborted = decode.post(f"/v1/abort/{request['request_id']}")
            assert aborted.status_code == 200 and aborted.json()["aborted"] is True
            answer = pending.result(timeout=30)
        assert answer.status_code == 200
        assert answer.json()["finish_reason"] == "abort" and answer.json()["token_ids"] == []
        # the client hangs up while its streamed request pulls
        request = body(prompts[1], refs["big"], "tenant-a", kv_transfer={"mode": "decode", "lease": leases[1]},
                       stream=True)
        payload = json.dumps(request).encode()
        with socket.create_connection(("127.0.0.1", decode.port)) as raw:
            raw.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
            wait_until(lambda: decode.get("/v1/state").json()["kv_pulls_in_flight"] == 1)
        wait_until(lambda: decode.get("/v1/state").json()["kv_pulls_in_flight"] == 0)
    finally:
        prefill.process.send_signal(signal.SIGCONT)
    released = leases_ended(prefill)  # both leases end on the source: hung up on, or released by the puller
    assert released["active"] == 0
    pool_clean(prefill)
    pool_clean(decode)
    assert decode.post("/v1/abort/nothing-here").status_code == 404


def test_an_adapter_promoted_between_prefill_and_decode_is_never_served_stale(engines, model):
    _, refs, oracle = model
    prefill, decode = engines.prefill, engines.decode
    prompt = random_prompts(24, [120])[0]
    old, new = refs["a"], refs["b"]  # the same name, promoted from version a to version b in between
    lease = prefill_hop(prefill, prompt, old, "tenant-p")
    assert lease["num_blocks"] > 0
    answer = decode_hop(decode, prompt, new, "tenant-p", lease)
    assert answer["usage"]["kv_transfer"] == {"lease_id": lease["id"], "blocks_pulled": 0, "recomputed": True}
    assert answer["token_ids"] == oracle.greedy(prompt, "b", MAX_TOKENS)
    assert oracle.greedy(prompt, "a", MAX_TOKENS) != answer["token_ids"]  # stale KV would have shown
    assert leases_ended(prefill)["active"] == 0
    pool_clean(prefill)
    pool_clean(decode)


def usage_events(engines, name: str, request_id: str) -> list[dict]:
    spool = engines.logs / f"{name}-usage.jsonl"
    lines = spool.read_text().splitlines() if spool.exists() else []
    return [event for event in map(json.loads, lines) if event["request_id"] == request_id]


def test_another_tenant_pulls_nothing_and_the_decode_engine_reports_usage_once(engines, model):
    """Keys carry the tenant's salt: a decode hop under another tenant is sent no block (a cache shared across
    tenants would let one time-probe another's prompts). Either way the request's one usage event is the decode
    engine's; the prefill hop sends none."""
    _, refs, oracle = model
    prefill, decode = engines.prefill, engines.decode
    prompt = random_prompts(26, [90])[0]
    for tenant, shared in (("tenant-s1", True), ("tenant-s2", False)):
        request_id = f"r-salt-{tenant}"
        hop = body(prompt, refs["a"], "tenant-s1", kv_transfer={"mode": "prefill"}) | {"request_id": request_id}
        response = prefill.post("/v1/generate", json=hop)
        assert response.status_code == 200, response.text
        lease = response.json()["kv_lease"]
        answer = decode_hop(decode, prompt, refs["a"], tenant, lease, request_id=request_id)
        assert (answer["usage"]["kv_transfer"]["blocks_pulled"] > 0) is shared
        assert answer["usage"]["kv_transfer"]["recomputed"] is not shared
        assert answer["token_ids"] == oracle.greedy(prompt, "a", MAX_TOKENS)
        events = wait_until(lambda request_id=request_id: usage_events(engines, "decode", request_id))
        assert len(events) == 1 and events[0]["tenant"] == tenant, events
        assert usage_events(engines, "prefill", request_id) == []
    assert metric(decode, "quilt_engine_kv_recomputes_total", reason="not_leased") >= 1
    pool_clean(prefill)
    pool_clean(decode)


def test_aborting_a_finished_prefill_hop_ends_its_lease(engines, model):
    """The gateway aborts the prefill hop when its client leaves; if the hop had just ended, nobody will pull its lease:
    the abort ends it at once instead of leaving it to the TTL."""
    _, _, oracle = model
    prefill, decode = engines.prefill, engines.decode
    prompt = random_prompts(26, [64])[0]
    hop = body(prompt, None, "tenant-g", kv_transfer={"mode": "prefill", "lease_ttl_s": 300})
    response = prefill.post("/v1/generate", json=hop)
    assert response.status_code == 200, response.text
    lease = response.json()["kv_lease"]
    assert prefill.get("/v1/state").json()["kv_leases"]["active"] == 1
    aborted = prefill.post(f"/v1/abort/{hop['request_id']}")
    assert aborted.status_code == 200 and aborted.json()["aborted"] is True
    assert prefill.get("/v1/state").json()["kv_leases"]["active"] == 0
    assert prefill.post(f"/v1/abort/{hop['request_id']}").status_code == 404  # once
    answer = decode_hop(decode, prompt, None, "tenant-g", lease)  # the lease is gone: the decode side recomputes
    assert answer["usage"]["kv_transfer"]["recomputed"] is True
    assert answer["token_ids"] == oracle.greedy(prompt, None, MAX_TOKENS)
    pool_clean(prefill)
    pool_clean(decode)


def test_an_expired_lease_recomputes(engines, model):
    _, refs, oracle = model
    prefill, decode = engines.prefill, engines.decode
    prompt = random_prompts(25, [64])[0]
    lease = prefill_hop(prefill, prompt, None, "tenant-e", ttl_s=0.2)
    expired_before = prefill.get("/v1/state").json()["kv_leases"]["released"].get("expired", 0)
    wait_until(lambda: prefill.get("/v1/state").json()["kv_leases"]["released"].get("expired", 0) > expired_before)
    answer = decode_hop(decode, prompt, None, "tenant-e", lease)
    assert answer["usage"]["kv_transfer"]["recomputed"] is True
    assert answer["token_ids"] == oracle.greedy(prompt, None, MAX_TOKENS)
    assert metric(decode, "quilt_engine_kv_recomputes_total", reason="unknown_lease") >= 1
    assert metric(prefill, "quilt_engine_kv_leases_released_total", reason="expired") >= 1
    pool_clean(prefill)
    pool_clean(decode)


@pytest.mark.parametrize(("kv_transfer", "extra", "param"), [
    ({"mode": "both"}, {}, "kv_transfer.mode"),
    ("prefill", {}, "kv_transfer.mode"),
    ({"mode": "prefill"}, {"stream": True}, "kv_transfer.mode"),
    ({"mode": "prefill", "lease_ttl_s": 0}, {}, "kv_transfer.lease_ttl_s"),
    ({"mode": "prefill", "lease_ttl_s": 3600}, {}, "kv_transfer.lease_ttl_s"),
    ({"mode": "prefill", "ttl": 3}, {}, "kv_transfer.ttl"),  # by its path: a bare "ttl" read as the client's field
    ({"mode": "decode"}, {}, "kv_transfer.lease"),
    ({"mode": "decode", "lease": {"id": "ab" * 16, "transport": {"tcp": "127.0.0.1:1"}}, "layout_version": 2}, {},
     "kv_transfer.layout_version"),
    ({"mode": "prefill"}, {"prompt_token_ids": [[7, 8], [9, 10]]}, "kv_transfer"),
], ids=["mode", "not-an-object", "prefill-streamed", "ttl-zero", "ttl-long", "unknown-field", "no-lease",
        "unknown-decode-field", "batch"])
def test_a_bad_kv_transfer_is_a_400_naming_the_field_by_its_path(engines, kv_transfer, extra, param):
    response = engines.decode.post("/v1/generate", json=body([7, 8, 9], None, "t", kv_transfer=kv_transfer) | extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


A_LEASE = {"id": "ab" * 16, "engine_id": "prefill-0", "transport": {"tcp": "127.0.0.1:1", "shm": None},
           "num_blocks": 2, "num_tokens": 8, "expires_in_s": 30.0}  # fmt: skip
MALFORMED_LEASES = {  # a lease the contract's struct refuses, and the field the 400 names
    "lease-id": (A_LEASE | {"id": "not-hex!"}, "kv_transfer.lease.id"),
    "unknown-lease-field": (A_LEASE | {"layout_version": 2}, "kv_transfer.lease.layout_version"),
    "unknown-transport": (A_LEASE | {"transport": {"tcp": "127.0.0.1:1", "rdma": {}}}, "kv_transfer.lease.transport.rdma"),
    "num-blocks": (A_LEASE | {"num_blocks": -1}, "kv_transfer.lease.num_blocks"),
    "no-transport": ({"id": "ab" * 16}, "kv_transfer.lease.transport"),
    "another-version": (A_LEASE | {"v": 2}, "kv_transfer.lease"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MALFORMED_LEASES))
def test_a_malformed_lease_is_a_400_naming_its_field(engines, name):
    """A lease the struct cannot read is refused before anything is scheduled (the gateway then sends the request
    again without it: the client never sees this 400)."""
    lease, param = MALFORMED_LEASES[name]
    request = body([7, 8, 9], None, "t", kv_transfer={"mode": "decode", "lease": lease})
    response = engines.decode.post("/v1/generate", json=request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"] or "unknown field" in error["message"]
    if name == "another-version":
        assert "kv lease version 2" in error["message"]


UNREADABLE_LEASES = {  # what the prefill engine's lease becomes: an address this engine misreads
    "underscore-host": lambda lease: lease | {"transport": lease["transport"] | {
        "tcp": "engine_prefill:" + lease["transport"]["tcp"].rsplit(":", 1)[1], "shm": None}},
    "address": lambda lease: lease | {"transport": {"tcp": "nowhere", "shm": None}},
}


@pytest.mark.parametrize("name", list(UNREADABLE_LEASES))
def test_a_lease_the_decode_engine_cannot_reach_is_recomputed_never_refused(engines, model, name):
    """The lease's address is the prefill engine's, not the client's: one this engine cannot reach makes it
    recompute the prompt (the right tokens, the usage saying so), never answer 400."""
    _, _, oracle = model
    prefill, decode = engines.prefill, engines.decode
    prompt = random_prompts(40 + len(name), [64])[0]
    hop = body(prompt, None, "tenant-u", kv_transfer={"mode": "prefill", "lease_ttl_s": 60})
    response = prefill.post("/v1/generate", json=hop)
    assert response.status_code == 200, response.text
    lease = UNREADABLE_LEASES[name](response.json()["kv_lease"])
    answer = decode_hop(decode, prompt, None, "tenant-u", lease)
    assert answer["usage"]["kv_transfer"]["recomputed"] is True
    assert answer["usage"]["kv_transfer"]["blocks_pulled"] == 0
    assert answer["token_ids"] == oracle.greedy(prompt, None, MAX_TOKENS)
    assert prefill.post(f"/v1/abort/{hop['request_id']}").status_code == 200  # as the gateway ends it (unpulled)
    pool_clean(prefill)
    pool_clean(decode)
