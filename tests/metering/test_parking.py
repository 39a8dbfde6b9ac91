"""A batch ingest fails on for good is parked, never dropped, and replays once the cause is fixed."""

import pytest
from django.core.management import call_command

from metering.models import ParkedUsageBatch, UsageEvent
from metering.parking import usage_batch_park
from metering.tasks import ingest_usage
from tests.metering.usage import gpu_engine, priced_tenant, usage_event

pytestmark = pytest.mark.django_db


def test_a_batch_the_task_can_not_read_is_parked_with_its_error():
    result = ingest_usage.apply(args=[{"not": "a list"}])
    assert result.failed()
    parked = ParkedUsageBatch.objects.get()
    assert parked.events == {"not": "a list"} and "TypeError" in parked.error and parked.task_id == result.id
    with pytest.raises(SystemExit):
        call_command("replay_usage")  # still failing: stays parked
    assert ParkedUsageBatch.objects.filter(replayed_at__isnull=True).count() == 1


def test_replaying_ingests_the_parked_events_once():
    gpu_engine()
    tenant = priced_tenant("acme")
    events = [usage_event(tenant, request_id=f"p-{n}") for n in range(3)]
    ingest_usage.apply(args=[events[:1]])
    usage_batch_park(events=events, error="OperationalError: the database went away")
    call_command("replay_usage")
    call_command("replay_usage")
    assert sorted(UsageEvent.objects.values_list("request_id", flat=True)) == ["p-0", "p-1", "p-2"]
    assert ParkedUsageBatch.objects.get().replayed_at is not None
