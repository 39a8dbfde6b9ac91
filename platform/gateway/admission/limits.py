"""The bottom of admission: what a plan allows, what admission decided, what a tenant holds. No imports from
the rest of the gateway, so every other admission module (and the caller) can stand on it."""

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import NamedTuple

UNLIMITED = -1
# A gateway marks a tenant as having unreported usage (a served request's copy kept until metering records it) at
# most this often per process; the sweep forgets a tenant whose mark is twice as old and who has no copy left.
UNREPORTED_MARK_SECONDS = 30.0
MICROS = Decimal(1_000_000)
PICOS = Decimal(10) ** 12  # the price function's own quantum (metering.pricing.MONEY_PLACES): exact, never rounded


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int
    tokens_per_minute: int
    max_concurrent: int
    budget_tokens: int  # UNLIMITED or a count
    budget_spend_micros: int  # UNLIMITED or micro-units
    # The calling API key's own limits, checked in the same atomic step as the tenant's ("": no key). They belong
    # to the key's lineage (`ApiKey.lineage`: the first key's prefix, kept by every rotation), not to one secret.
    key_prefix: str = ""
    key_requests_per_minute: int = UNLIMITED
    key_tokens_per_minute: int = UNLIMITED
    key_budget_spend_picos: int = UNLIMITED  # counted exactly, in the invoice's own units (1e-12)

    @classmethod
    def of_plan(cls, plan, key=None) -> "Limits":
        """The plan's limits, and `key`'s (an ApiKey) where it sets any."""
        budget = plan.monthly_token_budget
        spend = plan.monthly_spend_limit
        key_fields = {}
        if key is not None:
            key_fields = {
                "key_prefix": key.lineage or key.prefix,
                "key_requests_per_minute": _or_unlimited(key.requests_per_minute),
                "key_tokens_per_minute": _or_unlimited(key.tokens_per_minute),
                "key_budget_spend_picos": UNLIMITED if key.monthly_spend_limit is None
                else spend_to_picos(key.monthly_spend_limit),
            }  # fmt: skip
        return cls(
            requests_per_minute=plan.requests_per_minute,
            tokens_per_minute=plan.tokens_per_minute,
            max_concurrent=plan.max_concurrent_requests,
            budget_tokens=UNLIMITED if budget is None else budget,
            budget_spend_micros=UNLIMITED if spend is None else spend_to_micros(spend),
            **key_fields,
        )


class Decision(NamedTuple):
    """What admission decided. A named tuple: made on every request, about a fifth of a frozen dataclass's cost."""

    admitted: bool
    # "ok" | "requests" | "tokens" | "concurrency" | "budget_tokens" | "budget_spend" | "budget_held", and the
    # key's own: "key_requests" | "key_tokens" | "key_budget_spend" | "key_budget_held"
    reason: str
    window_requests: int
    window_tokens: int
    reset_ms: int  # until the current one-minute window ends
    # The API key's own window (its requests and tokens counted with this one's), where the key is known and the
    # script got that far: what an admitted call's headers report when the key's limit is the nearer one.
    key_window_requests: int = 0
    key_window_tokens: int = 0


@dataclass(frozen=True)
class HeldTotals:
    live_holds: int
    held_tokens: int
    month_tokens: int  # settled (final and provisional) usage this month, as admission counts it
    month_spend_picos: int  # the sum of those requests' prices, exact (1e-12 of the currency)
    provisional_tokens: int = 0  # of month_tokens: settled by a gateway on a broken stream, awaiting the engine's
    provisional_spend_picos: int = 0


@dataclass(frozen=True)
class Reconciled:
    """A month total set from metering's record (+ provisional settles): what it was and what it became, its spend in
    picos. `applied` is False when settles kept landing while the record was read (the next run tries again). For a
    key lineage (`key_reconcile`) the token fields are 0."""

    applied: bool
    tokens_before: int
    spend_picos_before: int
    tokens_after: int
    spend_picos_after: int


def _or_unlimited(value: int | None) -> int:
    return UNLIMITED if value is None else value


def spend_to_micros(spend: Decimal) -> int:
    return math.ceil(spend * MICROS)


def spend_to_picos(spend: Decimal) -> int:
    """Exact: metering's prices are quantized to 1e-12, so a sum of them in picos never drifts from the invoice."""
    return math.ceil(spend * PICOS)


def picos_to_spend(picos: int) -> Decimal:
    return Decimal(picos) / PICOS


_month = ""
_month_until = 0.0  # when `_month` was worked out, plus a second


def current_month() -> str:
    """"YYYY-MM" (UTC), worked out at most once a second (it is on every admission's path)."""
    global _month, _month_until
    now = time.time()
    if now >= _month_until:
        _month, _month_until = datetime.fromtimestamp(now, UTC).strftime("%Y-%m"), now + 1.0
    return _month


def seconds_to_month_end() -> int:
    now = datetime.now(UTC)
    following = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return max(1, math.ceil((following - now).total_seconds()))
