"""The price in integers gives what the Decimal price function gives: admission's picos of
`request_price` (`request_price_picos`), for rates as the database keeps them and counts up to 2**40; rates or
counts outside that go through Decimal (its errors too). `request_price` is compared with its own code as it was,
kept here as the oracle; what a key spends at admission, to the pico-dollar, in tests/gateway/test_key_money.py."""

import math
import random
from decimal import Decimal, InvalidOperation

import pytest

from gateway.admission.limits import spend_to_picos
from metering.pricing import MONEY_PLACES, PER_MILLION, Rates, request_price, request_price_picos


def old_request_price(*, rates: Rates, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
    """The price function before the integers (the oracle)."""
    uncached = prompt_tokens - cached_tokens
    total = uncached * rates.input + cached_tokens * rates.cached_input + completion_tokens * rates.output
    return (total / PER_MILLION).quantize(MONEY_PLACES)


def _rate(rng: random.Random) -> Decimal:
    """A rate per million tokens as a DecimalField(max_digits=12, decimal_places=6) holds it, or as written by hand."""
    kind = rng.randrange(5)
    if kind == 0:
        return Decimal(rng.randrange(10**12)).scaleb(-6)  # the database's: six places, trailing zeros kept
    if kind == 1:
        return Decimal(rng.randrange(1000)) / 4  # 0.25 steps, few digits
    if kind == 2:
        return Decimal(f"{rng.randrange(100)}.{rng.randrange(10**6):06d}000000000000000000000")  # long zeros
    if kind == 3:
        return Decimal(rng.choice(["0", "0.000001", "999999.999999", "1E+3", "5E-6", "0.00"]))
    return Decimal(rng.randrange(10**6))


def _count(rng: random.Random) -> int:
    return rng.choice([0, 1, 2**40 - 1, rng.randrange(200), rng.randrange(10**6), rng.randrange(2**40)])


def _same(rates: Rates, prompt: int, cached: int, completion: int) -> None:
    counts = dict(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)
    old = old_request_price(rates=rates, **counts)
    new = request_price(rates=rates, **counts)
    assert new == old and new.as_tuple() == old.as_tuple(), (rates, counts)
    assert request_price_picos(rates=rates, **counts) == spend_to_picos(old), (rates, counts)


def test_the_integer_price_is_the_decimal_one_for_the_databases_rates():
    rng = random.Random(37)
    integer_paths = 0
    for _ in range(20_000):
        rates = Rates(_rate(rng), _rate(rng), _rate(rng))
        integer_paths += rates.picos_per_token is not None
        prompt, completion = _count(rng), _count(rng)
        cached = rng.choice([0, prompt, rng.randrange(prompt + 1), _count(rng)])  # more than the prompt too
        _same(rates, prompt, cached, completion)
    assert integer_paths == 20_000  # every rate above is a whole number of picos per token


@pytest.mark.parametrize(("rates", "counts"), [
    (Rates(Decimal("0.0000001"), Decimal(1), Decimal(1)), (10, 2, 3)),  # seven places: Decimal's way
    (Rates(Decimal("-1.5"), Decimal(1), Decimal("-0")), (0, 0, 0)),  # negative rates: -0 stays -0
    (Rates(Decimal("-1.5"), Decimal(1), Decimal(2)), (10, 20, 3)),
    (Rates(Decimal("123456789.5"), Decimal(1), Decimal(1)), (10, 2, 3)),  # over 1e8 per million tokens
    (Rates(Decimal("2.5"), Decimal(1), Decimal(1)), (2**40, 2, 3)),  # counts past 2**40
    (Rates(Decimal("2.5"), Decimal(1), Decimal(1)), (2**50 + 7, 2**45, 3)),
    (Rates(Decimal("2.5"), Decimal(1), Decimal(1)), (-5, 0, 3)),  # a negative count
    (Rates(Decimal("0.000001"), Decimal("0.000001"), Decimal("0.000001")), (2**40 - 1, 2**40 - 1, 2**40 - 1)),
    (Rates(Decimal("99999999.999999"), Decimal(0), Decimal("99999999.999999")), (2**40 - 1, 0, 2**40 - 1)),
])  # fmt: skip
def test_rates_and_counts_outside_the_integers_reach_the_same_price(rates, counts):
    _same(rates, *counts)


def test_a_price_past_decimals_28_digits_fails_as_before():
    """Counts whose price has more digits than Decimal's context holds: quantize refuses it, in both."""
    rates = Rates(Decimal("99999999.999999"), Decimal(0), Decimal(1))
    counts = dict(prompt_tokens=2**70, cached_tokens=0, completion_tokens=0)
    with pytest.raises(InvalidOperation):
        old_request_price(rates=rates, **counts)
    with pytest.raises(InvalidOperation):
        request_price(rates=rates, **counts)
    with pytest.raises(InvalidOperation):
        request_price_picos(rates=rates, **counts)


def test_the_picos_are_exact():
    rates = Rates(Decimal("0.123457"), Decimal("0.000001"), Decimal("3.000001"))
    assert rates.picos_per_token == (123457, 1, 3000001)
    picos = request_price_picos(rates=rates, prompt_tokens=7, cached_tokens=2, completion_tokens=5)
    assert picos == 5 * 123457 + 2 * 1 + 5 * 3000001 == math.ceil(old_request_price(
        rates=rates, prompt_tokens=7, cached_tokens=2, completion_tokens=5) * 10**12)  # fmt: skip
