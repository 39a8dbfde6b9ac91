"""Admission: per tenant (and per API key where the key sets its own limits), atomically, requests per minute, tokens per minute, concurrent requests and a hold on
the month's token budget and spend limit; and settling each hold with what the request used.

Layers, each importing only those below it: `limits` (types) <- `backend` (the interface and its rules) <-
`redis_backend` | `db_backend` <- this module, which picks the backend once (Redis when REDIS_URL is set, else
the database) and is all the rest of the platform calls.

Spend is counted in micro-units of the currency (integers), rounded up.
"""

import threading
from decimal import Decimal

from django.conf import settings

from gateway.admission.backend import AdmissionBackend
from gateway.admission.limits import (
    UNLIMITED,
    Decision,
    HeldTotals,
    Limits,
    Reconciled,
    current_month,
    seconds_to_month_end,
    spend_to_micros,
)

__all__ = [
    "UNLIMITED", "Decision", "HeldTotals", "Limits", "Reconciled", "admission_acquire", "admission_peek",
    "admission_reconcile", "admission_settle", "backend", "current_month", "held_totals", "hold_settle", "key_spend_held",
    "seconds_to_month_end", "spend_to_micros",
]  # fmt: skip

_chosen: dict[tuple[str, str], AdmissionBackend] = {}
_lock = threading.Lock()


def backend() -> AdmissionBackend:
    """The backend for the current settings (one instance per Redis URL and key prefix, or the database)."""
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
    return chosen


async def admission_acquire(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits) -> Decision:
    return await backend().acquire(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros, limits=limits
    )


async def admission_peek(*, tenant_id: int) -> Decision:
    """The current window's counts, changing nothing (for the headers of responses refused before admission)."""
    return await backend().peek(tenant_id=tenant_id)


async def admission_settle(
    *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, final: bool = True, key_prefix: str = ""
) -> bool:
    return await backend().settle(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_micros, final=final,
        key_prefix=key_prefix,
    )  # fmt: skip


def hold_settle(
    *, tenant_id: int, request_id: str, tokens: int, spend: Decimal, final: bool = True, key_prefix: str = ""
) -> bool:
    """Blocking settle (metering's worker): records `tokens` and `spend` against the tenant's month (and its key's)
    once per request id, replacing a provisional settle, and releases its hold. True if this released a live hold."""
    return backend().settle_sync(
        tenant_id=tenant_id, request_id=request_id, tokens=tokens, spend_micros=spend_to_micros(spend), final=final,
        key_prefix=key_prefix,
    )  # fmt: skip


def key_spend_held(*, tenant_id: int, key_prefix: str) -> tuple[int, int]:
    """A key's live holds and settled spend this month in micro-units, as admission sees them (tests, console)."""
    return backend().key_totals(tenant_id=tenant_id, key_prefix=key_prefix)


def held_totals(*, tenant_id: int) -> HeldTotals:
    """What a tenant holds and has used this month, as admission sees it (console, tests)."""
    return backend().totals(tenant_id=tenant_id)


def admission_reconcile(*, tenant_id: int) -> Reconciled | None:
    """Sets the tenant's month total to metering's record plus provisional settles; None if admission has no
    total for this month yet (the next admission starts it from the record)."""
    return backend().reconcile(tenant_id=tenant_id)
