"""How the console writes money: cents when there are cents, and sub-cent amounts with two significant digits.

Usage is priced per token, so a tenant's day can cost $0.000024 and one request $0.0000058. Rounding that to
"$0.00" tells them nothing (and makes a margin of -$0.000012 read "$0.00, -11.3%"): amounts below a cent keep two
significant digits however small, so a request reads the same in the log's list and on its own page; the sign is
written the same way everywhere (a leading minus).
"""

from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")


def _decimal(value) -> Decimal:
    return value if isinstance(value, Decimal) else Decimal(str(value))


def money_text(value) -> str:
    """$1,234.56 · $0.42 · $0.0031 · $0.000024 · $0.0000058 · -$0.000012 · $0.00 (exactly zero)."""
    amount = _decimal(value)
    sign = "-" if amount < 0 else ""
    size = abs(amount)
    if size == 0:
        return "$0.00"
    if size >= CENT:
        return f"{sign}${size.quantize(CENT, rounding=ROUND_HALF_UP):,.2f}"
    exponent = size.adjusted()  # -3 for 0.0031
    places = -exponent + 1  # two significant digits
    text = f"{size.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP):f}".rstrip("0")
    return f"{sign}${text}"


def money_exact_text(value) -> str:
    """An invoice line's exact amount: every decimal it has (at least two), so lines visibly add up to the subtotal
    that the total rounds once: $0.04 · $0.00133 · $1,234.000004 · -$0.004."""
    amount = _decimal(value)
    sign = "-" if amount < 0 else ""
    text = f"{abs(amount).normalize():f}"
    whole, _, decimals = text.partition(".")
    return f"{sign}${int(whole):,}.{decimals.ljust(2, '0')}"


def money_axis_text(value: float, *, step: float) -> str:
    """A chart tick: as many decimals as the tick step needs (so $0.00002, $0.00004 … never all read $0.00)."""
    if value == 0:
        return "$0"
    if step >= 1:
        return f"${value:,.0f}" if value < 1000 else f"${value / 1000:,.1f}K".replace(".0K", "K")
    places = min(8, max(2, -Decimal(f"{step:.12g}").normalize().as_tuple().exponent))
    return f"${value:,.{places}f}"
