"""Beat runs the roll-up and the monthly invoice run under the task names the apps register."""

from datetime import UTC, datetime

import pytest
from celery.schedules import crontab
from django.conf import settings
from freezegun import freeze_time

from billing.models import Invoice
from billing.tasks import issue_invoices
from metering.services import usage_ingest
from quilt.celery import app
from tests.metering.usage import gpu_engine, priced_tenant, usage_event


def test_the_money_entries_of_the_beat_schedule_name_registered_tasks():
    app.loader.import_default_modules()
    schedule = settings.CELERY_BEAT_SCHEDULE
    assert schedule["metering-rollup-usage"]["task"] == "metering.rollup_usage"
    invoices = schedule["billing-issue-invoices"]
    assert invoices["task"] == "billing.issue_invoices"
    assert invoices["schedule"] == crontab(minute=0, hour=3, day_of_month=1)
    for name in (
        "metering.ingest_usage",
        "metering.rollup_usage",
        "billing.issue_invoices",
        "billing.check_budget_alerts",
    ):
        assert name in app.tasks


@pytest.mark.django_db
def test_the_monthly_run_bills_the_month_that_just_ended():
    gpu_engine()
    tenant = priced_tenant("acme")
    usage_ingest(
        events=[
            usage_event(tenant, finished_at=datetime(2026, 10, 31, 23, 59, tzinfo=UTC)),
            usage_event(tenant, finished_at=datetime(2026, 11, 1, 0, 1, tzinfo=UTC)),
        ]
    )
    with freeze_time("2026-11-01 03:00:00"):
        assert issue_invoices() == 1
        assert issue_invoices() == 1
    invoice = Invoice.objects.get()
    assert invoice.month.isoformat() == "2026-10-01" and invoice.lines.get().requests == 1
