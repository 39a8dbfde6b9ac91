"""Admission in the database: the same rules as the Redis script, in one transaction that locks the tenant's
AdmissionState row (SELECT ... FOR UPDATE on PostgreSQL; SQLite's IMMEDIATE transactions serialize writers)."""

import math

from django.db import transaction
from django.db.models import Count, Sum

from gateway.admission import Decision, HeldTotals, Limits, current_month, month_usage_recorded
from gateway.models import AdmissionState, BudgetHold


def _locked_state(tenant_id: int, now: float, *, start_month: bool = True) -> tuple[AdmissionState, bool]:
    """The tenant's row, locked, and whether its month total is this month's. A missing total is started from
    metering's record when `start_month` (admission), never by a settle: the record holds what metering has
    ingested and soon what it has not, so starting it from one request's usage would forget the month before,
    and adding to a total just started from the record could count a request twice (as in Redis)."""
    AdmissionState.objects.get_or_create(tenant_id=tenant_id)
    state = AdmissionState.objects.select_for_update().get(tenant_id=tenant_id)
    month = current_month()
    if state.month != month and start_month:
        state.month = month
        state.month_tokens, state.month_spend_micros = month_usage_recorded(tenant_id=tenant_id)
    BudgetHold.objects.filter(tenant_id=tenant_id, status=BudgetHold.Status.HELD, expires_at__lte=now).update(
        status=BudgetHold.Status.EXPIRED
    )
    return state, state.month == month


def _live_holds(tenant_id: int) -> tuple[int, int, int]:
    live = BudgetHold.objects.filter(tenant_id=tenant_id, status=BudgetHold.Status.HELD).aggregate(
        count=Count("id"), tokens=Sum("tokens"), spend=Sum("spend_micros")
    )
    return live["count"], live["tokens"] or 0, live["spend"] or 0


def acquire(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits, now: float, ttl: int
) -> Decision:
    window = math.floor(now / 60) * 60
    reset_ms = math.ceil((window + 60 - now) * 1000)
    with transaction.atomic():
        state, _ = _locked_state(tenant_id, now)
        requests, window_tokens = (state.window_requests, state.window_tokens) if state.window_start == window else (0, 0)

        def refuse(reason: str) -> Decision:
            return Decision(False, reason, requests, window_tokens, reset_ms)

        if requests + 1 > limits.requests_per_minute:
            return refuse("requests")
        if window_tokens + tokens > limits.tokens_per_minute:
            return refuse("tokens")
        live, held_tokens, held_spend = _live_holds(tenant_id)
        if live + 1 > limits.max_concurrent:
            return refuse("concurrency")
        if limits.budget_tokens >= 0 and state.month_tokens + held_tokens + tokens > limits.budget_tokens:
            return refuse("budget_tokens" if state.month_tokens + tokens > limits.budget_tokens else "budget_held")
        if limits.budget_spend_micros >= 0 and state.month_spend_micros + held_spend + spend_micros > limits.budget_spend_micros:
            over = state.month_spend_micros + spend_micros > limits.budget_spend_micros
            return refuse("budget_spend" if over else "budget_held")
        state.window_start, state.window_requests, state.window_tokens = window, requests + 1, window_tokens + tokens
        state.save()
        BudgetHold.objects.create(
            request_id=request_id, tenant_id=tenant_id, tokens=tokens, spend_micros=spend_micros,
            window_start=window, expires_at=now + ttl,
        )  # fmt: skip
    return Decision(True, "ok", requests + 1, window_tokens + tokens, reset_ms)


def peek(*, tenant_id: int, now: float) -> Decision:
    window = math.floor(now / 60) * 60
    state = AdmissionState.objects.filter(tenant_id=tenant_id, window_start=window).first()
    requests, tokens = (state.window_requests, state.window_tokens) if state is not None else (0, 0)
    return Decision(True, "ok", requests, tokens, math.ceil((window + 60 - now) * 1000))


def settle(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int, now: float) -> bool:
    with transaction.atomic():
        state, current = _locked_state(tenant_id, now, start_month=False)
        hold = BudgetHold.objects.select_for_update().filter(request_id=request_id).first()
        if hold is not None and hold.status == BudgetHold.Status.SETTLED:
            return False
        live = hold is not None and hold.status == BudgetHold.Status.HELD
        if hold is None:
            hold = BudgetHold(
                request_id=request_id, tenant_id=tenant_id, tokens=0, spend_micros=0, window_start=0, expires_at=now
            )
        elif live and hold.window_start == state.window_start:
            state.window_tokens += tokens - hold.tokens
        hold.status = BudgetHold.Status.SETTLED
        hold.save()
        if current:
            state.month_tokens += tokens
            state.month_spend_micros += spend_micros
        state.save()
    return live


def totals(*, tenant_id: int, now: float) -> HeldTotals:
    with transaction.atomic():
        state, _ = _locked_state(tenant_id, now)
        state.save()
        live, held_tokens, _ = _live_holds(tenant_id)
    return HeldTotals(
        live_holds=live, held_tokens=held_tokens, month_tokens=state.month_tokens,
        month_spend_micros=state.month_spend_micros,
    )  # fmt: skip
