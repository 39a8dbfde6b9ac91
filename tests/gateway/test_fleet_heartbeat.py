"""The control plane's heartbeat endpoint, in process: the engine token is required, a static engine's name is not
taken over, bad fields are refused, a heartbeat puts an engine in routing until it expires or says it drains."""

from datetime import timedelta

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from gateway.models import Engine
from gateway.routing import routable_engines
from tenancy.models import AuditLog
from tests.engine_states import engine_state_json

pytestmark = pytest.mark.django_db

TOKEN = "fleet-heartbeat-test-token"
URL = "/internal/engines/heartbeat"


def routed() -> set[str]:
    return set(routable_engines().values_list("name", flat=True))


def audits(action: str) -> int:
    engine = Engine.objects.get(name="gpu-7")
    return AuditLog.objects.filter(action=action, target_id=str(engine.pk)).count()


def beat(body: dict, token: str = TOKEN):
    return Client().post(URL, body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}")


def body(**changes) -> dict:
    return {"name": "gpu-7", "url": "http://10.0.0.7:8100/", "pool": "h100", "gpu_price_per_hour": "2.75",
            "interval_s": 1.0, "draining": False, "state": engine_state_json(running=1, capacity=8)} | changes


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
def test_heartbeats_join_expire_and_drain():
    answer = beat(body())
    assert answer.status_code == 200, answer.content
    engine = Engine.objects.get(name="gpu-7")
    assert engine.self_registered and engine.healthy and engine.url == "http://10.0.0.7:8100"
    assert str(engine.gpu_price_per_hour) == "2.7500" and engine.pool == "h100"
    assert "gpu-7" in routed()  # (beside the gateway stack's engines, when its tests share this database)
    assert audits("engine.join") == 1
    assert beat(body()).status_code == 200
    assert audits("engine.join") == 1  # a heartbeat is not a new join

    Engine.objects.filter(name="gpu-7").update(heartbeat_expires_at=timezone.now() - timedelta(seconds=1))
    assert "gpu-7" not in routed()  # missed its heartbeats
    assert beat(body()).status_code == 200
    assert "gpu-7" in routed()
    assert audits("engine.join") == 2

    assert beat(body(draining=True)).status_code == 200
    assert "gpu-7" not in routed()
    assert audits("engine.leave") == 1
    assert Engine.objects.filter(name="gpu-7").exists()  # kept: usage still being metered names it


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
def test_refusals():
    self_registered = Engine.objects.filter(self_registered=True).count()
    assert beat(body(), token="wrong").status_code == 401
    assert Client().post(URL, body(), content_type="application/json").status_code == 401
    Engine.objects.create(name="static-1", url="http://10.0.0.1:8100")
    answer = beat(body(name="static-1"))
    assert answer.status_code == 409 and "statically" in answer.json()["error"]["message"]
    assert not Engine.objects.get(name="static-1").self_registered
    for bad in (body(interval_s=0), body(interval_s="1"), body(gpu_price_per_hour="cheap"),
                body(gpu_price_per_hour="-1"), body(url="not a url"), body(name="no spaces"), body(extra=1)):
        answer = beat(bad)
        assert answer.status_code == 400, (bad, answer.content)
        assert answer.json()["error"]["type"] == "invalid_request_error"
    assert Client().post(URL, b"{", content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 400
    assert Engine.objects.filter(self_registered=True).count() == self_registered  # nothing half-written


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
def test_the_role_is_stored_and_checked():
    assert beat(body()).status_code == 200
    assert Engine.objects.get(name="gpu-7").role == "both"  # an engine that does not say: the default
    for role in ("prefill", "decode", "both"):
        assert beat(body(state=engine_state_json(role=role))).status_code == 200
        assert Engine.objects.get(name="gpu-7").role == role
    answer = beat(body(state=engine_state_json() | {"role": "encode"}))
    assert answer.status_code == 400 and "`$.state.role`" in answer.json()["error"]["message"]
    assert Engine.objects.get(name="gpu-7").role == "both"


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
@pytest.mark.parametrize(("state", "named"), [
    (engine_state_json() | {"running": "two"}, "`$.state.running`"),
    (engine_state_json() | {"adapters": engine_state_json()["adapters"] | {"residency": [{"digest": "ab" * 32}]}},
     "missing required field `tier` - at `$.state.adapters.residency[0]`"),
    ({k: v for k, v in engine_state_json().items() if k != "capacity"}, "missing required field `capacity`"),
    (engine_state_json() | {"v": 2}, "engine state version 2 is not the version this side speaks (1)"),
])  # fmt: skip
def test_a_state_that_cannot_be_read_is_refused_naming_it_and_the_engine_leaves_routing(state, named):
    assert beat(body()).status_code == 200 and "gpu-7" in routed()
    answer = beat(body(state=state))
    assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.content
    engine = Engine.objects.get(name="gpu-7")
    assert not engine.healthy and named in engine.last_error and "gpu-7" not in routed()
    assert engine.reported_state().running == 1  # the last state it could read is kept
    assert beat(body()).status_code == 200 and "gpu-7" in routed()


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
def test_a_heartbeat_of_another_version_is_refused_naming_it():
    answer = beat(body(v=2))
    assert answer.status_code == 400
    assert "heartbeat version 2 is not the version this side speaks (1)" in answer.json()["error"]["message"]
    assert not Engine.objects.filter(name="gpu-7").exists()


@override_settings(QUILT_ENGINE_TOKEN="")
def test_no_engine_token_configured_refuses_everyone():
    assert beat(body(), token="").status_code == 401


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
@pytest.mark.parametrize("url", ["http://engine_prefill:8100", "http://engine-prefill:8100", "http://prefill_1.svc:8100/",
                                 "https://gpu_7.pool.internal", "http://[fd00::7]:8100"])
def test_any_host_the_resolver_takes_joins(url):
    """An engine advertised by a compose service or pod hostname (underscores, one label, no TLD) joins: the control
    plane refused these as "Enter a valid URL." (Django's URL rule wants public domain names), so a prefill engine
    named `engine_prefill` never joined at all."""
    answer = beat(body(url=url))
    assert answer.status_code == 200, answer.content
    assert Engine.objects.get(name="gpu-7").url == url.rstrip("/")


@override_settings(QUILT_ENGINE_TOKEN=TOKEN)
@pytest.mark.parametrize("url", ["ftp://10.0.0.7:8100", "http://", "http://engine prefill:8100", "http://host:99999",
                                 "10.0.0.7:8100", "http://user:pw@10.0.0.7:8100", "http://-bad:8100"])
def test_an_engine_url_still_has_to_be_one(url):
    answer = beat(body(url=url))
    assert answer.status_code == 400, (url, answer.content)
    assert not Engine.objects.filter(name="gpu-7").exists()
