"""Daily roll-ups agree with the raw events they sum, and recomputing them changes nothing."""

from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest
from freezegun import freeze_time

from metering.models import UsageDaily, UsageEvent
from metering.rollups import usage_rollup_day, usage_rollup_recent
from metering.selectors import usage_by_day, usage_grouped
from metering.services import usage_ingest
from tests.metering.usage import adapter_version, gpu_engine, priced_tenant, usage_event
from tests.platform.factories import make_key

pytestmark = pytest.mark.django_db

DAYS = [datetime(2026, 10, day, hour, tzinfo=UTC) for day in (3, 4, 5) for hour in (0, 13, 23)]


def _events(tenant, keys, version=None):
    events = []
    for number, finished_at in enumerate(DAYS):
        for model in ("tiny-llama", "support-bot"):
            for key in keys:
                events.append(
                    usage_event(
                        tenant, model=model, api_key_id=key, finished_at=finished_at + timedelta(seconds=number),
                        prompt_tokens=100 + number, cached_tokens=number, completion_tokens=10 * number + 1,
                        metadata={"adapter_version_id": version.pk} if version and model == "support-bot" else {},
                    )
                )  # fmt: skip
    return events


def _expected(events) -> dict:
    """The oracle: sums computed from the event dicts themselves, per (day, model, key prefix)."""
    sums = defaultdict(lambda: [0, 0, 0, 0])
    for event in events:
        day = datetime.fromisoformat(event["finished_at"]).date()
        group = sums[(day, event["metadata"]["model"], (event["api_key_id"] or ""))]
        group[0] += 1
        group[1] += event["prompt_tokens"]
        group[2] += event["cached_tokens"]
        group[3] += event["completion_tokens"]
    return {key: tuple(value) for key, value in sums.items()}


def _rolled(tenant) -> dict:
    return {
        (row.day, row.model, row.api_key_prefix): (row.requests, row.prompt_tokens, row.cached_tokens,
                                                   row.completion_tokens)
        for row in UsageDaily.objects.filter(tenant=tenant)
    }  # fmt: skip


@pytest.fixture
def tenants():
    gpu_engine()
    return priced_tenant("acme"), priced_tenant("globex")


def test_rollups_reconcile_with_the_raw_events(tenants):
    acme, globex = tenants
    key, _ = make_key(acme, scopes=["inference"])
    version = adapter_version(acme)
    events = _events(acme, [key.prefix, None], version)
    usage_ingest(events=events + _events(globex, [None]))
    assert usage_rollup_recent() == 6  # three days for each of two tenants
    assert _rolled(acme) == _expected(events)
    rows = UsageDaily.objects.filter(tenant=acme)
    raw = UsageEvent.objects.filter(tenant=acme)
    assert sum(row.price for row in rows) == sum(event.price for event in raw)
    assert sum(row.cost for row in rows) == sum(event.cost for event in raw)
    assert sum(row.gpu_ms for row in rows) == sum(event.gpu_ms for event in raw)
    assert {row.adapter_version_id for row in rows if row.model == "support-bot"} == {version.pk}
    assert {row.adapter_version_id for row in rows if row.model == "tiny-llama"} == {None}


def test_recomputing_changes_nothing_and_a_late_event_is_picked_up(tenants):
    acme, _ = tenants
    events = _events(acme, [None])
    with freeze_time("2026-10-06 00:05:00"):
        usage_ingest(events=events)
    with freeze_time("2026-10-06 00:30:00"):
        usage_rollup_recent()
        before = _rolled(acme)
        usage_ingest(events=events)  # a replay
        usage_rollup_recent()
        usage_rollup_day(tenant_id=acme.pk, day=date(2026, 10, 4))
        assert _rolled(acme) == before
    late = usage_event(
        acme, finished_at=datetime(2026, 10, 3, 5, tzinfo=UTC), prompt_tokens=7, cached_tokens=0
    )
    with freeze_time("2026-10-06 01:00:00"):
        usage_ingest(events=[late])
        assert usage_rollup_recent() == 1  # only the late event's day is recomputed
    assert _rolled(acme) == _expected([*events, late])


def test_usage_reads_the_same_before_and_after_the_rollup(tenants):
    acme, _ = tenants
    usage_ingest(events=_events(acme, [None]))
    since, until = date(2026, 10, 1), date(2026, 10, 31)
    raw = usage_by_day(tenant=acme, since=since, until=until)
    usage_rollup_recent()
    assert UsageEvent.objects.filter(tenant=acme).exists() and UsageDaily.objects.filter(tenant=acme).exists()
    UsageEvent.objects.filter(tenant=acme).update(price=Decimal(0))  # now only the roll-ups know the prices
    rolled = usage_by_day(tenant=acme, since=since, until=until)
    assert [(row.group, row.requests, row.total_tokens, row.price) for row in rolled] == [
        (row.group, row.requests, row.total_tokens, row.price) for row in raw
    ]
    assert [row.group for row in rolled] == ["2026-10-03", "2026-10-04", "2026-10-05"]
    by_model = usage_grouped(tenant=acme, since=since, until=until, group_by="model")
    assert [(row.group, row.requests) for row in by_model] == [("support-bot", 9), ("tiny-llama", 9)]
    assert usage_by_day(tenant=acme, since=date(2026, 10, 4), until=date(2026, 10, 4))[0].requests == 6
