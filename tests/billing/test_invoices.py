"""Monthly invoices: one per tenant and month, lines per model at each set of rates, issued once, never changed."""

import threading
from datetime import UTC, date, datetime
from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError
from django.db import connection

from billing.invoices import invoice_issue, invoices_issue_month
from billing.models import Invoice, InvoiceIsIssued, InvoiceLine
from billing.tasks import issue_invoices
from metering.models import UsageEvent
from metering.services import usage_ingest
from tenancy.models import Plan
from tests.metering.usage import gpu_engine, priced_tenant, usage_event

pytestmark = pytest.mark.django_db

OCTOBER = date(2026, 10, 1)


def _at(day: int, hour: int = 12) -> datetime:
    return datetime(2026, 10, day, hour, tzinfo=UTC)


@pytest.fixture
def acme():
    gpu_engine()
    tenant = priced_tenant("acme")
    usage_ingest(
        events=[
            usage_event(tenant, model="tiny-llama", finished_at=_at(1, 0)),
            usage_event(
                tenant, model="tiny-llama", finished_at=_at(31, 23), prompt_tokens=10, cached_tokens=0
            ),
            usage_event(tenant, model="support-bot", finished_at=_at(15), completion_tokens=2_000_000),
            usage_event(tenant, model="tiny-llama", finished_at=datetime(2026, 11, 1, tzinfo=UTC)),
        ]
    )
    return tenant


def test_lines_per_model_with_tokens_unit_prices_and_amounts(acme):
    invoice = invoice_issue(tenant=acme, month=OCTOBER)
    lines = {line.model: line for line in invoice.lines.all()}
    assert set(lines) == {"support-bot", "tiny-llama"}
    tiny = lines["tiny-llama"]
    assert (tiny.requests, tiny.input_tokens, tiny.cached_input_tokens, tiny.output_tokens) == (
        2,
        810,
        200,
        600,
    )
    assert (tiny.price_input_per_mtok, tiny.price_output_per_mtok) == (Decimal("0.5"), Decimal("1.5"))
    assert tiny.amount == Decimal("0.00133")  # 0.000875 + 0.000455, exact: only the total is rounded
    bot = lines["support-bot"]
    # 800 × 0.5 + 200 × 0.125 + 2,000,000 × 1.5 = 3,000,425 per million = 3.000425, kept exact
    assert bot.amount == Decimal("3.000425") and bot.output_tokens == 2_000_000
    assert invoice.subtotal == Decimal("3.001755") and invoice.rounding == Decimal("-0.001755")
    assert invoice.total == Decimal("3.00") and invoice.status == "issued" and invoice.issued_at is not None
    assert invoice.number == f"QLT-202610-{acme.pk:06d}"
    exact = sum(event.price for event in UsageEvent.objects.filter(finished_at__month=10))
    assert exact == invoice.subtotal


def test_a_mid_month_price_change_gives_a_second_line(acme):
    Plan.objects.filter(pk=acme.plan_id).update(price_output_per_mtok=Decimal("3"))
    usage_ingest(
        events=[usage_event(acme, model="support-bot", finished_at=_at(20), completion_tokens=1_000_000)]
    )
    lines = invoice_issue(tenant=acme, month=OCTOBER).lines.filter(model="support-bot").order_by("id")
    assert [(line.price_output_per_mtok, line.amount) for line in lines] == [
        (Decimal("1.5"), Decimal("3.000425")),
        (Decimal("3"), Decimal("3.000425")),
    ]


def test_issuing_again_changes_nothing_and_late_usage_goes_on_the_next_invoice(acme):
    first = invoice_issue(tenant=acme, month=OCTOBER)
    lines = list(InvoiceLine.objects.filter(invoice=first).values())
    usage_ingest(
        events=[usage_event(acme, model="support-bot", finished_at=_at(30), completion_tokens=9_000_000)]
    )
    again = invoice_issue(tenant=acme, month=OCTOBER)
    assert again.pk == first.pk and again.total == first.total
    assert list(InvoiceLine.objects.filter(invoice=first).values()) == lines
    assert len(invoices_issue_month(month=OCTOBER)) == 1
    assert issue_invoices("2026-10-01") == 1
    assert Invoice.objects.count() == 1
    november = invoice_issue(tenant=acme, month=date(2026, 11, 1), now=datetime(2026, 12, 1, tzinfo=UTC))
    assert {line.model: line.requests for line in november.lines.all()} == {"support-bot": 1, "tiny-llama": 1}
    assert november.total == Decimal("13.50")  # the late October request: 9M output × 1.5 (+ cents of input)
    assert not UsageEvent.objects.filter(invoice__isnull=True).exists()
    billed = sum(line.requests for line in InvoiceLine.objects.all())
    assert billed == UsageEvent.objects.count() == 5


def test_usage_older_than_any_invoice_is_billed_on_the_first(acme):
    usage_ingest(
        events=[usage_event(acme, model="old", finished_at=datetime(2026, 9, 30, 23, 59, tzinfo=UTC))]
    )
    invoice = invoice_issue(tenant=acme, month=OCTOBER)
    assert {line.model for line in invoice.lines.all()} == {"old", "support-bot", "tiny-llama"}
    assert UsageEvent.objects.get(model="old").invoice == invoice


def test_an_issued_invoice_refuses_every_change(acme):
    invoice = invoice_issue(tenant=acme, month=OCTOBER)
    line = invoice.lines.first()
    invoice.total = Decimal("0.01")
    with pytest.raises(InvoiceIsIssued):
        invoice.save()
    with pytest.raises(InvoiceIsIssued):
        Invoice.objects.filter(pk=invoice.pk).update(total=Decimal(0))
    with pytest.raises(InvoiceIsIssued):
        invoice.delete()
    line.amount = Decimal("99")
    with pytest.raises(InvoiceIsIssued):
        line.save()
    with pytest.raises(InvoiceIsIssued):
        InvoiceLine.objects.filter(invoice=invoice).delete()
    invoice.refresh_from_db()
    assert invoice.total == Decimal("3.00") and invoice.lines.count() == 2


def test_a_month_that_has_not_ended_can_not_be_invoiced(acme):
    with pytest.raises(ValidationError):
        invoice_issue(tenant=acme, month=OCTOBER, now=datetime(2026, 10, 31, 23, 59, tzinfo=UTC))
    assert not Invoice.objects.exists()


def test_the_monthly_run_bills_each_tenant_that_used_the_month(acme):
    idle = priced_tenant("idle")
    other = priced_tenant("other")
    usage_ingest(events=[usage_event(other, finished_at=_at(5))])
    invoices = invoices_issue_month(month=OCTOBER)
    assert sorted(invoice.tenant.slug for invoice in invoices) == ["acme", "other"]
    assert not Invoice.objects.filter(tenant=idle).exists()
    assert {invoice.month for invoice in Invoice.objects.all()} == {OCTOBER}


@pytest.mark.django_db(transaction=True)
def test_concurrent_runs_issue_one_invoice():
    gpu_engine()
    tenant = priced_tenant("acme")
    usage_ingest(events=[usage_event(tenant, finished_at=_at(day)) for day in (1, 2, 3)])
    barrier = threading.Barrier(4)
    issued, errors = [], []

    def issue():
        try:
            barrier.wait()
            issued.append(invoice_issue(tenant=tenant, month=OCTOBER).pk)
        except Exception as error:  # reported below: a thread's failure must fail the test
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=issue) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(set(issued)) == 1 and Invoice.objects.count() == 1
    assert InvoiceLine.objects.get().requests == 3
