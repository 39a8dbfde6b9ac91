"""A decode hop against sources that misbehave in ways a real engine cannot be made to: blocks under keys that are
not the ones asked for (another prompt's KV), and bytes that are no payload. The decode engine refuses them,
recomputes, counts why, and serves the tokens a colocated run gives; its pool is left clean."""

import asyncio
import contextlib
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from engine import SamplingParams
from engine.config import EngineConfig
from engine.kv.payload import encode
from engine.kv.transport import TransferServer
from engine.llm_engine import LLMEngine
from engine.server.adapter_registry import AdapterRegistry
from engine.server.app import EngineAPI, build_app
from engine.server.engine_loop import EngineLoop
from engine.server.kv_transfer import KVTransfers
from engine.server.metrics import EngineMetrics
from tests.engine.conftest import random_prompts
from tests.ports import free_port

AUTH = {"Authorization": "Bearer t"}
BLOCK = 16


class FakeSource:
    """A transfer server on its own event loop thread that answers every pull with `payloads`."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads
        self.released: list[tuple[str, str]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def blocks(self, lease_id, keys):
        return self.payloads

    async def release(self, lease_id, reason):
        self.released.append((lease_id, reason))

    def __enter__(self) -> "FakeSource":
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            TransferServer(blocks=self.blocks, release=self.release, host="127.0.0.1", shm=False).start(),
            self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def decode_engine(base):
    engine = LLMEngine(EngineConfig(model=str(base), block_size=BLOCK, num_kv_blocks=32))
    loop = EngineLoop(engine, metrics=EngineMetrics(), emitter=None, base_model="tiny")
    kv = KVTransfers(loop, engine_id="d", host="127.0.0.1", advertise_host="127.0.0.1", shm=False, timeout_s=10)
    api = EngineAPI(loop, registry=AdapterRegistry(loop, store=None), model_name="tiny", drain_timeout_s=1.0, kv=kv)
    with TestClient(build_app(api, token="t")) as client:
        client.kv = kv
        yield client, engine


def generate(client, prompt, tenant, **extra) -> dict:
    body = {"prompt_token_ids": prompt, "tenant": tenant, "stream": False,
            "sampling": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}} | extra
    response = client.post("/v1/generate", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def recomputes(client, reason: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics", headers=AUTH).text):
        for sample in family.samples:
            if sample.name == "quilt_engine_kv_recomputes_total" and sample.labels["reason"] == reason:
                return sample.value
    return 0.0


def other_prompts_blocks(base, prompt) -> list[bytes]:
    """Real KV blocks, of the same model and layout, but of another prompt: one payload per block."""
    engine = LLMEngine(EngineConfig(model=str(base), block_size=BLOCK, num_kv_blocks=32))
    engine.add_request("x", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    blocks = engine.export_blocks(engine.kv_keys(prompt))
    assert len(blocks) == len(prompt) // BLOCK
    return [encode([block]) for block in blocks]


@pytest.mark.parametrize("fault", ["other-keys", "not-a-payload"])
def test_a_source_that_sends_the_wrong_bytes_is_refused_and_the_prompt_recomputed(checkpoints, fault):
    base = checkpoints["llama"]
    prompt, other = random_prompts(31, [3 * BLOCK + 5, 3 * BLOCK + 5])
    payloads = other_prompts_blocks(base, other) if fault == "other-keys" else [b"QKVB" + bytes(64), b"junk"]
    reason = "mismatch" if fault == "other-keys" else "payload"
    with FakeSource(payloads) as source, decode_engine(base) as (decode, engine):
        lease = {"id": "ab" * 16, "engine_id": "fake", "transport": source.server.address, "num_blocks": 3}
        answer = generate(decode, prompt, "t", kv_transfer={"mode": "decode", "lease": lease})
        assert answer["usage"]["kv_transfer"] == {"lease_id": lease["id"], "blocks_pulled": 0, "recomputed": True}
        assert answer["usage"]["cached_tokens"] == 0
        assert answer["token_ids"] == generate(decode, prompt, "colocated")["token_ids"]
        assert recomputes(decode, reason) == 1
        state = decode.get("/v1/state", headers=AUTH).json()
        assert state["kv_pool"]["in_use"] == 0 and state["kv_pool"]["held"] == 0 and state["kv_pulls_in_flight"] == 0
        # the lease ends on the source: told so after the refused import, hung up on after the unreadable bytes
        wait = 0
        while not source.released and wait < 100:
            threading.Event().wait(0.05)
            wait += 1
        assert source.released == [(lease["id"], "released" if fault == "other-keys" else "closed")]
    engine.block_manager.check_invariants([])


def test_a_nixl_pull_that_cannot_reach_its_source_gives_its_landing_slots_back_to_rest(checkpoints):
    """The slots a NIXL pull reserved go back whatever ends it, here a source that is not there: they rest (a write
    may still land; test_kv_nixl.py shows them taken again after), never kept: a slot kept would shrink the landing
    area for good."""
    pytest.importorskip("nixl_cu12")
    base = checkpoints["llama"]
    prompt = random_prompts(33, [3 * BLOCK + 5])[0]
    with decode_engine(base) as (decode, engine):
        nixl = decode.kv.nixl
        assert nixl is not None and len(nixl.free_slots) == nixl.slots
        gone = {"tcp": f"127.0.0.1:{free_port()}", "shm": None, "nixl": "quilt-gone-00000000"}
        lease = {"id": "cd" * 16, "engine_id": "gone", "transport": gone, "num_blocks": 3}
        answer = generate(decode, prompt, "t", kv_transfer={"mode": "decode", "lease": lease})
        assert answer["usage"]["kv_transfer"]["recomputed"] is True
        assert recomputes(decode, "closed") == 1
        resting = sum(len(slots) for _, slots in nixl.resting)
        assert resting == 3 and len(nixl.free_slots) + resting == nixl.slots
