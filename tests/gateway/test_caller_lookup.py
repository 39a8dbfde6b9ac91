"""Requests that arrive together for a key the gateway has not verified yet (or whose cache entry was cleared) read
the database once between them, and each still gets its own answer."""

import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from gateway import caller
from gateway.errors import ApiError
from registry.models import BaseModel
from tests.platform.factories import TenantFactory, make_key

pytestmark = pytest.mark.django_db(transaction=True)  # the lookups run in threads, on connections of their own


@pytest.fixture
def counted_lookups(monkeypatch, settings):
    # No change announcements here: one landing while the lookup runs (this test's own tenant and key, published to a
    # listener an earlier test started) rightly keeps its result out of the cache, and every request looks it up.
    settings.REDIS_URL = ""
    calls = []

    def counted(**kwargs):
        calls.append(kwargs)
        try:
            return caller.caller_and_target(**kwargs)
        finally:
            connection.close()  # the executor's threads outlive the test

    monkeypatch.setattr(caller, "_lookup", sync_to_async(counted, thread_sensitive=False))
    caller._forget_callers()
    yield calls
    caller._forget_callers()


async def _authorize_all(authorization: str, model: str, count: int) -> list:
    return await asyncio.gather(*(caller.authorize(authorization=authorization, model=model) for _ in range(count)),
                                return_exceptions=True)  # fmt: skip


def test_concurrent_requests_for_an_unverified_key_look_it_up_once(counted_lookups):
    BaseModel.objects.create(name="herd", checkpoint_dir="/nowhere", architecture="llama", config={}, max_context=64)
    tenant = TenantFactory(slug="herd")
    _, plaintext = make_key(tenant, scopes=["inference"])
    answers = asyncio.run(_authorize_all(f"Bearer {plaintext}", "herd", 20))
    assert len(counted_lookups) == 1
    assert all(found.tenant_id == tenant.pk and target.base_model == "herd" for found, target in answers)
    caller._forget_callers()  # as an announced change does
    assert len(asyncio.run(_authorize_all(f"Bearer {plaintext}", "herd", 20))) == 20 and len(counted_lookups) == 2


def test_a_refused_key_is_refused_for_every_request(counted_lookups):
    tenant = TenantFactory(slug="herd-refused")
    _, plaintext = make_key(tenant, scopes=["inference"])
    answers = asyncio.run(_authorize_all(f"Bearer {plaintext}x", "herd", 5))  # not the key: never cached
    assert all(isinstance(answer, ApiError) and answer.status == 401 for answer in answers)
    assert len({id(answer) for answer in answers}) == 5  # each request its own error, which it may annotate
