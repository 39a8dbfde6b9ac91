"""The upcoming invoice (what issuing now would bill) and staff issuing a month's invoices from the console."""

from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.invoices import invoice_issue, previous_month
from billing.models import Invoice
from console.money_format import money_text
from metering.services import usage_ingest
from tenancy.models import AuditLog
from tests.console.builders import usage_event

pytestmark = pytest.mark.django_db


def test_the_upcoming_invoice_shows_what_issuing_would_bill(tenant, member_of):
    client, _ = member_of(tenant, "admin")
    usage_ingest(events=[usage_event(tenant, prompt_tokens=1_000_000, cached_tokens=0, completion_tokens=500_000)])
    page = client.get(reverse("console:billing", kwargs={"slug": tenant.slug}))
    preview = page.context["preview"]
    assert len(preview.lines) == 1 and preview.requests == 1
    # What the invoice for this month will say once the month is over: the same lines, the same total.
    month_end = (timezone.now().date().replace(day=28) + timedelta(days=4)).replace(day=1)
    after_month = datetime.combine(month_end, datetime.min.time(), tzinfo=UTC)
    issued = invoice_issue(tenant=tenant, month=timezone.now().date(), now=after_month)
    assert issued.total == preview.total and preview.total > 0
    assert [line.amount for line in issued.lines.all()] == [line.amount for line in preview.lines]
    assert f'data-testid="preview-total">{money_text(preview.total)}<' in page.content.decode()


def test_the_upcoming_invoice_includes_fine_tuning_lines_as_issuing_bills_them(tenant, member_of):
    from decimal import Decimal

    from finetuning.models import FineTuningJob, TrainingFile
    from registry.models import BaseModel

    client, _ = member_of(tenant, "admin")
    usage_ingest(events=[usage_event(tenant, prompt_tokens=1_000_000, cached_tokens=0, completion_tokens=500_000)])
    base = BaseModel.objects.create(name="bill-base", checkpoint_dir="/x", architecture="llama", config={},
                                    max_context=256)  # fmt: skip
    data = TrainingFile.objects.create(tenant=tenant, filename="a.jsonl", bytes=1, storage_key="k",
                                       method="supervised", examples=10)  # fmt: skip
    job = FineTuningJob.objects.create(
        tenant=tenant, base_model=base, training_file=data, method="supervised", suffix="tuned", seed=1,
        hyperparameters={}, status=FineTuningJob.Status.SUCCEEDED, trained_tokens=2_000_000,
        price_training_per_mtok=Decimal("3.000000"), fine_tuned_model="tuned", finished_at=timezone.now(),
    )  # fmt: skip
    page = client.get(reverse("console:billing", kwargs={"slug": tenant.slug}))
    preview = page.context["preview"]
    training = [line for line in preview.lines if line.model.startswith(f"fine-tuning {job.public_id}")]
    assert len(preview.lines) == 2 and [line.amount for line in training] == [Decimal("6.00")]
    job.refresh_from_db()
    assert job.invoice_id is None, "the preview claims nothing"
    assert f"fine-tuning {job.public_id}" in page.content.decode()
    month_end = (timezone.now().date().replace(day=28) + timedelta(days=4)).replace(day=1)
    after_month = datetime.combine(month_end, datetime.min.time(), tzinfo=UTC)
    issued = invoice_issue(tenant=tenant, month=timezone.now().date(), now=after_month)
    assert issued.total == preview.total
    assert sorted((line.model, line.amount) for line in issued.lines.all()) == sorted(
        (line.model, line.amount) for line in preview.lines
    )


def test_staff_issue_last_months_invoices_once(tenant, other_tenant, staff_client):
    last_month = previous_month(timezone.now().date())
    finished = datetime.combine(last_month + timedelta(days=3), datetime.min.time(), tzinfo=UTC)
    usage_ingest(events=[usage_event(tenant, finished_at=finished), usage_event(other_tenant, finished_at=finished)])
    url = reverse("console:invoicing")
    page = staff_client.get(url)
    assert page.context["month"] == last_month and len(page.context["state"].pending_tenants) == 2
    assert b'data-testid="issue-invoices">Issue 2 invoices' in page.content
    done = staff_client.post(reverse("console:invoicing-issue"), {"month": f"{last_month:%Y-%m}"}, follow=True)
    assert b"Issued 2 invoices for" in done.content
    assert Invoice.objects.filter(month=last_month, status="issued").count() == 2
    assert AuditLog.objects.filter(action="invoice.issue").count() == 2
    again = staff_client.post(reverse("console:invoicing-issue"), {"month": f"{last_month:%Y-%m}"}, follow=True)
    assert b"Nothing to issue" in again.content and AuditLog.objects.filter(action="invoice.issue").count() == 2


def test_the_current_month_can_not_be_issued_and_members_can_not_issue(tenant, member_of, staff_client):
    this_month = timezone.now().date()
    refused = staff_client.post(reverse("console:invoicing-issue"), {"month": f"{this_month:%Y-%m}"}, follow=True)
    assert b"has not ended yet" in refused.content and not Invoice.objects.exists()
    client, _ = member_of(tenant, "owner")
    assert client.post(reverse("console:invoicing-issue"), {"month": f"{this_month:%Y-%m}"}).status_code == 403


@pytest.mark.parametrize("month", ["9999-12", "0001-01", "2026-13", "nonsense"])
def test_a_month_the_calendar_can_not_bound_falls_back_to_last_month(staff_client, month):
    page = staff_client.get(reverse("console:invoicing") + f"?month={month}")
    assert page.status_code == 200 and page.context["month"] == previous_month(timezone.now().date())
    done = staff_client.post(reverse("console:invoicing-issue"), {"month": month})
    assert done.status_code == 302
