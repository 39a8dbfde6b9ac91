"""Price and cost arithmetic, all in Decimal: the one price function for admission's holds, settlement, metering
and invoices (and, for the gateway's settle, the same price in integer picos where that is exact).

price = (uncached input × input rate + cached input × cached rate + output × output rate) / 1e6, exact to 12 places
(token counts are integers, rates have 6 places). cost = gpu_ms × hourly price / 3.6e6, rounded to 12 places.
Rates: a plan's ModelPrice row for the base model where one exists, else the plan's own prices.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal
from functools import cached_property

from metering.models import ModelPrice
from tenancy.models import Plan

PER_MILLION = Decimal(1_000_000)
MS_PER_HOUR = Decimal(3_600_000)
MONEY_PLACES = Decimal("1e-12")
PICOS = Decimal(10) ** 12  # a price in picos (1e-12) is a whole number: MONEY_PLACES is its quantum
_WHOLE_TOKENS = 40  # counts below 2**40 and rates below 1e8 per million tokens keep every step of `request_price`
_WHOLE_RATE = 10**14  # exact in Decimal's 28 digits (its default context, the gateway's)


@dataclass(frozen=True)
class Rates:
    input: Decimal
    cached_input: Decimal
    output: Decimal

    @cached_property
    def picos_per_token(self) -> tuple[int, int, int] | None:
        """The three rates in picos per token (a rate per million tokens in micro-units), when each is a whole number
        of them (at most six decimal places, as the database keeps rates) from 0 to 1e14; else None."""
        units = []
        for rate in (self.input, self.cached_input, self.output):
            if not isinstance(rate, Decimal) or not rate.is_finite() or rate.is_signed():  # (a negative rate: -0)
                return None
            numerator, denominator = rate.as_integer_ratio()  # exact
            whole, part = divmod(numerator * 1_000_000, denominator)
            if part or whole >= _WHOLE_RATE:
                return None
            units.append(whole)
        return units[0], units[1], units[2]


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


def request_price_picos(*, rates: Rates, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
    """`request_price` in picos, `ceil(price * 1e12)` (exact: the price is quantized to 1e-12). In integers where
    every step of `request_price` is exact in Decimal's 28 digits, so the same number (rates of whole picos per
    token under 1e14, counts from 0 to 2**40: `tests/metering/test_price_units.py`); through it otherwise."""
    units = rates.picos_per_token
    if units is not None and (prompt_tokens | cached_tokens | completion_tokens) >> _WHOLE_TOKENS == 0:
        return (prompt_tokens - cached_tokens) * units[0] + cached_tokens * units[1] + completion_tokens * units[2]
    price = request_price(rates=rates, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                          completion_tokens=completion_tokens)  # fmt: skip
    return math.ceil(price * PICOS)


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
