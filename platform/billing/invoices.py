"""Monthly invoices: one per tenant per month, from that month's usage events, issued once and never changed.

A line is the month's usage of one model (as requested) at one set of rates, so a mid-month price change gives
two lines. Amount = (input × input rate + cached × cached rate + output × output rate) / 1e6, to the cent.
"""

from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from billing.models import Invoice, InvoiceLine
from metering.models import UsageEvent, UsageMonth
from tenancy.models import Tenant

CENT = Decimal("0.01")
PER_MILLION = Decimal(1_000_000)
RATES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok")


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime.combine(month.replace(day=1), time.min, tzinfo=UTC)
    following = (start.replace(day=28) + timedelta(days=4)).replace(day=1)
    return start, following


def previous_month(today: date) -> date:
    return (today.replace(day=1) - timedelta(days=1)).replace(day=1)


def line_amount(*, input_tokens: int, cached_input_tokens: int, output_tokens: int, rates: tuple) -> Decimal:
    rate_in, rate_cached, rate_out = rates
    exact = (
        input_tokens * rate_in + cached_input_tokens * rate_cached + output_tokens * rate_out
    ) / PER_MILLION
    return exact.quantize(CENT, rounding=ROUND_HALF_UP)


def _lines(*, invoice: Invoice) -> list[InvoiceLine]:
    start, end = month_bounds(invoice.month)
    groups = (
        UsageEvent.objects.filter(tenant_id=invoice.tenant_id, finished_at__gte=start, finished_at__lt=end)
        .order_by()
        .values("model", "base_model", "adapter_version_id", *RATES)
        .annotate(requests=Count("id"), prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"),
                  output=Sum("completion_tokens"))
        .order_by("model", "base_model", "adapter_version_id", *RATES)
    )  # fmt: skip
    lines = []
    for group in groups:
        rates = tuple(group[name] for name in RATES)
        input_tokens = group["prompt"] - group["cached"]
        lines.append(
            InvoiceLine(
                invoice=invoice, model=group["model"], base_model=group["base_model"],
                adapter_version_id=group["adapter_version_id"], requests=group["requests"], input_tokens=input_tokens,
                cached_input_tokens=group["cached"], output_tokens=group["output"],
                **{name: group[name] for name in RATES},
                amount=line_amount(input_tokens=input_tokens, cached_input_tokens=group["cached"],
                                   output_tokens=group["output"], rates=rates),
            )
        )  # fmt: skip
    return lines


def invoice_issue(*, tenant: Tenant, month: date, now: datetime | None = None) -> Invoice:
    """Issues the tenant's invoice for a finished month; returns the existing one, unchanged, if already issued."""
    month = month.replace(day=1)
    now = now or timezone.now()
    if month_bounds(month)[1] > now:
        raise ValidationError(f"{month:%Y-%m} has not ended yet; its invoice can't be issued.")
    with transaction.atomic():
        Invoice.objects.bulk_create(
            [Invoice(tenant=tenant, month=month, number=f"QLT-{month:%Y%m}-{tenant.pk:06d}")],
            ignore_conflicts=True,
        )
        invoice = Invoice.objects.select_for_update().get(tenant=tenant, month=month)
        if invoice.status == Invoice.Status.ISSUED:
            return invoice
        invoice.lines.all().delete()
        lines = InvoiceLine.objects.bulk_create(_lines(invoice=invoice))
        invoice.total = sum((line.amount for line in lines), Decimal(0))
        invoice.status = Invoice.Status.ISSUED
        invoice.issued_at = now
        invoice.save()
    return invoice


def invoices_issue_month(*, month: date, now: datetime | None = None) -> list[Invoice]:
    """Issues the month's invoice of every tenant that used the platform that month (idempotent)."""
    tenant_ids = UsageMonth.objects.filter(month=month.replace(day=1), requests__gt=0).values_list(
        "tenant_id"
    )
    return [
        invoice_issue(tenant=tenant, month=month, now=now)
        for tenant in Tenant.objects.filter(pk__in=tenant_ids).order_by("pk")
    ]
