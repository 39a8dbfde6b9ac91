"""Reads the console needs beyond the apps' own selectors: chart series and platform-wide usage.

Everything reads the daily roll-ups, plus raw events only for the days not rolled up yet, the same split
metering's selectors use, so pages stay fast with millions of usage events.
"""

from dataclasses import dataclass
from datetime import UTC, date, timedelta
from decimal import Decimal

from django.db.models import Sum
from django.db.models.functions import TruncDate

from console.charts import DayPoint
from metering.models import UsageDaily, UsageEvent
from metering.rollups import day_bounds, rolled_up_before, usage_sums
from metering.selectors import UsageTotals
from tenancy.models import Tenant


@dataclass(frozen=True)
class Window:
    since: date
    until: date

    @property
    def days(self) -> list[date]:
        return [self.since + timedelta(days=offset) for offset in range((self.until - self.since).days + 1)]


def chart_points(*, window: Window, totals: list[UsageTotals]) -> list[DayPoint]:
    """One point per day of the window (days without usage are zero), from per-day totals."""
    by_day = {row.group: row for row in totals}
    points = []
    for day in window.days:
        row = by_day.get(day.isoformat())
        if row is None:
            points.append(DayPoint(day=day, lower=0, upper=0, line=Decimal(0)))
        else:
            points.append(DayPoint(day=day, lower=row.prompt_tokens, upper=row.completion_tokens, line=row.price))
    return points


COLUMNS = {"day": "day", "model": "model", "key": "api_key_prefix"}


def _grouped_sums(rows, column: str):
    return rows.values(column).annotate(
        requests=Sum("requests"), prompt_tokens_sum=Sum("prompt_tokens"), cached_tokens_sum=Sum("cached_tokens"),
        completion_tokens_sum=Sum("completion_tokens"), gpu_ms_sum=Sum("gpu_ms"), price_sum=Sum("price"),
        cost_sum=Sum("cost"),
    )  # fmt: skip


def usage_table(
    *, tenant: Tenant | None, since: date, until: date, group_by: str, model: str = "", key_prefix: str = ""
) -> list[UsageTotals]:
    """Usage from `since` to `until` (UTC days, both included) summed per day, model or key, optionally only
    one model and one key; `tenant=None` sums every tenant (staff)."""
    column = COLUMNS[group_by]
    filters = {}
    if tenant is not None:
        filters["tenant"] = tenant
    if model:
        filters["model"] = model
    if key_prefix:
        filters["api_key_prefix"] = key_prefix
    totals: dict[str, UsageTotals] = {}

    def collect(groups) -> None:
        for sums in groups:
            name = sums[column].isoformat() if column == "day" else sums[column]
            totals.setdefault(name, UsageTotals(group=name)).add(sums)

    boundary = rolled_up_before()
    raw_since = since
    if boundary is not None and since < boundary:
        last_rolled = min(until, boundary - timedelta(days=1))
        daily = UsageDaily.objects.filter(day__gte=since, day__lte=last_rolled, **filters).order_by()
        collect(_grouped_sums(daily, column))
        raw_since = boundary
    if raw_since <= until:
        start, end = day_bounds(raw_since)[0], day_bounds(until)[1]
        events = UsageEvent.objects.filter(finished_at__gte=start, finished_at__lt=end, **filters).order_by()
        if column == "day":
            events = events.annotate(day=TruncDate("finished_at", tzinfo=UTC))
        collect(usage_sums(events.values(column)))
    return [totals[name] for name in sorted(totals)]


def usage_models_and_keys(*, tenant: Tenant, since: date) -> tuple[list[str], list[str]]:
    """The model names and key prefixes that have usage since `since` (the usage page's filter choices)."""
    daily = UsageDaily.objects.filter(tenant=tenant, day__gte=since).order_by()
    events = UsageEvent.objects.filter(tenant=tenant, finished_at__gte=day_bounds(since)[0]).order_by()
    boundary = rolled_up_before()
    if boundary is not None:
        events = events.filter(finished_at__gte=day_bounds(max(since, boundary))[0])
    models = set(daily.values_list("model", flat=True).distinct()) | set(events.values_list("model", flat=True).distinct())
    keys = set(daily.values_list("api_key_prefix", flat=True).distinct())
    keys |= set(events.values_list("api_key_prefix", flat=True).distinct())
    return sorted(models), sorted(key for key in keys if key)
