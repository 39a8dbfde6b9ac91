"""Reads over usage: grouped sums from the daily roll-ups, plus raw events for the days not rolled up yet."""

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db import connection
from django.db.models import Aggregate, Avg, Count, F, FloatField, Q, QuerySet, Sum
from django.db.models.functions import TruncDate, TruncDay, TruncHour
from django.utils import timezone

from apikeys.models import ApiKey
from metering.models import REFUSED, ModelPrice, UsageDaily, UsageEvent, UsageMonth
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

def key_spend_month_recorded(*, key_lineage: str, month: date | None = None) -> Decimal:
    """What metering has recorded for one API key lineage's requests (the key and its rotations: ApiKey.lineage) in a
    month (this one by default): where admission's count of the key's spend starts and what it is reconciled with."""
    start = (month or timezone.now().astimezone(UTC).date()).replace(day=1)
    since = datetime.combine(start, datetime.min.time(), tzinfo=UTC)
    prefixes = ApiKey.objects.filter(lineage=key_lineage).values("prefix")
    return UsageEvent.objects.filter(
        Q(api_key_prefix=key_lineage) | Q(api_key_prefix__in=prefixes), finished_at__gte=since
    ).aggregate(spend=Sum("price", default=Decimal(0)))["spend"]


def keys_spend_month(*, tenant: Tenant) -> dict[str, Decimal]:
    """Key lineage -> what its requests cost this month (the keys table: a rotated key's spend goes on with its
    successor), one grouped query."""
    start = timezone.now().astimezone(UTC).date().replace(day=1)
    since = datetime.combine(start, datetime.min.time(), tzinfo=UTC)
    lineage = dict(ApiKey.objects.filter(tenant=tenant).values_list("prefix", "lineage"))
    rows = (
        UsageEvent.objects.filter(tenant=tenant, finished_at__gte=since).exclude(api_key_prefix="")
        .values("api_key_prefix").annotate(spend=Sum("price")).order_by()
    )  # fmt: skip
    spend: dict[str, Decimal] = {}
    for row in rows:
        key = lineage.get(row["api_key_prefix"]) or row["api_key_prefix"]
        spend[key] = spend.get(key, Decimal(0)) + row["spend"]
    return spend


# --- Reads for the console's usage pages (filters, platform-wide sums, time series). ---------------------------


def _event_filters(*, tenant: Tenant | None, model: str, key_prefix: str) -> dict:
    """Usage rows of one tenant (every tenant with None), narrowed to one model and one key when given."""
    filters = {"tenant": tenant} if tenant is not None else {}
    if model:
        filters["model"] = model
    if key_prefix:
        filters["api_key_prefix"] = key_prefix
    return filters


def usage_grouped_filtered(
    *, tenant: Tenant | None, since: date, until: date, group_by: str, model: str = "", key_prefix: str = ""
) -> list[UsageTotals]:
    """usage_grouped, optionally for one model and one key, and for every tenant at once with `tenant=None`."""
    column = GROUPS[group_by]
    filters = _event_filters(tenant=tenant, model=model, key_prefix=key_prefix)
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
        collect(_daily_sums(daily, column))
        raw_since = boundary
    if raw_since <= until:
        start, end = day_bounds(raw_since)[0], day_bounds(until)[1]
        events = UsageEvent.objects.filter(finished_at__gte=start, finished_at__lt=end, **filters).order_by()
        if column == "day":
            events = events.annotate(day=TruncDate("finished_at", tzinfo=UTC))
        collect(usage_sums(events.values(column)))
    return [totals[name] for name in sorted(totals)]


@dataclass(frozen=True)
class RequestCounts:
    """The requests the gateway answered in a window: served by an engine (what usage and billing count) and
    refused by the gateway with no engine generating (400, 402, 404, 429 ...), rate limits among them."""

    served: int = 0
    refused: int = 0
    rate_limited: int = 0  # refusals with status 429

    @property
    def answered(self) -> int:
        return self.served + self.refused


def request_count_aggregates() -> dict:
    """The aggregates of RequestCounts' fields over a queryset of answered requests."""
    return {
        "served": Count("id", filter=~Q(finish_reason=REFUSED)), "refused": Count("id", filter=Q(finish_reason=REFUSED)),
        "rate_limited": Count("id", filter=Q(finish_reason=REFUSED, status_code=429)),
    }  # fmt: skip


