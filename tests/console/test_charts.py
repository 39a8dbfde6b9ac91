"""Charts drawn on the server: axes whose ticks read as what they count."""

import re
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

import pytest

from console.charts import DayPoint, Series, series_chart, usage_chart

LEFT_TICK = re.compile(r'<text class="axis" x="2" y="[\d.]+">([^<]*)</text>')


def left_ticks(svg: str) -> list[str]:
    return LEFT_TICK.findall(svg)


@pytest.mark.parametrize("peak", [1, 2, 3, 5, 9, 10])
def test_a_count_axis_ticks_whole_requests(peak):
    starts = [datetime(2026, 11, 1, tzinfo=UTC) + timedelta(days=day) for day in range(3)]
    svg = str(series_chart(starts=starts, bucket="day", bars=Series("Requests", [peak, 0, 1], "tone-1"),
                           left=[Series("Errors", [0, 0, 0], "tone-2")]))  # fmt: skip
    ticks = left_ticks(svg)
    assert len(ticks) == 5 and all(tick.isdigit() for tick in ticks), ticks
    assert int(ticks[0]) >= peak


def test_a_measured_axis_keeps_its_decimals():
    starts = [datetime(2026, 11, 1, tzinfo=UTC) + timedelta(hours=hour) for hour in range(2)]
    svg = str(series_chart(starts=starts, bucket="hour", left=[Series("TTFT", [0.4, 0.2], "tone-1")], left_unit=" ms"))
    assert left_ticks(svg) == ["0.4 ms", "0.3 ms", "0.2 ms", "0.1 ms", "0 ms"]


def test_a_token_axis_of_a_single_token_ticks_whole_tokens():
    points = [DayPoint(day=date(2026, 11, 1), lower=1, upper=0, line=Decimal("0.000001"))]
    ticks = re.findall(r'<text class="axis" x="2" y="[0-9.]+">([^<$]*)</text>', str(usage_chart(points)))
    assert ticks == ["4", "3", "2", "1", "0"]


def test_an_hourly_axis_names_each_day_and_a_lone_hour_is_a_dot():
    from datetime import UTC, datetime, timedelta

    starts = [datetime(2026, 11, 23, 20, tzinfo=UTC) + timedelta(hours=h) for h in range(24)]
    values = [None] * 24
    values[10] = 250.0  # one hour with data, 23 without: no line can draw it
    svg = str(series_chart(starts=starts, bucket="hour", left=[Series("p50", values, "tone-1")], left_unit=" ms"))
    labels = re.findall(r'<text class="axis x[^"]*"[^>]*>([^<]*)</text>', svg)
    assert labels[0] == "Nov 23" and "Nov 24" in labels and any(":" in label for label in labels)
    assert svg.count('class="series-dot tone-1"') == 1 and 'r="4"' in svg


def test_latency_percentiles_without_percentile_cont_interpolate_like_postgresql():
    from metering.selectors import _percentile

    values = [100.0, 200.0, 300.0, 400.0]
    assert [_percentile(values, fraction) for fraction in (0.5, 0.95, 0.99)] == [250.0, 385.0, 397.0]
    assert _percentile([42.0], 0.99) == 42.0
