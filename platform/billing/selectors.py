"""Reads over invoices and the staff margin report."""

from dataclasses import dataclass
from datetime import date
from decimal import Decimal

from django.db.models import QuerySet

from billing.models import Invoice
from metering.models import UsageMonth
from tenancy.models import Tenant


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


def invoices_of(*, tenant: Tenant) -> QuerySet[Invoice]:
    return Invoice.objects.filter(tenant=tenant).order_by("-month")


def invoice_with_lines(*, tenant: Tenant, invoice_id: int) -> Invoice | None:
    return invoices_of(tenant=tenant).prefetch_related("lines").filter(pk=invoice_id).first()


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