def request_counts(
    *, tenant: Tenant | None, since: datetime, until: datetime, model: str = "", key_prefix: str = ""
) -> RequestCounts:
    """Served and refused requests from `since` (included) to `until` (excluded): the one count of requests every
    page shows, so that the overview, usage, billing and the request log (request_log_totals) agree."""
    filters = _event_filters(tenant=tenant, model=model, key_prefix=key_prefix)
    events = UsageEvent.answered.filter(finished_at__gte=since, finished_at__lt=until, **filters).order_by()
    return RequestCounts(**events.aggregate(**request_count_aggregates()))


def month_request_counts(*, tenant: Tenant, month: date) -> RequestCounts:
    """request_counts over the UTC month of `month`, to now."""
    start = month.replace(day=1)
    since = datetime.combine(start, datetime.min.time(), tzinfo=UTC)
    until = datetime.combine((start + timedelta(days=32)).replace(day=1), datetime.min.time(), tzinfo=UTC)
    return request_counts(tenant=tenant, since=since, until=until)


def usage_filter_choices(*, tenant: Tenant, since: date) -> tuple[list[str], list[str]]:
    """The model names and key prefixes with usage since `since` (a usage page's filter choices)."""
    daily = UsageDaily.objects.filter(tenant=tenant, day__gte=since).order_by()
    events = UsageEvent.objects.filter(tenant=tenant, finished_at__gte=day_bounds(since)[0]).order_by()
    boundary = rolled_up_before()
    if boundary is not None:
        events = events.filter(finished_at__gte=day_bounds(max(since, boundary))[0])
    models = set(daily.values_list("model", flat=True).distinct()) | set(events.values_list("model", flat=True).distinct())
    keys = set(daily.values_list("api_key_prefix", flat=True).distinct())
    keys |= set(events.values_list("api_key_prefix", flat=True).distinct())
    return sorted(models), sorted(key for key in keys if key)


@dataclass
class UsageBucket:
    """One hour or day of requests: counts, errors, spend and latency (TTFT, decode tokens per second)."""

    start: datetime
    requests: int = 0  # every request the gateway answered, refusals included
    errors: int = 0  # failed by an engine, or refused by the gateway (`refused` of them)
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    price: Decimal = field(default_factory=Decimal)
    ttft_ms: float | None = None  # mean time to first token
    tokens_per_second: float | None = None  # output tokens over the time spent producing them after the first
    latency_p50: float | None = None  # end-to-end latency percentiles, ms
    latency_p95: float | None = None
    latency_p99: float | None = None

    @property
    def error_rate(self) -> float | None:
        """Percent of the bucket's requests that failed or were refused; None with no requests."""
        return 100.0 * self.errors / self.requests if self.requests else None


class Percentile(Aggregate):
    """PostgreSQL's percentile_cont(p) WITHIN GROUP (ORDER BY x): one pass per bucket in the database."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, *, fraction: float, **extra):
        super().__init__(expression, fraction=fraction, **extra)


PERCENTILES = {"latency_p50": 0.5, "latency_p95": 0.95, "latency_p99": 0.99}


def _percentile(values: list[float], fraction: float) -> float:
    """percentile_cont over sorted values (linear between the two nearest ranks), for databases without it."""
    position = fraction * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def _percentile_aggregates() -> dict:
    """The bucket query's p50/p95/p99 of end-to-end latency where the database computes them (PostgreSQL)."""
    if connection.vendor != "postgresql":
        return {}
    return {name: Percentile("e2e_ms", fraction=fraction) for name, fraction in PERCENTILES.items()}


def _latency_percentiles(events, truncate) -> dict[datetime, dict[str, float]]:
    """Bucket start -> p50/p95/p99 of end-to-end latency, computed here for databases without percentile_cont."""
    timed = events.filter(e2e_ms__isnull=False).annotate(start=truncate("finished_at", tzinfo=UTC))
    values: dict[datetime, list[float]] = defaultdict(list)
    for start, latency in timed.values_list("start", "e2e_ms"):
        values[start].append(latency)
    return {start: {name: _percentile(sorted(latencies), fraction) for name, fraction in PERCENTILES.items()}
            for start, latencies in values.items()}  # fmt: skip


