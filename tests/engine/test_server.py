"""The engine server as a real process on a free port, with a tiny random Llama and PEFT adapters."""

import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from kombu import Connection
from peft import LoraConfig, get_peft_model
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, LlamaForCausalLM

import adapters
from engine.contract import StateAnswer, state_read
from engine.demo import corpus
from engine.demo.tokenizer import save_tokenizer, train_tokenizer
from engine.demo.trainer import llama_config, new_base_model
from tests.engine.conftest import launch_engine_server, wait_until_healthy

TOKEN = "test-engine-token"
BROKER = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/") + "/9"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_RANK = 8
CONTEXT = 4096
LONG = 4000  # max_tokens of requests the test aborts: they must still be running when it acts
MIX = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with the demo tokenizer, and random-weight LoRA adapters of ranks 4, 8, 16."""
    out = tmp_path_factory.mktemp("tiny-model")
    tokenizer = train_tokenizer(corpus.tokenizer_corpus(random.Random(0), lines=200), vocab_size=600)
    save_tokenizer(tokenizer, out, max_length=CONTEXT)
    model = new_base_model(llama_config(tokenizer, hidden=64, layers=2, max_positions=CONTEXT), seed=0)
    model.save_pretrained(out)
    for name, rank in (("a", 4), ("b", 8), ("big", 16)):
        torch.manual_seed(rank)
        lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj", "down_proj"],
                          init_lora_weights=False)
        peft_model = get_peft_model(model, lora)
        peft_model.save_pretrained(out / "adapters" / name)
        model = peft_model.unload()
    return out


@pytest.fixture(scope="module")
def adapter_refs(model_dir) -> dict[str, dict]:
    base_config = json.loads((model_dir / "config.json").read_text())
    refs = {}
    for name in ("a", "b", "big"):
        path = model_dir / "adapters" / name
        refs[name] = {"digest": adapters.load_adapter(path, base_config).digest, "path": str(path)}
    return refs


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    queue_name = f"usage-server-test-{uuid.uuid4().hex}"
    log_path = tmp_path_factory.mktemp("engine-log") / "engine.log"
    client = launch_engine_server(
        ["--model", str(model_dir), "--broker-url", BROKER, "--usage-queue", queue_name,
         "--usage-spool", str(log_path.parent / "usage.jsonl"), "--max-adapter-rank", str(MAX_RANK),
         "--pool-adapters-at-max-rank", "2", "--drain-timeout", "20", "--log-level", "info"],
        log_path=log_path, token=TOKEN)  # fmt: skip
    process = client.process
    wait_until_healthy(process, client, log_path)
    client.queue_name = queue_name
    yield client
    if process.poll() is None:
        process.kill()
        process.wait()
    client.close()


def generate(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/generate", json={"stream": False, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream_lines(response: httpx.Response):
    for line in response.iter_lines():
        if line:
            yield json.loads(line)


def wait_until(condition, *, timeout_s: float = 60.0, every_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("condition not reached in time")


def usage_events(client, *, request_ids: set[str], timeout_s: float = 30.0) -> dict[str, dict]:
    """Read usage events for these requests from the engine's broker queue (others are kept for later)."""
    found: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    with Connection(BROKER) as connection:
        inbox = connection.SimpleQueue(client.queue_name)
        while not request_ids <= set(found) and time.monotonic() < deadline:
            try:
                message = inbox.get(timeout=0.5)
            except inbox.Empty:
                continue
            assert message.headers["task"] == "metering.ingest_usage"
            for event in message.payload[0][0]:
                found[event["request_id"]] = event
            message.ack()
        inbox.close()
    return found


def idle(client) -> dict | None:
    state = client.get("/v1/state").json()
    return state if state["running"] == 0 and state["waiting"] == 0 and state["kv_blocks_used"] == 0 else None


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
                         ids=["missing", "wrong", "not-bearer"])
