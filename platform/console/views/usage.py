"""Usage of a tenant: date range, model/adapter and key filters; a daily chart, a grouped table, CSV export."""

import csv
from decimal import Decimal

from django.http import HttpResponse
from django.utils import timezone

from apikeys.selectors import api_keys_of
from console.access import Role, tenant_page
from console.charts import usage_chart
from console.forms import GROUP_CHOICES, UsageFilterForm
from console.listing import listing_of_rows
from console.pages import render_page
from console.selectors import Window, chart_points, usage_models_and_keys, usage_table
from metering.selectors import UsageTotals

SORTABLE = {
    "group": "group",
    "requests": "requests",
    "input": "prompt_tokens",
    "cached": "cached_tokens",
    "output": "completion_tokens",
    "tokens": "total_tokens",
    "spend": "price",
}
MICRO = Decimal("0.000001")
CSV_FIELDS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "price"]


def _query(request):
    form = UsageFilterForm(request.GET)
    since, until = form.window(today=timezone.now().date())
    group = form.value("group") or "day"
    filters = {"model": form.value("model"), "key_prefix": form.value("key")}
    return form, Window(since=since, until=until), group, filters


@tenant_page(Role.VIEWER)
def usage(request):
    tenant = request.seat.tenant
    form, window, group, filters = _query(request)
    daily = usage_table(tenant=tenant, since=window.since, until=window.until, group_by="day", **filters)
    rows = daily if group == "day" else usage_table(
        tenant=tenant, since=window.since, until=window.until, group_by=group, **filters
    )
    models, prefixes = usage_models_and_keys(tenant=tenant, since=window.since)
    key_names = dict(api_keys_of(tenant=tenant).filter(prefix__in=prefixes).values_list("prefix", "name"))
    table = listing_of_rows(request, rows, sortable=SORTABLE, default_sort="-group" if group == "day" else "-tokens")
    context = {
        "form": form,
        "window": window,
        "group": group,
        "groups": GROUP_CHOICES,
        "filters": filters,
        "models": models,
        "keys": [(prefix, key_names.get(prefix, "")) for prefix in prefixes],
        "key_names": key_names,
        "chart": usage_chart(chart_points(window=window, totals=daily)),
        "chart_sub": f"{window.since:%b %d} – {window.until:%b %d}, UTC",
        "table": table,
        "total": _sum(daily),
        "csv_query": request.GET.urlencode(),
    }
    return render_page(request, "console/usage.html", context, section="usage")


def _sum(rows: list[UsageTotals]) -> UsageTotals:
    total = UsageTotals(group="total")
    for row in rows:
        total.requests += row.requests
        total.prompt_tokens += row.prompt_tokens
        total.cached_tokens += row.cached_tokens
        total.completion_tokens += row.completion_tokens
        total.price += row.price
    return total


@tenant_page(Role.VIEWER)
def usage_csv(request):
    tenant = request.seat.tenant
    _, window, group, filters = _query(request)
    rows = usage_table(tenant=tenant, since=window.since, until=window.until, group_by=group, **filters)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    name = f"usage-{tenant.slug}-{window.since:%Y%m%d}-{window.until:%Y%m%d}-by-{group}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    writer.writerow([group, *CSV_FIELDS])
    for row in rows:
        values = [getattr(row, field) for field in CSV_FIELDS]
        writer.writerow([row.group, *values[:-1], row.price.quantize(MICRO)])
    return response
