"""Admission in the database: the same rules as the Redis script (see `backend`), in one transaction that locks
the tenant's AdmissionState row (SELECT ... FOR UPDATE on PostgreSQL; SQLite's IMMEDIATE transactions serialize
writers). Blocking: the async methods run the work in a thread, on a connection checked before use."""

import math
import time

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q, Sum

from gateway.admission.limits import (
    Decision,
    HeldTotals,
    Limits,
    Reconciled,
    current_month,
    spend_to_picos,
)
from gateway.connections import checked_connection
from gateway.models import AdmissionState, BudgetHold
from metering.selectors import key_spend_month_recorded, usage_month_recorded

MICRO_PICOS = 10**6


def _recorded(tenant_id: int) -> tuple[int, int]:
    tokens, price = usage_month_recorded(tenant_id=tenant_id)
    return tokens, spend_to_picos(price)


def _key_state(state: AdmissionState, key_prefix: str, *, start_month: bool) -> dict:
    """The key lineage's counters on the (locked) tenant row; its month's spend ("picos": exact, 1e-12) started
    from metering's record."""
    entry = state.keys.setdefault(key_prefix, {})
    if (entry.get("month") != current_month() or "picos" not in entry) and start_month:
        entry.update(month=current_month(), picos=spend_to_picos(key_spend_month_recorded(key_lineage=key_prefix)))
    return entry


def _key_counted(state: AdmissionState, key_prefix: str) -> dict | None:
    entry = state.keys.get(key_prefix) if key_prefix else None
    return entry if entry is not None and entry.get("month") == state.month and "picos" in entry else None


def _key_spend_of(tenant_id: int, key_prefix: str, status: str) -> int:
    return BudgetHold.objects.filter(tenant_id=tenant_id, api_key_prefix=key_prefix, status=status).aggregate(
        spend=Sum("key_spend_picos", default=0)
    )["spend"]


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
        state.month_tokens, state.month_spend_picos = _recorded(tenant_id)
    BudgetHold.objects.filter(tenant_id=tenant_id, status=BudgetHold.Status.HELD, expires_at__lte=now).update(
        status=BudgetHold.Status.EXPIRED
    )
    return state, state.month == month


def _hold_sums(tenant_id: int) -> dict:
    held, provisional = Q(status=BudgetHold.Status.HELD), Q(status=BudgetHold.Status.PROVISIONAL)
    return BudgetHold.objects.filter(tenant_id=tenant_id).aggregate(
        live=Count("id", filter=held), held_tokens=Sum("tokens", filter=held, default=0),
        held_spend=Sum("spend_micros", filter=held, default=0), prov_tokens=Sum("tokens", filter=provisional, default=0),
        prov_spend=Sum("spend_picos", filter=provisional, default=0),
    )  # fmt: skip


def acquire(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits, now: float,
    ttl: int,
) -> Decision:  # fmt: skip
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
        sums = _hold_sums(tenant_id)
        if sums["live"] + 1 > limits.max_concurrent:
            return refuse("concurrency")
        if limits.budget_tokens >= 0 and state.month_tokens + sums["held_tokens"] + tokens > limits.budget_tokens:
            return refuse("budget_tokens" if state.month_tokens + tokens > limits.budget_tokens else "budget_held")
        budget = limits.budget_spend_micros * MICRO_PICOS  # the month in picos, holds and the estimate in micro-units
        if budget >= 0 and state.month_spend_picos + (sums["held_spend"] + spend_micros) * MICRO_PICOS > budget:
            over = state.month_spend_picos + spend_micros * MICRO_PICOS > budget
            return refuse("budget_spend" if over else "budget_held")
        key_prefix, key_window = limits.key_prefix, (0, 0)
        if key_prefix:
            entry = _key_state(state, key_prefix, start_month=limits.key_budget_spend_picos >= 0)
            key_requests, key_tokens = (entry["requests"], entry["tokens"]) if entry.get("start") == window else (0, 0)
            if 0 <= limits.key_requests_per_minute < key_requests + 1:
                return Decision(False, "key_requests", key_requests, key_tokens, reset_ms, key_requests, key_tokens)
            if 0 <= limits.key_tokens_per_minute < key_tokens + tokens:
                return Decision(False, "key_tokens", key_requests, key_tokens, reset_ms, key_requests, key_tokens)
            budget = limits.key_budget_spend_picos
            held = _key_spend_of(tenant_id, key_prefix, BudgetHold.Status.HELD) if budget >= 0 else 0
            if budget >= 0 and entry["picos"] + held + key_spend_picos > budget:
                return refuse("key_budget_spend" if entry["picos"] + key_spend_picos > budget else "key_budget_held")
            entry.update(start=window, requests=key_requests + 1, tokens=key_tokens + tokens)
            key_window = (key_requests + 1, key_tokens + tokens)
        state.window_start, state.window_requests, state.window_tokens = window, requests + 1, window_tokens + tokens
        state.save()
        BudgetHold.objects.create(
            request_id=request_id, tenant_id=tenant_id, api_key_prefix=key_prefix, tokens=tokens, spend_micros=spend_micros,
            key_spend_picos=key_spend_picos if key_prefix else 0, window_start=window, expires_at=now + ttl,
        )  # fmt: skip
    return Decision(True, "ok", requests + 1, window_tokens + tokens, reset_ms, *key_window)