@pytest.mark.parametrize("method,path", [("GET", "/v1/health"), ("POST", "/v1/generate"), ("GET", "/metrics")])
def test_calls_without_the_token_get_401(server, headers, method, path):
    response = httpx.request(method, f"{server.base_url}{path}", headers=headers, json={"prompt": "the cat"})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_non_streaming_generate_matches_transformers(server, model_dir):
    messages = [{"role": "user", "content": "the cat sees a dog"}]
    result = generate(server, request_id="plain-1", tenant="acme", messages=messages,
                      sampling={"temperature": 0, "max_tokens": 8, "ignore_eos": True})
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    model = LlamaForCausalLM.from_pretrained(model_dir)
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    assert result["type"] == "final"
    assert result["token_ids"] == expected
    assert result["text"] == hf_tokenizer.decode(expected, skip_special_tokens=True)
    assert result["finish_reason"] == "length"
    usage = result["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt.shape[1], 8)
    assert usage["gpu_ms"] > 0 and usage["e2e_ms"] >= usage["ttft_ms"] > 0


def test_streaming_deltas_add_up_to_the_final_event(server):
    body = {"request_id": "stream-1", "prompt": "the cat", "stream": True,
            "sampling": {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 2}}
    with server.stream("POST", "/v1/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        events = list(stream_lines(response))
    deltas, final = events[:-1], events[-1]
    assert len(deltas) >= 2 and all(e["type"] == "delta" and e["request_id"] == "stream-1" for e in deltas)
    assert final["type"] == "final" and final["finish_reason"] == "length"
    assert "".join(e["text"] for e in deltas) == final["text"]
    assert [t for e in deltas for t in e["token_ids"]] == final["token_ids"]
    assert all(len(e["logprobs"]) == len(e["token_ids"]) and len(e["logprobs"][0]["top"]) >= 1 for e in deltas)
    assert final["usage"]["completion_tokens"] == 12


def test_n_completions_stream_by_index_and_sum_their_usage(server):
    body = {"request_id": "n-2", "prompt": "the cat", "stream": True,
            "sampling": {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6, "ignore_eos": True}}
    with server.stream("POST", "/v1/generate", json=body) as response:
        events = list(stream_lines(response))
    final = events[-1]
    assert [c["index"] for c in final["choices"]] == [0, 1]
    for choice in final["choices"]:
        deltas = [e for e in events[:-1] if e["index"] == choice["index"]]
        assert [t for e in deltas for t in e["token_ids"]] == choice["token_ids"] and len(choice["token_ids"]) == 6
    assert final["usage"]["completion_tokens"] == 12


def test_concurrent_requests_with_different_adapters_interleave(server, adapter_refs):
    results: dict[str, list[dict]] = {}

    def run(name: str) -> None:
        body = {"request_id": f"mix-{name}", "tenant": f"tenant-{name}", "adapter": adapter_refs[name],
                "prompt": "the dog", "stream": True,
                "sampling": {"temperature": 0, "max_tokens": LONG, "ignore_eos": True}}
        with server.stream("POST", "/v1/generate", json=body) as response:
            results[name] = list(stream_lines(response))

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    both = {adapter_refs["a"]["digest"], adapter_refs["b"]["digest"]}

    def batched_together() -> bool:
        running = server.get("/v1/state").json()["running_requests"]
        return {r["adapter"] for r in running if r["completion_tokens"] >= 8} == both

    wait_until(batched_together)
    for name in ("a", "b"):
        server.post(f"/v1/abort/mix-{name}")
    for thread in threads:
        thread.join(60)
    finals = {name: events[-1] for name, events in results.items()}
    assert all(f["finish_reason"] == "abort" for f in finals.values())
    assert finals["a"]["token_ids"][:8] != finals["b"]["token_ids"][:8]
    for name, final in finals.items():  # batching with the other adapter changed nothing for either
        alone = generate(server, adapter=adapter_refs[name], prompt="the dog",
                         sampling={"temperature": 0, "max_tokens": 8, "ignore_eos": True})
        assert alone["token_ids"] == final["token_ids"][:8]
    events = usage_events(server, request_ids={"mix-a", "mix-b"})
    assert events["mix-a"]["adapter_digest"] == adapter_refs["a"]["digest"]
    assert events["mix-b"]["tenant"] == "tenant-b"
    assert events["mix-b"]["completion_tokens"] == finals["b"]["usage"]["completion_tokens"] >= 8


def test_abort_frees_the_request_and_reports_usage(server):
    body = {"request_id": "abort-1", "prompt": "the cat", "api_key_id": "key-9", "stream": True,
            "metadata": {"engine": "engine-0", "adapter_version_id": 3},
            "sampling": {"max_tokens": LONG, "ignore_eos": True}}
    with server.stream("POST", "/v1/generate", json=body) as response:
        lines = stream_lines(response)
        assert next(lines)["type"] == "delta"
        assert server.get("/v1/state").json()["kv_blocks_used"] > 0
        assert server.post("/v1/abort/abort-1").json() == {"request_id": "abort-1", "aborted": True}
        final = [e for e in lines if e["type"] == "final"][0]
    assert final["finish_reason"] == "abort" and final["usage"]["completion_tokens"] < LONG
    assert wait_until(lambda: idle(server))
    assert server.post("/v1/abort/abort-1").status_code == 404
    event = usage_events(server, request_ids={"abort-1"})["abort-1"]
    assert (event["finish_reason"], event["api_key_id"]) == ("abort", "key-9")
    assert event["metadata"] == {"engine": "engine-0", "adapter_version_id": 3}
    assert event["completion_tokens"] == final["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_aborts(server, stream):
    request_id = f"gone-{stream}"
    body = {"request_id": request_id, "prompt": "the cat", "stream": stream,
            "sampling": {"max_tokens": LONG, "ignore_eos": True}}
    with httpx.Client(base_url=str(server.base_url), headers=AUTH) as client:
        if stream:
            with client.stream("POST", "/v1/generate", json=body) as response:
                next(stream_lines(response))
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/generate", json=body, timeout=httpx.Timeout(60, read=0.3))
    event = usage_events(server, request_ids={request_id})[request_id]
    assert event["finish_reason"] == "abort" and event["completion_tokens"] < LONG
    assert wait_until(lambda: idle(server))


BAD_REQUESTS = [
    ("not-json", b"{nope", "not valid JSON"),
    ("unknown-field", {"prompt": "hi", "temperature": 1}, "unknown field 'temperature'"),
    ("no-prompt", {"tenant": "acme"}, "exactly one of prompt"),
    ("two-prompts", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "exactly one of prompt"),
    ("bad-message", {"messages": [{"role": "user"}]}, "messages[0]"),
    ("unknown-sampling", {"prompt": "hi", "sampling": {"beam_width": 2}}, "unknown sampling parameter"),
    ("wrong-type", {"prompt": "hi", "sampling": {"max_tokens": "ten"}}, "sampling.max_tokens has the wrong type"),
    ("bad-value", {"prompt": "hi", "sampling": {"top_p": 1.5}}, "top_p must be in (0, 1]"),
    ("too-long", {"prompt_token_ids": [5] * (CONTEXT + 10)}, f"context is {CONTEXT} tokens"),
    ("bad-token", {"prompt_token_ids": [10**6]}, "below the vocabulary size"),
    ("bad-weight", {"prompt": "hi", "weight": 0}, "weight must be a number > 0"),
    ("bad-metadata", {"prompt": "hi", "metadata": ["x"]}, "metadata must be a JSON object"),
    ("bad-digest", {"prompt": "hi", "adapter": {"digest": "xyz"}}, "sha256 hex digest"),
    # numbers JSON has not, or that no sampler can use: refused, never scheduled (a seed past 64 bits failed
    # the engine's step, and with it every request in flight and the engine's health)
    ("nan-temperature", b'{"prompt": "hi", "sampling": {"temperature": NaN}}', "NaN is not a JSON number"),
    ("infinite-weight", b'{"prompt": "hi", "weight": Infinity}', "Infinity is not a JSON number"),
    ("overflowing-temperature", b'{"prompt": "hi", "sampling": {"temperature": 1e400}}',
     "temperature must be a finite number"),
    ("overflowing-weight", b'{"prompt": "hi", "weight": 1e400}', "weight must be a number > 0"),
    ("huge-seed", {"prompt": "hi", "sampling": {"seed": 2**70, "temperature": 1}}, "seed must be a 64-bit integer"),
    # a banned stop token past the vocabulary failed the step that indexed the logits with it
    ("stop-token-past-vocabulary", {"prompt": "hi", "sampling": {"stop_token_ids": [10**6], "min_tokens": 2}},
     "sampling.stop_token_ids names token 1000000"),
    ("negative-stop-token", {"prompt": "hi", "sampling": {"stop_token_ids": [-1]}}, "stop_token_ids must be token ids"),
    ("zero-repetition-penalty", {"prompt": "hi", "sampling": {"repetition_penalty": 0}},
     "repetition_penalty must be > 0"),
    # the contract's struct: another version is refused for its version, a field by its path
    ("another-version", {"prompt": "hi", "v": 2, "prompt_v2": {}}, "generate request version 2 is not the version"),
    ("bad-lease-id", {"prompt": "hi", "stream": False, "kv_transfer": {"mode": "decode", "lease": {
        "id": "not-hex!", "transport": {"tcp": "127.0.0.1:1"}}}}, "kv_transfer.lease.id"),
    ("bad-metadata-field", {"prompt": "hi", "metadata": {"adapter_version_id": "seven"}}, "metadata.adapter_version_id"),
]


@pytest.mark.parametrize(("body", "message"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_400_before_scheduling(server, body, message):
    steps_before = server.get("/v1/state").json()["steps"]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = server.post("/v1/generate", content=content)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
    assert server.get("/v1/state").json()["steps"] == steps_before


def test_a_tiny_temperature_is_greedy(server):
    """Dividing the logits by 1e-300 overflowed them: every token came out as id 0."""
    body = {"prompt": "the cat sees", "stream": False}
    greedy = server.post("/v1/generate", json={**body, "sampling": {"temperature": 0, "max_tokens": 6}}).json()
    tiny = server.post("/v1/generate", json={**body, "sampling": {"temperature": 1e-300, "max_tokens": 6,
                                                                  "seed": 3}}).json()
    assert tiny["token_ids"] == greedy["token_ids"] and len(set(greedy["token_ids"])) > 1
    assert server.get("/v1/health").status_code == 200


def test_adapter_above_the_rank_limit_is_unavailable(server, adapter_refs):
    response = server.post("/v1/generate", json={"prompt": "hi", "adapter": adapter_refs["big"]})
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "adapter_unavailable" and error["param"] == "adapter"
    assert "rank" in error["message"] and str(MAX_RANK) in error["message"]


def test_tokenize_counts_like_the_model_tokenizer(server, model_dir):
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "a small bird finds the moon"}]
    counted = server.post("/v1/tokenize", json={"messages": messages}).json()
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert counted["token_ids"] == list(expected) and counted["count"] == len(expected)
    assert server.post("/v1/tokenize", json={"prompt": ""}).status_code == 400


def test_prefetch_and_evict_adapters(server, adapter_refs):
    ref = adapter_refs["b"]
    response = server.post("/v1/adapters/prefetch", json={**ref, "tier": "gpu"})
    assert response.status_code == 200 and response.json()["resident"] == ["gpu", "host"]
    state = state_read(server.get("/v1/state").json(), StateAnswer)  # the contract's, every field checked
    assert ref["digest"] in state.adapters.gpu and ref["digest"] in state.resident_digests()
    assert (ref["digest"], "device", False) in [(r.digest, r.tier, r.pinned) for r in state.adapters.residency]
    body = {"request_id": "pinned", "adapter": ref, "prompt": "hi", "stream": True,
            "sampling": {"max_tokens": LONG, "ignore_eos": True}}
    with server.stream("POST", "/v1/generate", json=body) as response:
        lines = stream_lines(response)  # kept: a dropped line iterator closes the stream, which aborts
        assert next(lines)["type"] == "delta"
        assert server.delete(f"/v1/adapters/{ref['digest']}").status_code == 409
        server.post("/v1/abort/pinned")
    wait_until(lambda: idle(server))
    response = server.delete(f"/v1/adapters/{ref['digest']}")
    assert response.status_code == 200 and response.json()["evicted"] == ["gpu", "host"]
    state = server.get("/v1/state").json()["adapters"]
    assert ref["digest"] not in state["gpu"] and ref["digest"] not in state["host"]
    assert server.delete(f"/v1/adapters/{'f' * 64}").status_code == 404
    assert generate(server, adapter=ref, prompt="hi")["finish_reason"] in ("stop", "length")
    for tier in (["gpu"], {"gpu": 1}, "moon"):  # a list was a 500
        response = server.post("/v1/adapters/prefetch", json={**ref, "tier": tier})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tier", response.text


def test_metrics_parse_with_prometheus_client(server, adapter_refs):
    generate(server, tenant="metrics-tenant", adapter=adapter_refs["a"], prompt="hi",
             sampling={"max_tokens": 4, "ignore_eos": True})
    response = server.get("/metrics")
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in ("quilt_engine_step_seconds", "quilt_engine_batch_size", "quilt_engine_tokens_per_second",
                 "quilt_engine_ttft_seconds", "quilt_engine_inter_token_seconds", "quilt_engine_kv_usage_ratio",
                 "quilt_engine_adapter_loads", "quilt_engine_adapter_requests", "quilt_engine_adapter_evictions",
                 "quilt_engine_memory_bytes"):
        assert name in families, name
    tokens = {s.labels["kind"]: s.value for s in families["quilt_engine_tokens"].samples if s.name.endswith("_total")}
    assert tokens["prompt"] > 0 and tokens["completion"] >= 4
    memory = {s.labels["kind"]: s.value for s in families["quilt_engine_memory_bytes"].samples}
    assert memory["base_weights"] > 0 and memory["adapter_pages"] > 0 and memory["free"] > 0  # "a" stays resident
    split = server.get("/v1/state").json()["memory"]
    assert split["kv_pages_bytes"] + split["adapter_pages_bytes"] + split["free_bytes"] == \
        split["pages_total"] * split["page_bytes"]
    ttft = [s for s in families["quilt_engine_ttft_seconds"].samples if s.name.endswith("_count")]
    assert any(s.labels == {"tenant": "metrics-tenant", "adapter": adapter_refs["a"]["digest"][:12]} and s.value >= 1
               for s in ttft)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_unreadable_adapter_is_a_503_for_its_request_alone(server, adapter_refs, tmp_path, stream):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    for ref in ({"digest": "1" * 64, "path": "/nonexistent/adapter"}, {"digest": "2" * 64, "path": str(broken)}):
        response = server.post("/v1/generate", json={"prompt": "hi", "adapter": ref, "stream": stream})
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "adapter_unavailable" and error["param"] == "adapter"
        assert error["message"].startswith(f"adapter {ref['digest'][:12]} could not be loaded: ")
        assert "nonexistent" not in error["message"] and str(tmp_path) not in error["message"]
    health = server.get("/v1/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert generate(server, adapter=adapter_refs["a"], prompt="hi")["finish_reason"] in ("stop", "length")


def _stored_twin(model_dir: Path, name: str, out: Path) -> dict:
    """Adapter `name` with its B matrices doubled (a digest no other test registers), stored as the control plane
    stores it (the canonical folder); its ref."""
    base_config = json.loads((model_dir / "config.json").read_text())
    source = adapters.load_adapter(model_dir / "adapters" / name, base_config)
    tensors = {key: t * 2 if key.endswith("lora_B") else t for key, t in source.tensors.items()}
    twin = adapters.LoadedAdapter.build(tensors=tensors, ranks=source.ranks, alphas=source.config["alphas"],
                                        scaling=source.scaling, alpha=source.alpha, use_rslora=False,
                                        base_model_name_or_path=None)
    return {"digest": twin.digest, "path": str(twin.save(out))}


def test_a_stored_adapter_with_flipped_bytes_is_a_503_for_its_requests_alone(server, model_dir, adapter_refs, tmp_path):
    ref = _stored_twin(model_dir, "a", tmp_path / "flipped")
    weights = Path(ref["path"]) / "adapter_model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:-1] + bytes([intact[-1] ^ 0xFF]))
    for stream in (False, True):
        response = server.post("/v1/generate", json={"prompt": "hi", "adapter": ref, "stream": stream})
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "adapter_unavailable" and error["param"] == "adapter"
        assert error["message"].startswith(f"adapter {ref['digest'][:12]} could not be loaded: ")
        assert str(tmp_path) not in error["message"]
    assert generate(server, adapter=adapter_refs["a"], prompt="hi")["finish_reason"] in ("stop", "length")
    assert generate(server, prompt="hi")["finish_reason"] in ("stop", "length")
    state = server.get("/v1/state").json()["adapters"]
    assert ref["digest"] not in state["gpu"] and ref["digest"] not in state["host"]
    weights.write_bytes(intact)  # repaired, the next request reads it again and serves
    assert generate(server, adapter=ref, prompt="hi")["finish_reason"] in ("stop", "length")


def test_adapter_residency_metrics_agree_with_the_state(server, model_dir, tmp_path):
    def scrape() -> dict:
        return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}

    def waits(families) -> tuple[float, float, float]:
        samples = families["quilt_engine_adapter_wait_seconds"].samples
        value = {(s.name.rsplit("_", 1)[-1], s.labels.get("le")): s.value for s in samples}
        return value[("count", None)], value[("bucket", "0.0")], value[("sum", None)]

    def loads(families) -> dict[tuple[str, str], float]:
        return {(s.labels["from_tier"], s.labels["to_tier"]): s.value
                for s in families["quilt_engine_adapter_load_seconds"].samples if s.name.endswith("_count")}

    before = scrape()
    ref = _stored_twin(model_dir, "b", tmp_path / "twin")  # a digest this server has never seen
    sampling = {"max_tokens": 2, "ignore_eos": True}
    generate(server, adapter=ref, prompt="hi", sampling=sampling)  # waits for its first read
    generate(server, adapter=ref, prompt="hi", sampling=sampling)  # in memory: no wait
    wait_until(lambda: idle(server))
    after = scrape()
    state = server.get("/v1/state").json()["adapters"]
    resident = {(s.labels["adapter"], s.labels["tier"], s.labels["pinned"])
                for s in after["quilt_engine_adapter_resident"].samples}
    assert resident == {(d[:12], "device", str(d in state["pinned"]).lower()) for d in state["gpu"]} | \
        {(d[:12], "host", "false") for d in state["host"]}
    assert {s.labels["rank"] for s in after["quilt_engine_adapter_resident"].samples
            if s.labels["adapter"] == ref["digest"][:12]} == {"8"}
    (count, zero, total), (count_after, zero_after, total_after) = waits(before), waits(after)
    assert (count_after - count, zero_after - zero) == (2, 1) and total_after > total
    moved = {key: value - loads(before).get(key, 0) for key, value in loads(after).items()}
    assert moved[("disk", "host")] >= 1 and moved[("host", "device")] >= 1


def _health_over(sock: socket.socket) -> bytes:
    """One GET /v1/health on an open connection; the answer's status line, b"" if the engine had closed it."""
    sock.sendall(f"GET /v1/health HTTP/1.1\r\nHost: engine\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(65536)
        if not data:
            return b""
        answer += data
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_an_idle_connection_stays_open_longer_than_clients_reuse_it(server):
    """The gateway reuses an idle engine connection for 2 s after it read an answer's end, which on a loaded
    machine is seconds after the engine wrote it; uvicorn's default 5 s keep-alive closed connections under
    such reuses (a reset for the request sent on it). The engine keeps them far longer."""
    with socket.create_connection((server.base_url.host, server.base_url.port), timeout=30) as sock:
        assert _health_over(sock) == b"HTTP/1.1 200 OK"
        time.sleep(6.5)  # past uvicorn's default
        assert _health_over(sock) == b"HTTP/1.1 200 OK"


@pytest.mark.parametrize(("method", "path", "content", "status"), [
    ("GET", "/v1/generate", b"", 405), ("POST", "/v1/no-such-route", b"{}", 404),
    ("POST", "/v1/generate", b"[" * 100_000, 400), ("POST", "/v1/tokenize", b"[" * 100_000 + b"]" * 100_000, 400),
], ids=["wrong-method", "unknown-route", "unclosed-nesting", "deep-nesting"])
def test_every_refusal_is_in_the_documented_error_shape(server, method, path, content, status):
    response = server.request(method, path, content=content)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] and error["message"] and "param" in error
    if status == 405:
        assert response.headers["allow"] == "POST"


def test_graceful_shutdown_finishes_running_requests(server):
    body = {"request_id": "last-1", "prompt": "the cat", "stream": True,
            "sampling": {"max_tokens": MIX, "ignore_eos": True}}
    with server.stream("POST", "/v1/generate", json=body) as response:
        lines = stream_lines(response)
        next(lines)
        server.process.send_signal(signal.SIGTERM)
        final = [e for e in lines if e["type"] == "final"][0]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == MIX
    assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert "Application shutdown complete" in server.log_path.read_text()
    assert usage_events(server, request_ids={"last-1"})["last-1"]["finish_reason"] == "length"


