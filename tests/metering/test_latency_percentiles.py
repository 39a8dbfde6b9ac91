"""Latency percentiles and error rate per bucket, as the usage page's chart shows them (PostgreSQL computes them)."""

from datetime import UTC, datetime, timedelta

import pytest

from metering.selectors import usage_buckets
from metering.services import usage_ingest
from tests.metering.usage import gpu_engine, priced_tenant, usage_event

pytestmark = pytest.mark.django_db


def test_each_hour_has_its_latency_percentiles_and_error_rate():
    gpu_engine()
    tenant = priced_tenant("timed")
    hour = datetime(2026, 10, 15, 12, tzinfo=UTC)
    usage_ingest(events=[
        usage_event(tenant, finished_at=hour + timedelta(minutes=minute), e2e_ms=latency,
                    finish_reason="error" if latency == 400.0 else "stop")
        for minute, latency in enumerate((100.0, 200.0, 300.0, 400.0))
    ])  # fmt: skip
    buckets = usage_buckets(tenant=tenant, since=hour, until=hour + timedelta(hours=2), bucket="hour")
    busy, idle = buckets
    assert (busy.latency_p50, busy.latency_p95, busy.latency_p99) == pytest.approx((250.0, 385.0, 397.0))
    assert busy.error_rate == 25.0
    assert (idle.latency_p50, idle.error_rate) == (None, None)
