"""The gateway keeps verified keys and resolved models for 30 s (QUILT_KEY_CACHE_SECONDS, the default with Redis),
so only the change announcement can make a real gateway process see a change in time: a revoked key, a plan's new
limits and budget, a key's new budget and a promoted adapter version each take effect within a second."""

import time
from decimal import Decimal

import httpx
import pytest
from django.test import override_settings

from apikeys.services import api_key_revoke
from registry.models import Adapter, AdapterVersion, BaseModel
from registry.promotion import adapter_promote
from tenancy.audit import Actor
from tenancy.models import Plan
from tests.platform.factories import TenantFactory, make_key
from tests.security.gateways import REDIS_URL, gateways

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
WORST_CASE_SECONDS = 1.0


@pytest.fixture(scope="module")
def gateway(django_db_setup, tmp_path_factory):
    with gateways(tmp_path_factory.mktemp("caller-cache"), 1, QUILT_KEY_CACHE_SECONDS="30") as (urls, env):
        with override_settings(REDIS_URL=REDIS_URL, QUILT_REDIS_KEY_PREFIX=env["QUILT_REDIS_KEY_PREFIX"]):
            yield urls[0]  # changes made by the tests are announced to this gateway


def _until(check, what: str) -> float:
    """Seconds from now until `check()` holds (polled every 10 ms), failing past 10 s."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < 10, f"{what}: still not seen after 10 s"
        time.sleep(0.01)
    return time.monotonic() - started


def _base_model(name: str) -> BaseModel:
    return BaseModel.objects.create(name=name, checkpoint_dir="/nowhere", architecture="llama", config={}, max_context=64)


def _model(url: str, plaintext: str, name: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/models/{name}", headers={"Authorization": f"Bearer {plaintext}"}, timeout=10)


def _complete(url: str, plaintext: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {plaintext}"}, timeout=10,
                      json={"model": model, "prompt": "w1 w2", "max_tokens": 2})  # fmt: skip


def test_a_revoked_key_is_refused_once_announced(gateway):
    _base_model("cache-revoke")
    key, plaintext = make_key(TenantFactory(slug="cache-revoke"), scopes=["inference"])
    assert _model(gateway, plaintext, "cache-revoke").status_code == 200  # verified, now cached for 30 s
    api_key_revoke(actor=Actor.system(), key=key)
    took = _until(lambda: _model(gateway, plaintext, "cache-revoke").status_code == 401, "the revocation")
    assert took < WORST_CASE_SECONDS
    assert "revoked" in _model(gateway, plaintext, "cache-revoke").json()["error"]["message"]


def test_a_plans_limits_and_budget_and_a_keys_budget_apply_once_announced(gateway):
    _base_model("cache-plan")
    plan = Plan.objects.create(slug="cache-plan", name="Cache plan", requests_per_minute=1000, tokens_per_minute=10**7,
                               monthly_token_budget=10**9, price_input_per_mtok=Decimal(1),
                               price_output_per_mtok=Decimal(1))  # fmt: skip
    key, plaintext = make_key(TenantFactory(slug="cache-plan", plan=plan), scopes=["inference"])
    limit = lambda: _model(gateway, plaintext, "cache-plan").headers["x-ratelimit-limit-requests"]  # noqa: E731
    assert limit() == "1000"
    no_engine = _complete(gateway, plaintext, "cache-plan")  # admitted (then no engine serves it)
    assert no_engine.status_code == 503 and no_engine.json()["error"]["code"] == "engine_unavailable"

    plan.requests_per_minute = 999
    plan.save()
    assert _until(lambda: limit() == "999", "the plan's new request limit") < WORST_CASE_SECONDS

    plan.monthly_token_budget = 1  # no request fits any more
    plan.save()
    took = _until(lambda: _complete(gateway, plaintext, "cache-plan").status_code == 429, "the plan's new budget")
    assert took < WORST_CASE_SECONDS
    assert _complete(gateway, plaintext, "cache-plan").json()["error"]["code"] == "insufficient_quota"

    plan.monthly_token_budget = 10**9
    plan.save()
    assert _until(lambda: _complete(gateway, plaintext, "cache-plan").status_code == 503, "the budget raised") < 1.0
    key.monthly_spend_limit = Decimal(0)  # the key's own budget: nothing left
    key.save()
    took = _until(lambda: _complete(gateway, plaintext, "cache-plan").status_code == 429, "the key's new budget")
    assert took < WORST_CASE_SECONDS
    assert _complete(gateway, plaintext, "cache-plan").json()["error"]["code"] == "insufficient_quota"


def test_a_promoted_adapter_version_is_served_once_announced(gateway):
    base = _base_model("cache-base")
    tenant = TenantFactory(slug="cache-adapter")
    _, plaintext = make_key(tenant, scopes=["inference"])
    adapter = Adapter.objects.create(tenant=tenant, name="helper", base_model=base)
    first, _ = (AdapterVersion.objects.create(adapter=adapter, number=number, status=AdapterVersion.Status.READY,
                                              digest=digest * 64) for number, digest in ((1, "a"), (2, "b")))  # fmt: skip
    adapter.current_version = first
    adapter.save()
    version = lambda: _model(gateway, plaintext, "helper").json()["version"]  # noqa: E731
    assert version() == 1  # resolved, now cached for 30 s
    adapter_promote(actor=Actor.system(), adapter=adapter, version_number=2)
    assert _until(lambda: version() == 2, "the promoted version") < WORST_CASE_SECONDS
