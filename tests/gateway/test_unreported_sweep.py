"""The sweep that bills usage no engine reported (a beat task, every 30 s) visits the tenants whose gateway kept a
served request's usage, not every tenant: its database queries and Redis commands are the same with 400 idle tenants
as with 20, in both admission backends, and a tenant it no longer needs to visit is forgotten."""

import json
import threading
import uuid
from contextlib import contextmanager

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext

from gateway.admission import admission_settle, hold_settle, unreported_tenants
from gateway.unreported import unreported_usage_bill
from tenancy.models import Tenant
from tests.platform.factories import TenantFactory

pytestmark = pytest.mark.django_db


def add_idle_tenants(like: Tenant, count: int) -> None:
    start = Tenant.objects.count()
    Tenant.objects.bulk_create(
        Tenant(slug=f"idle-{start + n}", name=f"Idle {start + n}", plan=like.plan) for n in range(count)
    )


def serve_provisionally(tenant: Tenant) -> str:
    """A served request the gateway settled provisionally, keeping the usage it relayed."""
    request_id = uuid.uuid4().hex
    async_to_sync(admission_settle)(tenant_id=tenant.pk, request_id=request_id, tokens=5, spend_micros=1, final=False,
                                    usage=json.dumps({"request_id": request_id}))  # fmt: skip
    return request_id


@contextmanager
def redis_commands():
    """The commands Redis ran on this test's keys (MONITOR, filtered by the key prefix) while the block ran."""
    seen: list[str] = []
    if not settings.REDIS_URL:
        yield seen
        return
    prefix, stop = settings.QUILT_REDIS_KEY_PREFIX, f"{settings.QUILT_REDIS_KEY_PREFIX}:stop-monitor"
    client = redis.Redis.from_url(settings.REDIS_URL)

    def watch(monitor) -> None:
        for command in monitor.listen():
            if stop in command["command"]:
                return
            if prefix in command["command"]:
                seen.append(command["command"])

    with client.monitor() as monitor:
        watcher = threading.Thread(target=watch, args=(monitor,))
        watcher.start()
        try:
            yield seen
        finally:
            client.get(stop)
            watcher.join(timeout=30)
    client.close()


def sweep() -> tuple[int, int]:
    """(database queries, Redis commands) of one sweep; nothing is old enough to bill."""
    with CaptureQueriesContext(connection) as queries, redis_commands() as commands:
        assert unreported_usage_bill(older_than_seconds=3600) == 0
    return len(queries), len(commands)


def test_the_sweep_works_in_proportion_to_the_tenants_with_unreported_usage(backend, tenant):
    active = [tenant, TenantFactory(), TenantFactory()]
    for each in active:
        serve_provisionally(each)
    assert sorted(unreported_tenants()) == sorted(each.pk for each in active)
    add_idle_tenants(tenant, 20)
    few = sweep()
    add_idle_tenants(tenant, 400)
    many = sweep()
    assert few == many, (few, many)
    queries, commands = many
    assert queries <= 2 * len(active) + 2 and commands <= 3 * len(active) + 2, many


def test_a_tenant_is_forgotten_once_its_usage_is_recorded_and_its_mark_is_old(backend, tenant, monkeypatch):
    request_id = serve_provisionally(tenant)
    assert unreported_tenants() == [tenant.pk]
    monkeypatch.setattr("gateway.admission.limits.UNREPORTED_MARK_SECONDS", -1.0)  # every mark is old
    assert unreported_tenants() == [tenant.pk]  # its copy is still waiting for metering
    hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=5, spend=0, final=True)
    assert unreported_tenants() == []
    serve_provisionally(tenant)  # served again: visited again
    assert unreported_tenants() == [tenant.pk]


def test_a_copy_kept_before_any_mark_is_found_by_the_first_sweep(backend, tenant):
    """Copies a gateway kept before tenants were marked (or a Redis that lost the marks): one walk finds them."""
    serve_provisionally(tenant)
    if settings.REDIS_URL:
        redis.Redis.from_url(settings.REDIS_URL).delete(f"{settings.QUILT_REDIS_KEY_PREFIX}:unreported_tenants")
    assert unreported_tenants() == [tenant.pk]
