"""Monthly invoices: one per tenant per month, issued once and never changed.

An invoice bills every usage event that finished by its month's end and no earlier invoice billed: the month's
own usage, plus any that arrived after an earlier month was invoiced. Each event records its invoice, so each is
billed exactly once. A line is one model (as requested) at one set of rates, so a mid-month price change gives
two lines.

Rounding rule: money stays exact until the invoice's total. A line's amount is metering's price function over the
line's token sums, exact to 12 decimal places (it equals the sum of its requests' prices); the subtotal is the exact
sum of the lines; the total is the subtotal rounded ONCE to the cent, half up; then, if the plan sets a monthly
minimum charge and the rounded subtotal is below it, the difference is added as the minimum charge. So 10,000
requests of $0.000004 bill $0.04, and no rounding ever bills less (or more) than half a cent off what was used.
"""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from billing.models import Invoice, InvoiceLine
from metering.models import UsageEvent
from metering.pricing import Rates, request_price
from tenancy.models import Tenant

CENT = Decimal("0.01")
RATES = ("price_input_per_mtok", "price_cached_input_per_mtok", "price_output_per_mtok")
# Lines from other apps (fine-tuning's training tokens): each source claims for the invoice, inside its
# transaction, what it bills up to the month's end, and returns those lines unsaved. Apps append in ready().
# Called as source(invoice=..., until=..., claim=False) by the upcoming-invoice preview: read only, same lines.
LINE_SOURCES: list[Callable[..., list[InvoiceLine]]] = []


def month_bounds(month: date) -> tuple[datetime, datetime]:
    start = datetime.combine(month.replace(day=1), time.min, tzinfo=UTC)
    following = (start.replace(day=28) + timedelta(days=4)).replace(day=1)
    return start, following


def previous_month(today: date) -> date:
    return (today.replace(day=1) - timedelta(days=1)).replace(day=1)


def line_amount(*, input_tokens: int, cached_input_tokens: int, output_tokens: int, rates: tuple) -> Decimal:
    """metering's price function over the line's sums (`input_tokens` are the uncached ones), exact (not rounded)."""
    return request_price(
        rates=Rates(*rates), prompt_tokens=input_tokens + cached_input_tokens, cached_tokens=cached_input_tokens,
        completion_tokens=output_tokens,
    )  # fmt: skip


@dataclass(frozen=True)
class InvoiceTotal:
    subtotal: Decimal  # the lines' exact sum
    rounding: Decimal  # total - subtotal - minimum_charge: what rounding to the cent added (negative: took off)
    minimum_charge: Decimal  # what the plan's monthly minimum added on top of the rounded subtotal
    total: Decimal  # to the cent


def invoice_total(*, line_amounts, minimum: Decimal | None) -> InvoiceTotal:
    """The one rounding of an invoice (the rule in this module's docstring)."""
    subtotal = sum(line_amounts, Decimal(0))
    rounded = subtotal.quantize(CENT, rounding=ROUND_HALF_UP)
    minimum_charge = max((minimum or Decimal(0)) - rounded, Decimal(0)) if subtotal > 0 else Decimal(0)
    return InvoiceTotal(
        subtotal=subtotal, rounding=rounded - subtotal, minimum_charge=minimum_charge, total=rounded + minimum_charge
    )


def usage_lines(*, events, invoice: Invoice | None) -> list[InvoiceLine]:
    """One unsaved line per model, adapter version and rates over `events` (a UsageEvent queryset): what issuing
    bills and what the upcoming-invoice preview shows."""
    groups = (
        events.order_by()
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
        unbilled = UsageEvent.objects.filter(
            tenant=tenant, invoice__isnull=True, finished_at__lt=month_bounds(month)[1]
        )
        unbilled.update(invoice=invoice)
        extra = [line for source in LINE_SOURCES for line in source(invoice=invoice, until=month_bounds(month)[1])]
        usage = usage_lines(events=UsageEvent.objects.filter(invoice=invoice), invoice=invoice)
        lines = InvoiceLine.objects.bulk_create(usage + extra)
        figures = invoice_total(line_amounts=[line.amount for line in lines], minimum=tenant.plan.minimum_monthly_charge)
        invoice.subtotal, invoice.minimum_charge, invoice.total = figures.subtotal, figures.minimum_charge, figures.total
        invoice.status = Invoice.Status.ISSUED
        invoice.issued_at = now
        invoice.save()
    return invoice


def invoices_issue_month(*, month: date, now: datetime | None = None) -> list[Invoice]:
    """Issues the month's invoice of every tenant with usage not billed yet; those issued before stay as they are."""
    month = month.replace(day=1)
    unbilled = UsageEvent.objects.filter(invoice__isnull=True, finished_at__lt=month_bounds(month)[1])
    tenants = Tenant.objects.filter(Q(pk__in=unbilled.values("tenant_id")) | Q(invoices__month=month))
    return [
        invoice_issue(tenant=tenant, month=month, now=now) for tenant in tenants.distinct().order_by("pk")
    ]