def peek(*, tenant_id: int, key_prefix: str, now: float) -> Decision:
    """The tenant's window, and the key lineage's where `key_prefix` names one."""
    window = math.floor(now / 60) * 60
    state = AdmissionState.objects.filter(tenant_id=tenant_id).first()
    requests, tokens = (state.window_requests, state.window_tokens) if state and state.window_start == window else (0, 0)
    entry = state.keys.get(key_prefix, {}) if state is not None and key_prefix else {}
    key_window = (entry["requests"], entry["tokens"]) if entry.get("start") == window else (0, 0)
    return Decision(True, "ok", requests, tokens, math.ceil((window + 60 - now) * 1000), *key_window)


def settle(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool, now: float,
    key_prefix: str = "", usage: str = "",
) -> bool:  # fmt: skip
    Status = BudgetHold.Status
    with transaction.atomic():
        state, current = _locked_state(tenant_id, now, start_month=False)
        hold = BudgetHold.objects.select_for_update().filter(request_id=request_id).first()
        prior = hold.status if hold is not None else None
        if prior == Status.SETTLED or (prior == Status.PROVISIONAL and not final):
            return False
        live = prior == Status.HELD
        add_tokens, add_spend, add_key = tokens, key_spend_picos, key_spend_picos  # the price, exact: both months
        if hold is None:
            hold = BudgetHold(
                request_id=request_id, tenant_id=tenant_id, api_key_prefix=key_prefix, window_start=0, expires_at=now,
                spend_micros=0,  # never held
            )
        elif live and hold.window_start == state.window_start:
            state.window_tokens += tokens - hold.tokens
        elif prior == Status.PROVISIONAL:  # the final settle replaces what the provisional one counted
            add_tokens, add_spend = tokens - hold.tokens, key_spend_picos - hold.spend_picos
            add_key = key_spend_picos - hold.key_spend_picos
        key = state.keys.get(hold.api_key_prefix) if hold.api_key_prefix else None
        if key is not None and live and key.get("start") == hold.window_start:
            key["tokens"] += tokens - hold.tokens
        if not current:
            hold.tokens, hold.spend_picos = 0, 0  # nothing counted: a later final adds its own amount whole
        else:
            hold.tokens, hold.spend_picos = tokens, key_spend_picos
            state.month_tokens += add_tokens
            state.month_spend_picos += add_spend
        counted_key = _key_counted(state, hold.api_key_prefix)
        if counted_key is not None:  # the same rule for the key's month
            counted_key["picos"] += add_key
            hold.key_spend_picos = key_spend_picos
        else:
            hold.key_spend_picos = 0
        hold.status = Status.SETTLED if final else Status.PROVISIONAL
        hold.usage = usage or None if not final else None
        hold.settled_at = now
        hold.save()
        state.save()
    return live


def totals(*, tenant_id: int, now: float) -> HeldTotals:
    with transaction.atomic():
        state, _ = _locked_state(tenant_id, now)
        state.save()
        sums = _hold_sums(tenant_id)
    return HeldTotals(
        live_holds=sums["live"], held_tokens=sums["held_tokens"], month_tokens=state.month_tokens,
        month_spend_picos=state.month_spend_picos, provisional_tokens=sums["prov_tokens"],
        provisional_spend_picos=sums["prov_spend"],
    )  # fmt: skip


def reconcile(*, tenant_id: int, now: float) -> Reconciled | None:
    with transaction.atomic():
        state = AdmissionState.objects.select_for_update().filter(tenant_id=tenant_id).first()
        if state is None or state.month != current_month():
            return None
        before = state.month_tokens, state.month_spend_picos
        tokens, spend = _recorded(tenant_id)
        sums = _hold_sums(tenant_id)
        state.month_tokens, state.month_spend_picos = tokens + sums["prov_tokens"], spend + sums["prov_spend"]
        state.save(update_fields=["month_tokens", "month_spend_picos"])
    return Reconciled(True, *before, state.month_tokens, state.month_spend_picos)


