"""Always-warm adapters reach a real engine: an adapter marked warm (by itself or by its tenant's plan) is pinned by
the sync task; a pin past the engine's budget is refused by the engine and kept as a `refused` row with its words,
never dropped; a pin no longer wanted is unpinned; the engine's own /v1/state agrees with the rows."""

import json
import subprocess
import sys

import httpx
import pytest

import adapters
from gateway import pins
from gateway.models import Engine, EnginePin
from gateway.services import engine_check
from registry.models import Adapter, AdapterVersion, BaseModel
from registry.services import adapter_warm_set
from registry.storage import adapter_store_root
from tenancy.audit import Actor
from tests.conftest import REPO
from tests.engine.conftest import build_adapter
from tests.gateway.conftest import ENGINE_TOKEN, free_port, wait_until
from tests.platform.factories import TenantFactory
from tests.tiny_llama import save_tiny_base

pytestmark = pytest.mark.django_db

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def engine_process(tmp_path, settings):
    """A real engine whose pool has device pages for two rank-8 adapters: a third device pin does not fit."""
    settings.MEDIA_ROOT = tmp_path / "media"
    settings.QUILT_ENGINE_TOKEN = ENGINE_TOKEN
    model_dir = save_tiny_base(tmp_path / "base")
    port = free_port()
    command = [sys.executable, "-m", "engine", "--model", str(model_dir), "--port", str(port), "--block-size", "4",
               "--num-kv-blocks", "8", "--max-adapter-rank", "8", "--pool-adapters-at-max-rank", "2",
               "--usage-spool", str(tmp_path / "spool.jsonl"), "--log-level", "warning"]  # fmt: skip
    env = {"QUILT_ENGINE_TOKEN": ENGINE_TOKEN, "PYTHONPATH": f"{REPO}:{REPO / 'platform'}", "PATH": "/usr/bin:/bin"}
    log = open(tmp_path / "engine.log", "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(f"{url}/v1/health"), timeout=180, what="engine answering", process=process)
    yield model_dir, url
    process.terminate()
    process.wait(timeout=30)
    log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}).status_code == 200
    except httpx.HTTPError:
        return False


def stored_adapter(tenant, base: BaseModel, model_dir, tmp_path, name: str, seed: int) -> Adapter:
    peft_dir = build_adapter(model_dir, tmp_path / f"peft-{name}", seed=seed, r=8, targets=ALL)
    adapter = adapters.load_adapter(peft_dir, base.config)
    adapter.save(adapter_store_root() / adapter.digest)
    row = Adapter.objects.create(tenant=tenant, name=name, base_model=base)
    version = AdapterVersion.objects.create(adapter=row, number=1, status="ready", digest=adapter.digest, rank=8)
    row.current_version = version
    row.save(update_fields=["current_version"])
    return row


def missed(engine: Engine) -> int:
    """This engine's pins that are not held, as the last sync recorded them (the sync also reaches any other engine
    up in the database, such as a shared stack's, whose answers are not this test's)."""
    return EnginePin.objects.filter(engine=engine).exclude(status="pinned").count()


def test_warm_adapters_are_pinned_and_a_refusal_is_kept(engine_process, tmp_path):
    model_dir, url = engine_process
    base = BaseModel.objects.create(name="tiny-pins", checkpoint_dir=str(model_dir), architecture="LlamaForCausalLM",
                                    config=json.loads((model_dir / "config.json").read_text()),
                                    max_context=128)  # fmt: skip
    tenant = TenantFactory()
    tenant.plan.max_warm_adapters = 3
    tenant.plan.save()
    rows = [stored_adapter(tenant, base, model_dir, tmp_path, name, 80 + i) for i, name in enumerate(("x", "y", "z"))]
    engine = Engine.objects.create(name="engine-pins", url=url, token=ENGINE_TOKEN)
    engine_check(engine=engine)

    for row in rows:
        adapter_warm_set(actor=Actor.system(), adapter=row, tier="gpu")
    assert pins.warm_adapters() == {row.current_version.digest: "gpu" for row in rows}
    pins.engine_pins_sync_all()
    assert missed(engine) == 1  # the third device pin does not fit two adapters' pages
    recorded = {pin.digest: pin for pin in EnginePin.objects.filter(engine=engine)}
    statuses = sorted(pin.status for pin in recorded.values())
    assert statuses == ["pinned", "pinned", "refused"]
    refused = next(pin for pin in recorded.values() if pin.status == "refused")
    assert "device pins would hold" in refused.message and "pages for adapters" in refused.message

    state = engine_check(engine=engine).state["adapters"]
    assert state["pinned"] == {d: "device" for d, pin in recorded.items() if pin.status == "pinned"}
    assert {(r["digest"], r["tier"]) for r in state["residency"] if r["pinned"]} == \
        {(d, "device") for d, pin in recorded.items() if pin.status == "pinned"}

    # the refused one is asked again on the next sync, and fits once another is no longer wanted
    pinned_row = next(row for row in rows if recorded[row.current_version.digest].status == "pinned")
    adapter_warm_set(actor=Actor.system(), adapter=pinned_row, tier="")
    engine_check(engine=engine)
    pins.engine_pins_sync_all()
    assert missed(engine) == 0
    assert not EnginePin.objects.filter(engine=engine, digest=pinned_row.current_version.digest).exists()
    state = engine_check(engine=engine).state["adapters"]
    assert set(state["pinned"]) == {row.current_version.digest for row in rows if row != pinned_row}

    # a plan's tier pins every adapter of its tenants, in host memory here
    for row in rows:
        adapter_warm_set(actor=Actor.system(), adapter=row, tier="")
    tenant.plan.adapter_warm_tier = "host"
    tenant.plan.save()
    assert pins.warm_adapters() == {row.current_version.digest: "host" for row in rows}
    engine_check(engine=engine)
    pins.engine_pins_sync_all()
    assert missed(engine) == 0
    state = engine_check(engine=engine).state["adapters"]
    assert state["pinned"] == {row.current_version.digest: "host" for row in rows}
