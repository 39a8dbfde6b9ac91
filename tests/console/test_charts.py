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
    ticks = re.findall(r'text-anchor="end">([^<$]*)</text>', str(usage_chart(points)))
    assert ticks == ["4", "3", "2", "1", "0"]
