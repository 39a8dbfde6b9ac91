"""Admission: per tenant, atomically, requests per minute, tokens per minute, concurrent requests and a hold
on the month's token budget and spend limit.

One decision is one Redis script (REDIS_URL set) or one database transaction (the embedded default); both
backends keep the same state and the same rules:

- a one-minute fixed window counts requests and (estimated, later corrected) tokens;
- each admitted request holds `tokens` and `spend` until it is settled or its hold expires (an orphan
  left by a crashed gateway); live holds are the concurrent requests;
- settled usage adds to the month's totals; a request is admitted only if settled + held + its own
  estimate stays within the budget and the spend limit. A refusal changes nothing.

Spend is counted in micro-units of the currency (integers), rounded up.
"""

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from asgiref.sync import sync_to_async
from django.conf import settings

from tenancy.models import Plan

UNLIMITED = -1
MICROS = Decimal(1_000_000)


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    budget_tokens: int  # UNLIMITED or a count
    budget_spend_micros: int  # UNLIMITED or micro-units

    @classmethod
    def of_plan(cls, plan: Plan) -> "Limits":
        budget = plan.monthly_token_budget
        spend = plan.monthly_spend_limit
        return cls(
            requests_per_minute=plan.requests_per_minute,
            tokens_per_minute=plan.tokens_per_minute,
            max_concurrent=plan.max_concurrent_requests,
            budget_tokens=UNLIMITED if budget is None else budget,
            budget_spend_micros=UNLIMITED if spend is None else spend_to_micros(spend),
        )


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str  # "ok" | "requests" | "tokens" | "concurrency" | "budget_tokens" | "budget_spend" | "budget_held"
    window_requests: int
    window_tokens: int
    reset_ms: int  # until the current one-minute window ends


def spend_to_micros(spend: Decimal) -> int:
    return math.ceil(spend * MICROS)


def current_month() -> str:
    return datetime.now(UTC).strftime("%Y-%m")


def seconds_to_month_end() -> int:
    now = datetime.now(UTC)
    following = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return max(1, math.ceil((following - now).total_seconds()))


def month_usage_recorded(*, tenant_id: int) -> tuple[int, int]:
    """Tokens and spend (micro-units) metering has recorded for the tenant this month: where admission starts
    counting when its own month total is missing (a new month, a new database row, a flushed Redis)."""
    from metering.models import UsageMonth

    today = datetime.now(UTC).date()
    month = UsageMonth.objects.filter(tenant_id=tenant_id, month=today.replace(day=1)).first()
    if month is None:
        return 0, 0
    return month.prompt_tokens + month.completion_tokens, spend_to_micros(month.price)


def uses_redis() -> bool:
    return bool(settings.REDIS_URL)


async def admission_acquire(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits) -> Decision:
    if uses_redis():
        from gateway import admission_redis

        return await admission_redis.acquire(
            tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros, limits=limits
        )
    from gateway import admission_db

    return await sync_to_async(admission_db.acquire)(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros, limits=limits,
        now=time.time(), ttl=settings.QUILT_HOLD_TTL_SECONDS,
    )  # fmt: skip


async def admission_peek(*, tenant_id: int) -> Decision:
    """The current window's counts, changing nothing (for the headers of responses refused before admission)."""
    if uses_redis():
        from gateway import admission_redis

        return await admission_redis.peek(tenant_id=tenant_id)
    from gateway import admission_db

    return await sync_to_async(admission_db.peek)(tenant_id=tenant_id, now=time.time())


async def admission_settle(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int) -> bool:
    if uses_redis():
        from gateway import admission_redis

        return await admission_redis.settle(
            tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros
        )
    from gateway import admission_db

    return await sync_to_async(admission_db.settle)(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros, now=time.time()
    )


def admission_settle_sync(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int) -> bool:
    if uses_redis():
        from gateway import admission_redis

        return admission_redis.settle_sync(
            tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros
        )
    from gateway import admission_db

    return admission_db.settle(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros, now=time.time()
    )


@dataclass(frozen=True)
class HeldTotals:
    live_holds: int
    held_tokens: int
    month_tokens: int
    month_spend_micros: int


def held_totals(*, tenant_id: int) -> HeldTotals:
    """What a tenant holds and has used this month, as admission sees it (console, tests)."""
    if uses_redis():
        from gateway import admission_redis

        return admission_redis.totals(tenant_id=tenant_id)
    from gateway import admission_db

    return admission_db.totals(tenant_id=tenant_id, now=time.time())
