"""Promoting an adapter version asks the engines that served the old one to warm the new one."""

import httpx
import pytest

from engine.contract import state_read
from gateway.models import Engine
from gateway.tasks import check_engines
from tests.engine.conftest import build_adapter
from tests.gateway.conftest import ENGINE_TOKEN, client, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db]


def engine_resident(stack) -> frozenset[str]:
    state = httpx.get(f"{stack.engine_url}/v1/state", headers={"Authorization": f"Bearer {ENGINE_TOKEN}"}).json()
    return state_read(state).resident_digests()


def test_promotion_prefetches_the_new_version_where_the_old_one_was(stack, tmp_path):
    api = client(stack, stack.keys["main"])
    api.chat.completions.create(model="support", messages=[{"role": "user", "content": "w5"}], max_tokens=1)
    management = httpx.Client(
        base_url=stack.gateways[0].removesuffix("/v1") + "/api/v1",
        headers={"Authorization": f"Bearer {stack.keys['main-admin']}"}, timeout=60,
    )  # fmt: skip
    detail = management.get("/adapters/support").json()
    old_digest = next(v["digest"] for v in detail["versions"] if v["number"] == detail["current_version"])
    assert old_digest in engine_resident(stack)
    check_engines.delay()  # the worker records what engine-a holds, as the periodic check would
    wait_until(lambda: old_digest in Engine.objects.get(name="engine-a").reported_state().resident_digests(), timeout=60,
               what="engine-a's state recorded")  # fmt: skip

    # weights no other test of the shared stack has loaded, so that only the promotion can make them resident
    folder = build_adapter(stack.model_dir, tmp_path / "adapter-new", seed=15, r=4, targets=["k_proj", "up_proj"])
    files = [("file", (path.name, path.read_bytes())) for path in sorted(folder.iterdir()) if path.is_file()]
    created = management.post("/adapters/support/versions", files=files)
    assert created.status_code == 201, created.text
    number = created.json()["number"]
    version = wait_until(
        lambda: (v := next(v for v in management.get("/adapters/support/versions").json() if v["number"] == number))
        and v["status"] == "ready" and v, timeout=90, what="the new version validated",
    )  # fmt: skip
    new_digest = version["digest"]
    assert new_digest not in engine_resident(stack)

    promoted = management.post("/adapters/support/promote", json={"version": number})
    assert promoted.status_code == 200, promoted.text
    wait_until(lambda: new_digest in engine_resident(stack), timeout=60, what="the new version warmed on engine-a")
