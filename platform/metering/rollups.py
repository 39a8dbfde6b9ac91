"""Daily roll-ups: UsageDaily for a (tenant, UTC day) is recomputed whole from its raw events, so running it again
changes nothing. The periodic run finds the days touched by events ingested since its cursor (less an overlap that
covers transactions still open when it last ran) and recomputes just those.
"""

from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Count, Sum, Value
from django.db.models.functions import Coalesce, TruncDate
from django.utils import timezone

from metering.models import RollupCursor, UsageDaily, UsageEvent

OVERLAP = timedelta(minutes=10)
DIMENSIONS = ("model", "base_model", "adapter_version_id", "api_key_prefix")
ZERO = Value(Decimal(0))


def day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


def usage_sums(events):
    """Sums of a UsageEvent queryset, in UsageDaily's field names (grouped by whatever .values() preceded)."""
    return events.annotate(
        requests=Count("id"),
        prompt_tokens_sum=Sum("prompt_tokens"),
        cached_tokens_sum=Sum("cached_tokens"),
        completion_tokens_sum=Sum("completion_tokens"),
        gpu_ms_sum=Sum("gpu_ms"),
        price_sum=Sum("price"),
        cost_sum=Coalesce(Sum("cost"), ZERO),
    )


def _cursor_locked() -> RollupCursor:
    """The single cursor row, locked: roll-up runs take it first, so they never interleave."""
    RollupCursor.objects.bulk_create([RollupCursor(pk=1)], ignore_conflicts=True)
    return RollupCursor.objects.select_for_update().get(pk=1)


def _recompute(*, tenant_id: int, day: date) -> int:
    start, end = day_bounds(day)
    events = UsageEvent.objects.filter(
        tenant_id=tenant_id, finished_at__gte=start, finished_at__lt=end
    ).order_by()
    rows = [
        UsageDaily(
            tenant_id=tenant_id,
            day=day,
            **{name: group[name] for name in DIMENSIONS},
            requests=group["requests"],
            prompt_tokens=group["prompt_tokens_sum"],
            cached_tokens=group["cached_tokens_sum"],
            completion_tokens=group["completion_tokens_sum"],
            gpu_ms=group["gpu_ms_sum"],
            price=group["price_sum"],
            cost=group["cost_sum"],
        )  # fmt: skip
        for group in usage_sums(events.values(*DIMENSIONS))
    ]
    UsageDaily.objects.filter(tenant_id=tenant_id, day=day).delete()
    UsageDaily.objects.bulk_create(rows)
    return len(rows)


def usage_rollup_day(*, tenant_id: int, day: date) -> int:
    with transaction.atomic():
        _cursor_locked()
        return _recompute(tenant_id=tenant_id, day=day)


def usage_rollup_recent(*, now: datetime | None = None) -> int:
    """Recomputes every (tenant, day) that gained events since the last run; returns how many it recomputed."""
    now = now or timezone.now()
    with transaction.atomic():
        cursor = _cursor_locked()
        events = UsageEvent.objects.order_by()
        if cursor.rolled_up_to is not None:
            events = events.filter(created_at__gte=cursor.rolled_up_to - OVERLAP)
        touched = sorted(
            events.annotate(day=TruncDate("finished_at", tzinfo=UTC))
            .values_list("tenant_id", "day")
            .distinct()
        )
        for tenant_id, day in touched:
            _recompute(tenant_id=tenant_id, day=day)
        cursor.rolled_up_to = now
        cursor.save(update_fields=["rolled_up_to"])
    return len(touched)


def rolled_up_before() -> date | None:
    """Days before this one are covered by UsageDaily (late arrivals aside); later days must be read raw."""
    cursor = RollupCursor.objects.filter(pk=1).first()
    if cursor is None or cursor.rolled_up_to is None:
        return None
    return (cursor.rolled_up_to - OVERLAP).astimezone(UTC).date()
