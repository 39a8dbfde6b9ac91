"""Admission: per tenant (and per API key where the key sets its own limits), atomically, requests per minute, tokens per minute, concurrent requests and a hold on
the month's token budget and spend limit; and settling each hold with what the request used.

Layers, each importing only those below it: `limits` (types) <- `backend` (the interface and its rules) <-
`redis_backend` | `db_backend` <- this module, which picks the backend once (Redis when REDIS_URL is set, else
the database) and is all the rest of the platform calls.

A tenant's spend is counted in micro-units of the currency (integers), rounded up per request and reconciled with
metering's record; an API key's in picos (1e-12: the unit metering's prices are exact to), so it never drifts from
what its requests are billed. Both come from one Decimal price (metering.pricing.request_price).
"""

import threading
from collections.abc import Awaitable
from decimal import Decimal

from asgiref.sync import markcoroutinefunction
from django.conf import settings
from django.core.signals import setting_changed

from gateway.admission.backend import AdmissionBackend
from gateway.admission.limits import (
    UNLIMITED,
    Decision,
    HeldTotals,
    Limits,
    Reconciled,
    current_month,
    picos_to_spend,
    seconds_to_month_end,
    spend_to_micros,
    spend_to_picos,
)

__all__ = [
    "UNLIMITED", "Decision", "HeldTotals", "Limits", "Reconciled", "admission_acquire", "admission_admit",
    "admission_give_back", "admission_peek", "admission_reconcile", "admission_settle", "backend", "current_month",
    "held_totals", "hold_settle", "key_reconcile", "key_spend_held", "picos_to_spend", "seconds_to_month_end",
    "spend_to_micros", "spend_to_picos", "unreported_tenants", "unreported_usage",
]  # fmt: skip

_chosen: dict[tuple[str, str], AdmissionBackend] = {}
_lock = threading.Lock()
_current: list[AdmissionBackend] = []  # the current settings' backend: read twice per request, settings not at all


def _settings_changed(*, setting: str, **_) -> None:
    if setting in ("REDIS_URL", "QUILT_REDIS_KEY_PREFIX"):
        _current.clear()


setting_changed.connect(_settings_changed)


def backend() -> AdmissionBackend:
    """The backend for the current settings (one instance per Redis URL and key prefix, or the database)."""
    if _current:
        return _current[0]
    key = (settings.REDIS_URL, settings.QUILT_REDIS_KEY_PREFIX)
    chosen = _chosen.get(key)
    if chosen is None:
        with _lock:
            chosen = _chosen.get(key)
            if chosen is None:
                if settings.REDIS_URL:
                    from gateway.admission.redis_backend import RedisAdmission

                    chosen = RedisAdmission(url=settings.REDIS_URL, prefix=settings.QUILT_REDIS_KEY_PREFIX)
                else:
                    from gateway.admission.db_backend import DatabaseAdmission

                    chosen = DatabaseAdmission()
                _chosen[key] = chosen
    _current[:] = [chosen]
    return chosen


def _picos(spend_micros: int, key_spend_picos: int | None) -> int:
    return spend_micros * 1_000_000 if key_spend_picos is None else key_spend_picos


@markcoroutinefunction  # awaited like the coroutine it returns (asgiref's async_to_sync takes it as one)
def admission_acquire(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits, key_spend_picos: int | None = None
) -> Awaitable[Decision]:
    """`key_spend_picos`: the same estimate exact, for the key's budget (None: `spend_micros` in picos). The backend's
    coroutine, returned for the caller to await: no coroutine of its own on every request's path."""
    return (_current[0] if _current else backend()).acquire(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros,
        key_spend_picos=spend_micros * 1_000_000 if key_spend_picos is None else key_spend_picos, limits=limits,
    )  # fmt: skip


@markcoroutinefunction
def admission_admit(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits, key_spend_picos: int
) -> Awaitable[tuple[Decision, object | None]]:
    """`admission_acquire` for a generation: it may be admitted from this process's lease of the key's room
    (`leases`); the second item, a lease's ticket or None, goes to its `admission_settle`."""
    return (_current[0] if _current else backend()).admit(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros,
        key_spend_picos=key_spend_picos, limits=limits,
    )  # fmt: skip


async def admission_give_back() -> None:
    """The running loop's admission leases given back (a gateway process shutting down); nothing without Redis."""
    await backend().give_back_all()


async def admission_peek(*, tenant_id: int, key_prefix: str = "") -> Decision:
    """The current window's counts, the tenant's and the key lineage's (`key_prefix`), changing nothing: for the
    headers of responses answered without an admission."""
    return await backend().peek(tenant_id=tenant_id, key_prefix=key_prefix)


@markcoroutinefunction  # it returns the backend's coroutine: callers (async_to_sync too) await it as one
def admission_settle(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, final: bool = True, key_prefix: str = "",
    key_spend_picos: int | None = None, usage: str = "", lease: object | None = None,
) -> Awaitable[bool]:  # fmt: skip
    """`usage`: with a provisional settle, the usage event the client was served (JSON), kept until metering
    records the request, so that `unreported_usage` bills it if the engine's own event never comes. Awaited by the
    caller: the backend's own coroutine, not one around it (on every request's path; `backend` and `_picos` written
    out likewise)."""
    return (_current[0] if _current else backend()).settle(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros,
        key_spend_picos=spend_micros * 1_000_000 if key_spend_picos is None else key_spend_picos, final=final,
        key_prefix=key_prefix, usage=usage, lease=lease,
    )  # fmt: skip


def hold_settle(
    *, tenant_id: int, request_id: str, tokens: int, spend: Decimal, final: bool = True, key_prefix: str = ""
) -> bool:
    """Blocking settle (metering's worker): records `tokens` and `spend` against the tenant's month (and its key's)
    once per request id, replacing a provisional settle, and releases its hold. True if this released a live hold."""
    return backend().settle_sync(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_to_micros(spend),
        key_spend_picos=spend_to_picos(spend), final=final, key_prefix=key_prefix,
    )  # fmt: skip


def key_spend_held(*, tenant_id: int, key_prefix: str) -> tuple[int, int]:
    """A key lineage's live holds and settled spend this month in picos, as admission sees them (tests, console)."""
    return backend().key_totals(tenant_id=tenant_id, key_prefix=key_prefix)


def held_totals(*, tenant_id: int) -> HeldTotals:
    """What a tenant holds and has used this month, as admission sees it (console, tests)."""
    return backend().totals(tenant_id=tenant_id)


def admission_reconcile(*, tenant_id: int) -> Reconciled | None:
    """Sets the tenant's month total to metering's record plus provisional settles; None if admission has no
    total for this month yet (the next admission starts it from the record)."""
    return backend().reconcile(tenant_id=tenant_id)


def key_reconcile(*, tenant_id: int, key_prefix: str) -> Reconciled | None:
    """The same for one key lineage's month spend (picos; the token fields are 0)."""
    return backend().key_reconcile(tenant_id=tenant_id, key_prefix=key_prefix)


def unreported_tenants() -> list[int]:
    """The tenants that may have unreported usage: those whose gateway kept a served request's usage lately or still
    keeps one. What the sweep visits, in proportion to the tenants with activity, not to all of them."""
    return backend().unreported_tenants()


def unreported_usage(*, tenant_id: int, older_than_seconds: float, limit: int = 500) -> list[str]:
    """Usage events (JSON) the gateway settled provisionally over `older_than_seconds` ago and metering has not
    recorded since: the requests whose engine never sent its own event."""
    return backend().unreported(tenant_id=tenant_id, older_than_seconds=older_than_seconds, limit=limit)
