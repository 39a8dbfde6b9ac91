"""Revocation and suspension reach every gateway process within a second, by invalidation, not by expiry: the
gateways here keep verified keys for 30 s, so only the change announcement can make them refuse in time."""

import concurrent.futures
import time

import httpx
import pytest
from django.test import override_settings

from apikeys.services import api_key_revoke
from registry.models import BaseModel
from tenancy.audit import Actor
from tenancy.services import tenant_update
from tests.platform.factories import TenantFactory, make_key
from tests.security.conftest import FIGURES
from tests.security.gateways import REDIS_URL, gateways

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
WORST_CASE_SECONDS = 1.0


def _status(url: str, plaintext: str) -> int:
    return httpx.get(f"{url}/v1/models/tiny", headers={"Authorization": f"Bearer {plaintext}"}, timeout=5).status_code


def _seconds_until_refused(urls: list[str], plaintext: str, refused: int, changed_at: float) -> list[float]:
    """Each gateway polled by its own thread: the time from the change to that gateway's first refusal."""

    def poll(url: str) -> float:
        while _status(url, plaintext) != refused:
            assert time.monotonic() - changed_at < 10, f"{url} still accepts the key"
            time.sleep(0.01)
        return time.monotonic() - changed_at

    with concurrent.futures.ThreadPoolExecutor(len(urls)) as pool:
        return list(pool.map(poll, urls))


def test_a_revoked_key_and_a_suspended_tenant_stop_on_every_gateway_within_a_second(tmp_path):
    BaseModel.objects.create(name="tiny", checkpoint_dir="/nowhere", architecture="llama", config={}, max_context=64)
    tenant = TenantFactory(slug="sec-revoke")
    key, plaintext = make_key(tenant, scopes=["inference"])
    _, other_plaintext = make_key(tenant, scopes=["inference"])
    with gateways(tmp_path, 2, QUILT_KEY_CACHE_SECONDS="30") as (urls, env):
        for url in urls:
            for credential in (plaintext, other_plaintext):
                assert _status(url, credential) == 200 and _status(url, credential) == 200  # now cached
        with override_settings(REDIS_URL=REDIS_URL, QUILT_REDIS_KEY_PREFIX=env["QUILT_REDIS_KEY_PREFIX"]):
            api_key_revoke(actor=Actor.system(), key=key)
            revoked_at = time.monotonic()
            revoked = _seconds_until_refused(urls, plaintext, 401, revoked_at)
            assert _status(urls[0], other_plaintext) == 200
            tenant_update(actor=Actor.system(), tenant=tenant, changes={"status": "suspended"})
            suspended_at = time.monotonic()
            suspended = _seconds_until_refused(urls, other_plaintext, 403, suspended_at)
    FIGURES.append(f"revocation took {max(revoked):.3f} s, suspension {max(suspended):.3f} s (slower of 2 gateways)")
    assert max(revoked) < WORST_CASE_SECONDS and max(suspended) < WORST_CASE_SECONDS