def key_reconcile(*, tenant_id: int, key_prefix: str, now: float) -> Reconciled | None:
    with transaction.atomic():
        state = AdmissionState.objects.select_for_update().filter(tenant_id=tenant_id).first()
        entry = _key_counted(state, key_prefix) if state is not None and state.month == current_month() else None
        if entry is None:
            return None
        before = entry["picos"]
        entry["picos"] = spend_to_picos(key_spend_month_recorded(key_lineage=key_prefix)) + _key_spend_of(
            tenant_id, key_prefix, BudgetHold.Status.PROVISIONAL
        )
        state.save(update_fields=["keys"])
    return Reconciled(True, 0, before, 0, entry["picos"])


def unreported(*, tenant_id: int, older_than_seconds: float, limit: int, now: float) -> list[str]:
    held = BudgetHold.objects.filter(
        tenant_id=tenant_id, status=BudgetHold.Status.PROVISIONAL, usage__isnull=False,
        settled_at__lte=now - older_than_seconds,
    )  # fmt: skip
    return list(held.order_by("settled_at").values_list("usage", flat=True)[:limit])


def unreported_tenants() -> list[int]:
    """The tenants with a provisional hold that keeps its usage (the partial index `hold_unreported` holds just those)."""
    held = BudgetHold.objects.filter(status=BudgetHold.Status.PROVISIONAL, usage__isnull=False)
    return list(held.order_by().values_list("tenant_id", flat=True).distinct())


class DatabaseAdmission:
    async def acquire(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> Decision:
        return await _blocking(acquire)(
            tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros,
            key_spend_picos=key_spend_picos, limits=limits, now=time.time(), ttl=settings.QUILT_HOLD_TTL_SECONDS,
        )  # fmt: skip

    async def peek(self, *, tenant_id: int, key_prefix: str = "") -> Decision:
        return await _blocking(peek)(tenant_id=tenant_id, key_prefix=key_prefix, now=time.time())

    async def admit(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> tuple[Decision, None]:
        """`acquire`: the database admits every request alone (no leases)."""
        decision = await self.acquire(tenant_id=tenant_id, request_id=request_id, tokens=tokens,
                                      spend_micros=spend_micros, key_spend_picos=key_spend_picos, limits=limits)
        return decision, None

    async def give_back_all(self) -> None:
        """No leases to give back."""

    async def settle(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "", lease: None = None,
    ) -> bool:  # fmt: skip
        return await _blocking(settle)(
            tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros,
            key_spend_picos=key_spend_picos, final=final, now=time.time(), key_prefix=key_prefix, usage=usage,
        )  # fmt: skip

    def settle_sync(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "",
    ) -> bool:  # fmt: skip
        return settle(
            tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros,
            key_spend_picos=key_spend_picos, final=final, now=time.time(), key_prefix=key_prefix, usage=usage,
        )  # fmt: skip

    def key_totals(self, *, tenant_id: int, key_prefix: str) -> tuple[int, int]:
        state = AdmissionState.objects.filter(tenant_id=tenant_id).first()
        entry = (state.keys if state is not None else {}).get(key_prefix, {})
        used = entry.get("picos", 0) if entry.get("month") == current_month() else 0
        return _key_spend_of(tenant_id, key_prefix, BudgetHold.Status.HELD), used

    def key_reconcile(self, *, tenant_id: int, key_prefix: str) -> Reconciled | None:
        return key_reconcile(tenant_id=tenant_id, key_prefix=key_prefix, now=time.time())

    def unreported(self, *, tenant_id: int, older_than_seconds: float, limit: int) -> list[str]:
        return unreported(tenant_id=tenant_id, older_than_seconds=older_than_seconds, limit=limit, now=time.time())

    def unreported_tenants(self) -> list[int]:
        return unreported_tenants()

    def totals(self, *, tenant_id: int) -> HeldTotals:
        return totals(tenant_id=tenant_id, now=time.time())

    def reconcile(self, *, tenant_id: int) -> Reconciled | None:
        return reconcile(tenant_id=tenant_id, now=time.time())


def _blocking(function):
    """The function on the calling thread (so tests see their own transaction), its connection checked first."""
    return sync_to_async(checked_connection(function))
