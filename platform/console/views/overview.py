"""Overview pages: a tenant's month at a glance, and the same across the platform for staff."""

from datetime import timedelta
from decimal import Decimal

from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.utils import timezone

from apikeys.selectors import api_keys_of
from billing.selectors import margin_totals, tenant_margin
from console.access import Role, staff_page, tenant_page
from console.charts import usage_chart
from console.pages import render_page
from console.selectors import Window, chart_points
from gateway.models import Engine
from metering.selectors import (
    UsageTotals,
    month_request_counts,
    usage_by_day,
    usage_grouped,
    usage_grouped_filtered,
    usage_totals_month,
)
from registry.selectors import models_for_tenant
from tenancy.models import Tenant

CHART_DAYS = 30
AMBER_AT, RED_AT = 80, 100


def budget_meter(*, used, limit) -> dict | None:
    """Share of a monthly limit used, and its colour: amber from 80%, red from 100%."""
    if limit is None or limit <= 0:
        return None
    percent = int(Decimal(used) * 100 / Decimal(limit))
    tone = "red" if percent >= RED_AT else "amber" if percent >= AMBER_AT else ""
    return {"used": used, "limit": limit, "percent": percent, "width": min(percent, 100), "tone": tone}


def _top(rows: list[UsageTotals], count: int = 5) -> list[UsageTotals]:
    return sorted(rows, key=lambda row: row.total_tokens, reverse=True)[:count]


@tenant_page(Role.VIEWER)
def tenant_overview(request):
    tenant = request.seat.tenant
    today = timezone.now().date()
    month = today.replace(day=1)
    window = Window(since=today - timedelta(days=CHART_DAYS - 1), until=today)
    totals = usage_totals_month(tenant=tenant, month=month)
    top_keys = _top(usage_grouped(tenant=tenant, since=month, until=today, group_by="key"))
    names = dict(
        api_keys_of(tenant=tenant).filter(prefix__in=[row.group for row in top_keys]).values_list("prefix", "name")
    )
    context = {
        "totals": totals,
        "counts": month_request_counts(tenant=tenant, month=month),
        "month": month,
        "spend_meter": budget_meter(used=totals.price, limit=tenant.plan.monthly_spend_limit),
        "token_meter": budget_meter(used=totals.total_tokens, limit=tenant.plan.monthly_token_budget),
        "chart": usage_chart(chart_points(window=window, totals=usage_by_day(tenant=tenant, **window.__dict__))),
        "top_models": _top(usage_grouped(tenant=tenant, since=month, until=today, group_by="model")),
        "top_keys": [(row, names.get(row.group, "")) for row in top_keys],
        "first_model": _first_model(tenant) if not totals.requests else "",
    }
    return render_page(request, "console/overview.html", context, section="overview")


def _first_model(tenant) -> str:
    """What the quick-start snippet should call: the tenant's first servable adapter, else a base model."""
    models = models_for_tenant(tenant=tenant)
    adapters = [model.name for model in models if model.adapter is not None]
    return (adapters or [model.name for model in models] or [""])[0]


@staff_page
def platform_overview(request):
    today = timezone.now().date()
    month = today.replace(day=1)
    window = Window(since=today - timedelta(days=CHART_DAYS - 1), until=today)
    margins = tenant_margin(month=month)
    totals = margin_totals(month=month)
    every_day = usage_grouped_filtered(tenant=None, since=window.since, until=window.until, group_by="day")
    engines = list(Engine.objects.filter(enabled=True).order_by("name"))
    context = {
        "requests": totals.requests,
        "tokens": totals.total_tokens,
        "revenue": totals.revenue,
        "cost": totals.gpu_cost,
        "margin": totals.margin,
        "margin_ratio": totals.margin_ratio,
        "month": month,
        "chart": usage_chart(chart_points(window=window, totals=every_day)),
        "top_tenants": sorted(margins, key=lambda row: row.revenue, reverse=True)[:6],
        "tenant_counts": {row["status"]: row["count"] for row in _status_counts()},
        "engines": engines,
        "healthy_engines": sum(1 for engine in engines if engine.is_up),
    }
    return render_page(request, "console/platform.html", context, section="platform")


def _status_counts():
    return Tenant.objects.order_by().values("status").annotate(count=Count("id"))


@login_required
def no_tenant(request):
    return render_page(request, "console/no_tenant.html")
