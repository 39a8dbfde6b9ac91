"""Money in the console: cents when there are cents, two significant digits below a cent, one sign convention."""

from datetime import date
from decimal import Decimal

import pytest

from console.charts import DayPoint, usage_chart
from console.money_format import money_axis_text, money_text


@pytest.mark.parametrize(
    ("amount", "text"),
    [
        ("0", "$0.00"), ("0.000024", "$0.000024"), ("0.0000239", "$0.000024"), ("-0.000012", "-$0.000012"),
        ("0.0031", "$0.0031"), ("0.42", "$0.42"), ("1234.567", "$1,234.57"), ("0.0000004", "$0.0000004"),
        ("0.00000583", "$0.0000058"),
        ("-1.5", "-$1.50"),
    ],
)  # fmt: skip
def test_sub_cent_amounts_keep_two_significant_digits(amount, text):
    assert money_text(Decimal(amount)) == text


def test_a_negative_margin_reads_negative_in_money_as_in_its_ratio():
    revenue, cost = Decimal("0.000106"), Decimal("0.000118")
    assert money_text(revenue - cost) == "-$0.000012"


def test_the_spend_axis_of_a_sub_cent_chart_has_distinct_ticks():
    points = [DayPoint(day=date(2026, 11, day), lower=1000, upper=200, line=Decimal("0.000024") * day) for day in (1, 2)]
    svg = str(usage_chart(points))
    ticks = [money_axis_text(0.00006 * share / 4, step=0.00006 / 4) for share in range(5)]
    assert ticks == ["$0", "$0.000015", "$0.000030", "$0.000045", "$0.000060"]
    for tick in ticks:
        assert f">{tick}</text>" in svg
    assert "$0.000048 spend" in svg and "$0.00 spend" not in svg
