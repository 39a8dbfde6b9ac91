"""Reads over the gateway's state for the console and operators."""

from dataclasses import dataclass
from decimal import Decimal

from gateway.admission import held_totals, picos_to_spend, spend_to_picos
from gateway.models import Engine
from metering.selectors import usage_month_recorded


@dataclass(frozen=True)
class AdmissionDrift:
    """This month as admission counts it (settled finally + provisionally) beside metering's record. `drift_*` is
    admission minus (record + provisional): 0 when they agree, momentarily non-zero while events are in flight
    between the engine and the worker, and corrected by the reconcile task (`gateway.reconcile_admission`). Spend in
    picos (1e-12 of the currency): admission counts each request's price exactly, as metering records it."""

    admission_tokens: int
    admission_spend_picos: int
    recorded_tokens: int
    recorded_spend_picos: int
    provisional_tokens: int
    provisional_spend_picos: int
    live_holds: int
    held_tokens: int

    @property
    def drift_tokens(self) -> int:
        return self.admission_tokens - self.recorded_tokens - self.provisional_tokens

    @property
    def drift_spend(self) -> Decimal:
        return picos_to_spend(self.admission_spend_picos - self.recorded_spend_picos - self.provisional_spend_picos)


def admission_month_drift(*, tenant_id: int) -> AdmissionDrift:
    totals = held_totals(tenant_id=tenant_id)
    recorded_tokens, recorded_price = usage_month_recorded(tenant_id=tenant_id)
    return AdmissionDrift(
        admission_tokens=totals.month_tokens, admission_spend_picos=totals.month_spend_picos,
        recorded_tokens=recorded_tokens, recorded_spend_picos=spend_to_picos(recorded_price),
        provisional_tokens=totals.provisional_tokens, provisional_spend_picos=totals.provisional_spend_picos,
        live_holds=totals.live_holds, held_tokens=totals.held_tokens,
    )  # fmt: skip


def engine_gpu_prices(names: set[str]) -> dict[str, Decimal]:
    """Engine name -> its pool's hourly GPU price (metering's source for each request's cost)."""
    return dict(Engine.objects.filter(name__in=names).values_list("name", "gpu_price_per_hour"))
