"""Reads over usage: grouped sums from the daily roll-ups, plus raw events for the days not rolled up yet."""

from dataclasses import dataclass, field
from datetime import UTC, date, timedelta
from decimal import Decimal

from django.db.models import Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from metering.models import UsageDaily, UsageEvent, UsageMonth
from metering.rollups import day_bounds, rolled_up_before, usage_sums
from tenancy.models import Tenant

GROUPS = {"day": "day", "model": "model", "key": "api_key_prefix"}


@dataclass
class UsageTotals:
    group: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    gpu_ms: Decimal = field(default_factory=Decimal)
    price: Decimal = field(default_factory=Decimal)
    cost: Decimal = field(default_factory=Decimal)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def add(self, sums: dict) -> None:
        self.requests += sums["requests"]
        self.prompt_tokens += sums["prompt_tokens_sum"]
        self.cached_tokens += sums["cached_tokens_sum"]
        self.completion_tokens += sums["completion_tokens_sum"]
        self.gpu_ms += sums["gpu_ms_sum"]
        self.price += sums["price_sum"]
        self.cost += sums["cost_sum"]


def _daily_sums(rows, column: str):
    return rows.values(column).annotate(
        requests=Sum("requests"), prompt_tokens_sum=Sum("prompt_tokens"), cached_tokens_sum=Sum("cached_tokens"),
        completion_tokens_sum=Sum("completion_tokens"), gpu_ms_sum=Sum("gpu_ms"), price_sum=Sum("price"),
        cost_sum=Sum("cost"),
    )  # fmt: skip


def usage_grouped(*, tenant: Tenant, since: date, until: date, group_by: str) -> list[UsageTotals]:
    """Usage of the tenant from `since` to `until` (UTC days, both included), one row per day, model or key."""
    column = GROUPS[group_by]
    boundary = rolled_up_before()
    totals: dict[str, UsageTotals] = {}

    def collect(groups) -> None:
        for sums in groups:
            name = sums[column].isoformat() if column == "day" else sums[column]
            totals.setdefault(name, UsageTotals(group=name)).add(sums)

    raw_since = since
    if boundary is not None and since < boundary:
        daily = UsageDaily.objects.filter(
            tenant=tenant, day__gte=since, day__lte=min(until, boundary - timedelta(1))
        )
        collect(_daily_sums(daily.order_by(), column))
        raw_since = boundary
    if raw_since <= until:
        events = UsageEvent.objects.filter(
            tenant=tenant, finished_at__gte=day_bounds(raw_since)[0], finished_at__lt=day_bounds(until)[1]
        ).order_by()
        if column == "day":
            events = events.annotate(day=TruncDate("finished_at", tzinfo=UTC))
        collect(usage_sums(events.values(column)))
    return [totals[name] for name in sorted(totals)]


def usage_sum(rows: list[UsageTotals], *, group: str = "total") -> UsageTotals:
    total = UsageTotals(group=group)
    for row in rows:
        total.requests += row.requests
        total.prompt_tokens += row.prompt_tokens
        total.cached_tokens += row.cached_tokens
        total.completion_tokens += row.completion_tokens
        total.gpu_ms += row.gpu_ms
        total.price += row.price
        total.cost += row.cost
    return total


def usage_by_day(*, tenant: Tenant, since: date, until: date) -> list[UsageTotals]:
    return usage_grouped(tenant=tenant, since=since, until=until, group_by="day")


def usage_totals_month(*, tenant: Tenant, month: date) -> UsageTotals:
    """Month-to-date totals (kept by ingest in the same transaction as the events, so never behind them)."""
    row = UsageMonth.objects.filter(tenant=tenant, month=month.replace(day=1)).first()
    if row is None:
        return UsageTotals(group=month.strftime("%Y-%m"))
    return UsageTotals(
        group=month.strftime("%Y-%m"), requests=row.requests, prompt_tokens=row.prompt_tokens,
        cached_tokens=row.cached_tokens, completion_tokens=row.completion_tokens, price=row.price, cost=row.cost,
    )  # fmt: skip


def usage_month_recorded(*, tenant_id: int, month: date | None = None) -> tuple[int, Decimal]:
    """Tokens (prompt + completion) and price metering has recorded for the tenant in a month (this one by
    default): where admission's month total starts and what it is reconciled with."""
    month = (month or timezone.now().astimezone(UTC).date()).replace(day=1)
    row = UsageMonth.objects.filter(tenant_id=tenant_id, month=month).values_list(
        "prompt_tokens", "completion_tokens", "price"
    ).first()
    if row is None:
        return 0, Decimal(0)
    prompt, completion, price = row
    return prompt + completion, price
