"""Usage of a tenant: date range, model/adapter and key filters; charts (tokens and spend by day; requests and
errors, latency and adapter load, hourly or daily), a grouped table, CSV export.

Every number comes from metering's selectors; this module only arranges them for the page.
"""

import csv
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal

from django.http import HttpResponse
from django.utils import timezone

from apikeys.selectors import api_keys_of
from console.access import CsvQueryError, Role, csv_download, tenant_page
from console.charts import Series, series_chart, usage_chart
from console.forms import GROUP_CHOICES, UsageFilterForm
from console.listing import listing_of_rows
from console.pages import render_page
from console.selectors import Window, chart_points
from metering.selectors import (
    request_counts,
    usage_buckets,
    usage_filter_choices,
    usage_grouped_filtered,
    usage_requests_by_model,
    usage_sum,
)

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
HOURLY_DAYS = 7  # hourly views cover the window's last week at most (168 points)


def _query(request):
    form = UsageFilterForm(request.GET)
    since, until = form.window(today=timezone.now().date())
    group = form.value("group") or "day"
    filters = {"model": form.value("model"), "key_prefix": form.value("key")}
    return form, Window(since=since, until=until), group, filters


def _day_start(day) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


def _bucket_range(window: Window, every: str) -> tuple[datetime, datetime]:
    end = min(datetime.combine(window.until + timedelta(days=1), time.min, tzinfo=UTC), timezone.now())
    if every == "hour":
        end = end.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        first_day = max(window.since, window.until - timedelta(days=HOURLY_DAYS - 1))
        return max(datetime.combine(first_day, time.min, tzinfo=UTC), end - timedelta(days=HOURLY_DAYS)), end
    return datetime.combine(window.since, time.min, tzinfo=UTC), end


def operations_charts(*, tenant, window: Window, every: str, filters: dict) -> dict:
    """Requests and errors, latency (TTFT and output tokens/s) and adapter load, per hour or day."""
    since, until = _bucket_range(window, every)
    buckets = usage_buckets(tenant=tenant, since=since, until=until, bucket=every, **filters)
    starts = [bucket.start for bucket in buckets]
    by_model = usage_requests_by_model(tenant=tenant, since=since, until=until, bucket=every)
    tones = ["tone-1", "tone-3", "tone-4", "tone-2"]
    load = [Series(name, [counts.get(start, 0) for start in starts], tones[i]) for i, (name, counts) in
            enumerate(by_model.items())]  # fmt: skip
    unit = "hour" if every == "hour" else "day"
    return {
        "requests_chart": series_chart(
            starts=starts, bucket=every, bars=Series("Requests", [b.requests for b in buckets], "tone-1"),
            left=[Series("Errors", [b.errors for b in buckets], "tone-2"),
                  Series("Refused", [b.refused for b in buckets], "tone-3")],
            label=f"Requests and errors (refusals included) per {unit}",
        ),
        "latency_chart": series_chart(
            starts=starts, bucket=every, left=[Series("TTFT", [b.ttft_ms for b in buckets], "tone-1")],
            right=Series("Output tokens/s", [b.tokens_per_second for b in buckets], "tone-4"), left_unit=" ms",
            label=f"Mean time to first token and output tokens per second, per {unit}",
        ),
        "percentiles_chart": series_chart(
            starts=starts, bucket=every, left=[
                Series("p50", [b.latency_p50 for b in buckets], "tone-1"),
                Series("p95", [b.latency_p95 for b in buckets], "tone-3"),
                Series("p99", [b.latency_p99 for b in buckets], "tone-2"),
            ], right=Series("Errors", [b.error_rate for b in buckets], "tone-4"), left_unit=" ms", right_unit="%",
            label=f"Latency percentiles and error rate per {unit}",
        ),
        "load_chart": series_chart(starts=starts, bucket=every, left=load, label=f"Requests per {unit} by model"),
        "load_series": load,
        "errors": sum(b.errors for b in buckets),
        "refused": sum(b.refused for b in buckets),
        "ops_range": (since, until),
    }


@tenant_page(Role.VIEWER)
def usage(request):
    tenant = request.seat.tenant
    form, window, group, filters = _query(request)
    every = form.value("every") or "day"
    span = {"tenant": tenant, "since": window.since, "until": window.until}
    daily = usage_grouped_filtered(group_by="day", **span, **filters)
    rows = daily if group == "day" else usage_grouped_filtered(group_by=group, **span, **filters)
    models, prefixes = usage_filter_choices(tenant=tenant, since=window.since)
    key_names = dict(api_keys_of(tenant=tenant).filter(prefix__in=prefixes).values_list("prefix", "name"))
    table = listing_of_rows(request, rows, sortable=SORTABLE, default_sort="-group" if group == "day" else "-tokens")
    every_urls = {}
    for value in ("day", "hour"):
        query = request.GET.copy()
        query["every"] = value
        every_urls[value] = f"?{query.urlencode()}#operations"
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
        "total": usage_sum(daily),
        "counts": request_counts(tenant=tenant, since=_day_start(window.since),
                                 until=_day_start(window.until + timedelta(days=1)), **filters),
        "csv_query": request.GET.urlencode(),
        "every": every,
        "every_urls": every_urls,
        **operations_charts(tenant=tenant, window=window, every=every, filters=filters),
    }
    return render_page(request, "console/usage.html", context, section="usage")


@csv_download
@tenant_page(Role.VIEWER)
def usage_csv(request):
    tenant = request.seat.tenant
    form, window, group, filters = _query(request)
    if not form.is_valid():
        raise CsvQueryError("; ".join(f"{name}: {' '.join(errors)}" for name, errors in form.errors.items()))
    rows = usage_grouped_filtered(tenant=tenant, since=window.since, until=window.until, group_by=group, **filters)
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    name = f"usage-{tenant.slug}-{window.since:%Y%m%d}-{window.until:%Y%m%d}-by-{group}.csv"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    writer.writerow([group, *CSV_FIELDS])
    for row in rows:
        values = [getattr(row, field) for field in CSV_FIELDS]
        writer.writerow([row.group, *values[:-1], row.price.quantize(MICRO)])
    return response
