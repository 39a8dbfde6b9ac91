"""The `compact` filter (token counts in cards and charts): what rounds up to 1000 of a unit shows in the next."""

import pytest

from console.templatetags.quilt import compact


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (None, "—"),
        (0, "0"),
        (999, "999"),
        (999.4, "999"),
        (999.6, "1.0K"),
        (1_000, "1.0K"),
        (12_345, "12.3K"),
        (99_949, "99.9K"),
        (99_950, "100K"),
        (100_000, "100K"),
        (999_499, "999K"),
        (999_950, "1.0M"),
        (999_999, "1.0M"),
        (1_000_000, "1.0M"),
        (12_345_678, "12.3M"),
        (999_950_000_000, "1.0T"),
        (2_500_000_000_000_000, "2500T"),
        (-99_950, "-100K"),
    ],
    ids=str,
)
def test_compact_rounds_over_into_the_next_unit(value, shown):
    assert compact(value) == shown


@pytest.mark.parametrize(
    ("value", "shown"),
    [("29.518441", "29.5"), ("0.000555556", "0.000556"), (0, "0"), (100.0, "100"), (1234.5, "1,234"), (None, "—")],
)
def test_a_measured_rate_shows_three_significant_digits(value, shown):
    from console.templatetags.quilt import rate

    assert rate(value) == shown
