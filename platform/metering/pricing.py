"""Price and cost arithmetic, all in Decimal: the one price function for admission's holds, settlement, metering
and invoices.

price = (uncached input × input rate + cached input × cached rate + output × output rate) / 1e6, exact to 12 places
(token counts are integers, rates have 6 places). cost = gpu_ms × hourly price / 3.6e6, rounded to 12 places.
Rates: a plan's ModelPrice row for the base model where one exists, else the plan's own prices.
"""

from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal

from metering.models import ModelPrice
from tenancy.models import Plan

PER_MILLION = Decimal(1_000_000)
MS_PER_HOUR = Decimal(3_600_000)
MONEY_PLACES = Decimal("1e-12")


@dataclass(frozen=True)
class Rates:
    input: Decimal
    cached_input: Decimal
    output: Decimal


def rates_for(
    *, plan: Plan, base_model: str, overrides: dict[tuple[int, str], ModelPrice] | None = None
) -> Rates:
    """The plan's rates for this base model: its ModelPrice row where one exists, else the plan's own prices."""
    override = (overrides or {}).get((plan.pk, base_model))
    source = override if override is not None else plan
    return Rates(
        source.price_input_per_mtok, source.price_cached_input_per_mtok, source.price_output_per_mtok
    )


def plan_rates(*, plan: Plan) -> tuple[Rates, dict[str, Rates]]:
    """The plan's own rates and its per-base-model overrides (what the gateway keeps with a caller)."""
    overrides = {
        price.base_model: Rates(price.price_input_per_mtok, price.price_cached_input_per_mtok, price.price_output_per_mtok)
        for price in ModelPrice.objects.filter(plan=plan)
    }
    return rates_for(plan=plan, base_model=""), overrides


def request_price(*, rates: Rates, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
    uncached = prompt_tokens - cached_tokens
    total = uncached * rates.input + cached_tokens * rates.cached_input + completion_tokens * rates.output
    return (total / PER_MILLION).quantize(MONEY_PLACES)


def gpu_cost(*, gpu_ms: Decimal, gpu_price_per_hour: Decimal) -> Decimal:
    return (gpu_ms * gpu_price_per_hour / MS_PER_HOUR).quantize(MONEY_PLACES, rounding=ROUND_HALF_EVEN)


# Where engines' hourly GPU prices come from: the app that knows engines (the gateway) provides it at start-up
# (`gpu_price_source_set`), so that metering does not import it back.
_gpu_price_source: Callable[[set[str]], dict[str, Decimal]] | None = None


def gpu_price_source_set(source: Callable[[set[str]], dict[str, Decimal]]) -> None:
    global _gpu_price_source
    _gpu_price_source = source


def engine_gpu_prices(*, names: set[str]) -> dict[str, Decimal]:
    """Engine name -> hourly GPU price, for the engines named; none known without a source."""
    names = {name for name in names if name}
    return _gpu_price_source(names) if _gpu_price_source is not None and names else {}