BUCKETS = {"hour": TruncHour, "day": TruncDay}
ERROR_FINISH_REASONS = ("error", REFUSED)


def usage_buckets(
    *, tenant: Tenant | None, since: datetime, until: datetime, bucket: str, model: str = "", key_prefix: str = ""
) -> list[UsageBucket]:
    """Every hour or UTC day from `since` to `until` (empty ones included), from the raw events: latency and
    errors are not in the roll-ups, and a window of hours or a month of days stays a bounded range scan. Requests
    and errors count the gateway's refusals too (a 429 is an error the client saw); tokens, spend and latency are
    the served requests' (a refusal has none)."""
    truncate = BUCKETS[bucket]
    filters = _event_filters(tenant=tenant, model=model, key_prefix=key_prefix)
    timed = Q(ttft_ms__isnull=False, e2e_ms__isnull=False, e2e_ms__gt=F("ttft_ms"))
    rows = (
        UsageEvent.answered.filter(finished_at__gte=since, finished_at__lt=until, **filters)
        .order_by()
        .annotate(start=truncate("finished_at", tzinfo=UTC))
        .values("start")
        .annotate(
            requests=Count("id"), errors=Count("id", filter=Q(finish_reason__in=ERROR_FINISH_REASONS)),
            refused=Count("id", filter=Q(finish_reason=REFUSED)),
            prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"), price_sum=Sum("price"),
            ttft=Avg("ttft_ms"), decode_ms=Sum(F("e2e_ms") - F("ttft_ms"), filter=timed),
            decode_tokens=Sum("completion_tokens", filter=timed), **_percentile_aggregates(),
        )
    )  # fmt: skip
    found = {row["start"]: row for row in rows}
    if connection.vendor == "postgresql":
        percentiles = {start: {name: row[name] for name in PERCENTILES} for start, row in found.items()}
    else:
        events = UsageEvent.objects.filter(finished_at__gte=since, finished_at__lt=until, **filters).order_by()
        percentiles = _latency_percentiles(events, truncate)
    step = timedelta(hours=1) if bucket == "hour" else timedelta(days=1)
    start = since.replace(minute=0, second=0, microsecond=0)
    if bucket == "day":
        start = start.replace(hour=0)
    buckets = []
    while start < until:
        row = found.get(start)
        if row is None:
            buckets.append(UsageBucket(start=start))
        else:
            decode_ms, decode_tokens = row["decode_ms"], row["decode_tokens"]
            buckets.append(UsageBucket(
                start=start, requests=row["requests"], errors=row["errors"], refused=row["refused"],
                prompt_tokens=row["prompt"] or 0,
                completion_tokens=row["completion"] or 0, price=row["price_sum"] or Decimal(0), ttft_ms=row["ttft"],
                tokens_per_second=decode_tokens * 1000 / decode_ms if decode_ms and decode_tokens else None,
                **percentiles.get(start, {}),
            ))  # fmt: skip
        start += step
    return buckets


def usage_requests_by_model(
    *, tenant: Tenant, since: datetime, until: datetime, bucket: str, limit: int = 4
) -> dict[str, dict[datetime, int]]:
    """Requests per hour or day for the tenant's busiest models and adapters (the adapters' load)."""
    events = UsageEvent.objects.filter(tenant=tenant, finished_at__gte=since, finished_at__lt=until).order_by()
    top = [row["model"] for row in events.values("model").annotate(n=Count("id")).order_by("-n", "model")[:limit]]
    rows = (
        events.filter(model__in=top).annotate(start=BUCKETS[bucket]("finished_at", tzinfo=UTC))
        .values("model", "start").annotate(n=Count("id"))
    )  # fmt: skip
    series: dict[str, dict[datetime, int]] = {name: {} for name in top}
    for row in rows:
        series[row["model"]][row["start"]] = row["n"]
    return series


def model_prices_of(*, plan) -> QuerySet[ModelPrice]:
    """The plan's per-base-model price overrides."""
    return ModelPrice.objects.filter(plan=plan).order_by("base_model")
