"""Invoices bill what was used: lines stay exact, the total is rounded once (half up, to the cent), a minimum charge
is the plan's setting only, and the invoice, the staff page, the tenant's billing page and both CSVs agree."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from billing.invoices import invoice_issue, invoice_total
from billing.selectors import invoice_preview
from metering.models import UsageEvent
from metering.services import usage_ingest
from tests.console.conftest import logged_in
from tests.metering.usage import gpu_engine, priced_tenant, usage_event
from tests.platform.conftest import client_for_key
from tests.platform.factories import MembershipFactory, UserFactory, make_key

pytestmark = pytest.mark.django_db

MICRO_PRICED = {  # 4 uncached input tokens at $1 per million: $0.000004 a request
    "price_input_per_mtok": Decimal("1"), "price_cached_input_per_mtok": Decimal("0"),
    "price_output_per_mtok": Decimal("0"),
}  # fmt: skip


def _micro_requests(tenant, count: int, *, finished_at: datetime) -> None:
    """`count` requests of 4 input tokens: one through metering's ingest (so the price is metering's), the rest
    copies of its row with their own request ids (ingesting each would settle 10,000 holds one by one)."""
    usage_ingest(events=[usage_event(tenant, finished_at=finished_at, prompt_tokens=4, cached_tokens=0,
                                     completion_tokens=0)])  # fmt: skip
    first = UsageEvent.objects.get(tenant=tenant)
    assert first.price == Decimal("0.000004")
    copies = []
    for number in range(1, count):
        copies.append(UsageEvent(**{
            field.attname: getattr(first, field.attname) for field in UsageEvent._meta.concrete_fields
            if field.attname not in ("id", "request_id")
        }, request_id=f"{first.request_id}-{number}"))  # fmt: skip
    UsageEvent.objects.bulk_create(copies, batch_size=2000)


def _after_this_month() -> datetime:
    today = timezone.now().date()
    following = (today.replace(day=28) + timedelta(days=4)).replace(day=1)
    return datetime.combine(following, datetime.min.time(), tzinfo=UTC)


def test_ten_thousand_requests_of_four_micro_dollars_bill_four_cents_everywhere():
    gpu_engine()
    tenant = priced_tenant("micro", **MICRO_PRICED)
    _micro_requests(tenant, 10_000, finished_at=timezone.now() - timedelta(seconds=5))

    # The staff page's "billed" figure is the upcoming invoice's total.
    staff_page = logged_in(UserFactory(is_staff=True)).get(reverse("console:tenant-detail", args=[tenant.slug]))
    assert 'data-testid="billed">$0.04<' in staff_page.content.decode()
    owner = logged_in(MembershipFactory(tenant=tenant, role="owner").user)
    billing_page = owner.get(reverse("console:billing", args=[tenant.slug])).content.decode()
    assert 'data-testid="preview-total">$0.04<' in billing_page
    assert 'data-testid="preview-subtotal">$0.04<' in billing_page

    invoice = invoice_issue(tenant=tenant, month=timezone.now().date(), now=_after_this_month())
    (line,) = invoice.lines.all()
    assert (line.requests, line.input_tokens, line.amount) == (10_000, 40_000, Decimal("0.04"))
    assert (invoice.subtotal, invoice.rounding, invoice.minimum_charge, invoice.total) == (
        Decimal("0.04"), Decimal(0), Decimal(0), Decimal("0.04"),
    )  # fmt: skip

    page = owner.get(reverse("console:invoice", args=[tenant.slug, invoice.pk])).content.decode()
    assert 'data-testid="invoice-total">$0.04<' in page and 'data-testid="subtotal">$0.04<' in page
    console_csv = owner.get(reverse("console:invoice-csv", args=[tenant.slug, invoice.pk])).content.decode()
    api_csv = client_for_key(make_key(tenant, scopes=("admin",))[1]).get(f"/api/v1/invoices/{invoice.pk}.csv")
    assert console_csv == api_csv.content.decode()
    rows = {row["model"]: row["amount"] for row in csv.DictReader(io.StringIO(console_csv))}
    assert rows == {"tiny-llama": "0.04", "subtotal": "0.04", "rounding": "0.00", "minimum_charge": "0.00",
                    "total": "0.04"}  # fmt: skip


def test_lines_keep_every_decimal_and_the_total_is_rounded_once_half_up():
    gpu_engine()
    tenant = priced_tenant("halves", **MICRO_PRICED)
    # 1,250 requests = $0.005 exactly: lines rounded one by one would bill $0.00 (or a cent per line); the total
    # is rounded once, half up.
    _micro_requests(tenant, 1_250, finished_at=timezone.now() - timedelta(seconds=5))
    invoice = invoice_issue(tenant=tenant, month=timezone.now().date(), now=_after_this_month())
    assert [line.amount for line in invoice.lines.all()] == [Decimal("0.005")]
    assert (invoice.subtotal, invoice.rounding, invoice.total) == (Decimal("0.005"), Decimal("0.005"), Decimal("0.01"))
    owner = logged_in(MembershipFactory(tenant=tenant, role="owner").user)
    page = owner.get(reverse("console:invoice", args=[tenant.slug, invoice.pk])).content.decode()
    assert ">$0.005<" in page and 'data-testid="rounding">$0.005<' in page


def test_the_rounding_rule():
    assert invoice_total(line_amounts=[Decimal("0.004999")], minimum=None).total == Decimal("0.00")
    assert invoice_total(line_amounts=[Decimal("0.0025"), Decimal("0.0025")], minimum=None).total == Decimal("0.01")
    many = invoice_total(line_amounts=[Decimal("0.000004")] * 10_000, minimum=Decimal(0))
    assert (many.subtotal, many.total) == (Decimal("0.04"), Decimal("0.04"))


def test_a_minimum_charge_is_the_plans_setting_and_only_then():
    gpu_engine()
    tenant = priced_tenant("small", **MICRO_PRICED, minimum_monthly_charge=Decimal("5.00"))
    _micro_requests(tenant, 10, finished_at=timezone.now() - timedelta(seconds=5))
    preview = invoice_preview(tenant=tenant, month=timezone.now().date())
    invoice = invoice_issue(tenant=tenant, month=timezone.now().date(), now=_after_this_month())
    assert (invoice.subtotal, invoice.minimum_charge, invoice.total) == (Decimal("0.00004"), Decimal("5.00"),
                                                                       Decimal("5.00"))  # fmt: skip
    assert preview.total == invoice.total and preview.minimum_charge == invoice.minimum_charge
    assert invoice_total(line_amounts=[Decimal("7.123")], minimum=Decimal("5")).total == Decimal("7.12")
    assert invoice_total(line_amounts=[], minimum=Decimal("5")).total == Decimal(0)  # no usage, no invoice amount
