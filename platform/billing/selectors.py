"""Reads over invoices and the staff margin report.

Who may read a tenant's billing (its invoices, their lines and CSVs, the upcoming invoice) is decided here, once,
for the console and the API alike: the admin role and above (the roles as the Members page states them:
"admins also manage members and see billing"), platform staff, and keys with the `admin` scope whose maker is
still an admin there. A viewer or developer (or a `usage:read` key) gets 403 from both doors.
"""

from dataclasses import dataclass
from datetime import date
from decimal import Decimal

from django.db.models import QuerySet

from billing.models import Invoice
from metering.models import UsageMonth
from tenancy.audit import Actor
from tenancy.authority import require_role
from tenancy.models import Membership, Tenant

BILLING_ROLE = Membership.Role.ADMIN


def billing_read_check(*, reader: Actor, tenant: Tenant) -> None:
    """NotAllowed (a 403 in the API and the console) unless `reader` may read `tenant`'s billing."""
    require_role(actor=reader, tenant=tenant, minimum=BILLING_ROLE, doing="read billing and invoices")


@dataclass(frozen=True)
class TenantMargin:
    tenant: Tenant
    month: date
    requests: int
    total_tokens: int
    revenue: Decimal
    gpu_cost: Decimal
    margin: Decimal
    margin_ratio: Decimal | None
    uncosted_requests: int


def invoices_of(*, tenant: Tenant, reader: Actor) -> QuerySet[Invoice]:
    billing_read_check(reader=reader, tenant=tenant)
    return Invoice.objects.filter(tenant=tenant).order_by("-month", "-id")


def invoice_with_lines(*, tenant: Tenant, invoice_id: int, reader: Actor) -> Invoice | None:
    return invoices_of(tenant=tenant, reader=reader).prefetch_related("lines").filter(pk=invoice_id).first()


def tenant_margin(*, month: date) -> list[TenantMargin]:
    """Per tenant for the month: revenue (usage at its prices), attributed GPU cost, and the difference."""
    rows = (
        UsageMonth.objects.filter(month=month.replace(day=1))
        .select_related("tenant")
        .order_by("tenant__slug")
    )
    report = []
    for row in rows:
        margin = row.price - row.cost
        report.append(
            TenantMargin(
                tenant=row.tenant, month=row.month, requests=row.requests, total_tokens=row.total_tokens,
                revenue=row.price, gpu_cost=row.cost, margin=margin,
                margin_ratio=(margin / row.price).quantize(Decimal("0.0001")) if row.price else None,
                uncosted_requests=row.uncosted_requests,
            )
        )  # fmt: skip
    return report


@dataclass(frozen=True)
class MarginTotals:
    requests: int
    total_tokens: int
    revenue: Decimal
    gpu_cost: Decimal
    margin: Decimal
    margin_ratio: Decimal | None  # margin / revenue, same sign as margin; None without revenue


def margin_totals(*, month: date) -> MarginTotals:
    """The platform's month: every tenant's revenue, GPU cost and margin added up (the staff overview)."""
    rows = tenant_margin(month=month)
    revenue = sum((row.revenue for row in rows), Decimal(0))
    cost = sum((row.gpu_cost for row in rows), Decimal(0))
    margin = revenue - cost
    return MarginTotals(
        requests=sum(row.requests for row in rows), total_tokens=sum(row.total_tokens for row in rows),
        revenue=revenue, gpu_cost=cost, margin=margin,
        margin_ratio=(margin / revenue).quantize(Decimal("0.0001")) if revenue else None,
    )  # fmt: skip


@dataclass(frozen=True)
class InvoicePreview:
    """What the tenant's invoice for `month` would bill if issued now: unsaved lines, priced as issuing prices
    them (invoices.line_amount), over the same usage (finished by the month's end, not billed yet), and totalled
    by the same rounding (invoices.invoice_total)."""

    tenant: Tenant
    month: date
    lines: list
    subtotal: Decimal
    rounding: Decimal
    minimum_charge: Decimal
    total: Decimal
    requests: int


def invoice_preview(*, tenant: Tenant, month: date) -> InvoicePreview:
    from billing.invoices import LINE_SOURCES, invoice_total, month_bounds, usage_lines
    from metering.models import UsageEvent

    month = month.replace(day=1)
    unbilled = UsageEvent.objects.filter(tenant=tenant, invoice__isnull=True, finished_at__lt=month_bounds(month)[1])
    lines = usage_lines(events=unbilled, invoice=None)
    until, draft = month_bounds(month)[1], Invoice(tenant=tenant, month=month)
    lines += [line for source in LINE_SOURCES for line in source(invoice=draft, until=until, claim=False)]
    figures = invoice_total(line_amounts=[line.amount for line in lines], minimum=tenant.plan.minimum_monthly_charge)
    return InvoicePreview(
        tenant=tenant, month=month, lines=lines, subtotal=figures.subtotal, rounding=figures.rounding,
        minimum_charge=figures.minimum_charge, total=figures.total, requests=sum(line.requests for line in lines),
    )  # fmt: skip


@dataclass(frozen=True)
class MonthInvoicing:
    """Where a month's invoicing stands: issued invoices, and tenants with usage still to bill for it."""

    month: date
    issued: list[Invoice]
    pending_tenants: list[Tenant]


def month_invoicing(*, month: date) -> MonthInvoicing:
    from billing.invoices import month_bounds
    from metering.models import UsageEvent

    month = month.replace(day=1)
    issued = list(
        Invoice.objects.filter(month=month, status=Invoice.Status.ISSUED).select_related("tenant").order_by("tenant__slug")
    )
    unbilled = UsageEvent.objects.filter(invoice__isnull=True, finished_at__lt=month_bounds(month)[1])
    pending = list(Tenant.objects.filter(pk__in=unbilled.values("tenant_id")).exclude(
        invoices__month=month, invoices__status=Invoice.Status.ISSUED).order_by("slug"))  # fmt: skip
    return MonthInvoicing(month=month, issued=issued, pending_tenants=pending)
