"""Engine processes for the disaggregation tests: launched, killed, and driven through the two hops
(docs/kv-tiers.md)."""

import json
import signal
import time
import uuid
from pathlib import Path

import httpx

import adapters
from tests.engine.conftest import Oracle, build_adapter, build_checkpoint, launch_engine_server

TOKEN = "kv-disagg-test-token"
TIMEOUT_S = 3.0  # the decode engines' --kv-transfer-timeout
MAX_TOKENS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "down_proj"]  # k and v: an adapter changes the KV itself
UCX_ENV = {"UCX_TLS": "tcp"}  # NIXL's UCX over TCP alone, as between two machines without RDMA


def build_model(root: Path):
    """A tiny Llama, three PEFT adapters (ranks 4, 8, 16) by name -> (digest, path), and transformers + PEFT."""
    base = build_checkpoint(root / "llama", "llama", seed=11)
    paths = {name: build_adapter(base, root / name, seed=70 + r, r=r, targets=TARGETS)
             for name, r in (("a", 4), ("b", 8), ("big", 16))}
    config = json.loads((base / "config.json").read_text())
    refs = {name: {"digest": adapters.load_adapter(path, config).digest, "path": str(path)}
            for name, path in paths.items()}
    return base, refs, Oracle(base, paths)


class Engines:
    """Engine processes by name, each an httpx client with .process and .log_path; killed at the end."""

    def __init__(self, base: Path, logs: Path, backend: str = "nixl") -> None:
        self.base, self.logs, self.backend = base, logs, backend
        self.clients: dict[str, httpx.Client] = {}

    def launch(self, name: str, *extra: str) -> httpx.Client:
        """An engine moving KV by this fleet's backend (a later --kv-transfer-backend in extra wins)."""
        client = launch_engine_server(
            ["--model", str(self.base), "--broker-url", "", "--usage-spool", str(self.logs / f"{name}-usage.jsonl"),
             "--engine-name", name, "--max-adapter-rank", "16", "--kv-transfer-timeout", str(TIMEOUT_S),
             "--log-level", "info", "--kv-transfer-backend", self.backend, *extra],
            log_path=self.logs / f"{name}.log", token=TOKEN, env=UCX_ENV)  # fmt: skip
        self.clients[name] = client
        return client

    def close(self) -> None:
        for client in self.clients.values():
            if client.process.poll() is None:
                client.process.send_signal(signal.SIGCONT)
                client.process.kill()
                client.process.wait()
            client.close()


def body(prompt: list[int], adapter: dict | None, tenant: str, **extra) -> dict:
    return {"request_id": f"r-{uuid.uuid4().hex[:12]}", "prompt_token_ids": prompt, "tenant": tenant,
            "adapter": adapter, "stream": False, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                              "ignore_eos": True}} | extra


def prefill_hop(client, prompt, adapter, tenant, ttl_s: float = 30.0) -> dict:
    response = client.post("/v1/generate", json=body(prompt, adapter, tenant,
                                                     kv_transfer={"mode": "prefill", "lease_ttl_s": ttl_s}))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert set(answer) == {"kv_lease", "usage"} and answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["gpu_seconds"] > 0
    return answer["kv_lease"]


def decode_hop(client, prompt, adapter, tenant, lease, **extra) -> dict:
    response = client.post("/v1/generate", json=body(prompt, adapter, tenant,
                                                     kv_transfer={"mode": "decode", "lease": lease}, **extra))
    assert response.status_code == 200, response.text
    return response.json()


def colocated(client, prompt, adapter, tenant) -> list[int]:
    response = client.post("/v1/generate", json=body(prompt, adapter, tenant))
    assert response.status_code == 200, response.text
    return response.json()["token_ids"]


def wait_until(condition, *, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def pool_clean(client) -> dict:
    """The engine is idle and its pool's own counts show nothing held: every page free, evictable or an adapter's,
    no lease, no block held outside a sequence, no pull under way."""
    state = wait_until(lambda: (s := client.get("/v1/state").json())["running"] == 0 and s["waiting"] == 0 and s)
    pool = state["kv_pool"]
    assert pool["free"] + pool["evictable"] + pool["in_use"] + pool["adapter_pages"] == pool["total"], pool
    assert pool["in_use"] == 0 and pool["held"] == 0, pool
    assert state["kv_leases"]["active"] == 0 and state["kv_leases"]["held_blocks"] == 0, state["kv_leases"]
    assert state["kv_pulls_in_flight"] == 0
    return state


def leases_ended(client) -> dict:
    return wait_until(lambda: (s := client.get("/v1/state").json())["kv_leases"]["active"] == 0 and s)["kv_leases"]
