"""The engine's path: `metering.ingest_usage` sent by name over Redis and run by a real Celery worker."""

import time

import pytest

from metering.models import UsageEvent, UsageMonth
from quilt.celery import app
from tests.metering.usage import gpu_engine, priced_tenant, usage_event

pytestmark = pytest.mark.slow


def _wait_for(predicate, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_a_worker_ingests_a_batch_sent_by_name_exactly_once(celery_worker):
    gpu_engine()
    tenant = priced_tenant("acme")
    batch = [usage_event(tenant, request_id=f"w-{n}") for n in range(5)]
    app.send_task("metering.ingest_usage", args=[batch])
    assert _wait_for(lambda: UsageEvent.objects.count() == 5)
    app.send_task("metering.ingest_usage", args=[batch])  # the broker redelivers: a replay
    app.send_task("metering.ingest_usage", args=[[usage_event(tenant, request_id="w-last")]])
    # The worker runs one task at a time, in order: once w-last is in, the replay has been handled.
    assert _wait_for(lambda: UsageEvent.objects.filter(request_id="w-last").exists())
    assert UsageEvent.objects.count() == 6
    month = UsageMonth.objects.get(tenant=tenant)
    assert (month.requests, month.completion_tokens) == (6, 6 * 300)
    assert {event.price for event in UsageEvent.objects.all()} == {month.price / 6}
