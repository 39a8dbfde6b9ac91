"""Presentation of what metering's selectors read: a date window, and a chart's points with empty days filled.

The console reads usage and money only through metering's and billing's selectors; nothing here queries."""

from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

from console.charts import DayPoint
from metering.selectors import UsageTotals


@dataclass(frozen=True)
class Window:
    since: date
    until: date

    @property
    def days(self) -> list[date]:
        return [self.since + timedelta(days=offset) for offset in range((self.until - self.since).days + 1)]


def chart_points(*, window: Window, totals: list[UsageTotals]) -> list[DayPoint]:
    """One point per day of the window (days without usage are zero), from per-day totals."""
    by_day = {row.group: row for row in totals}
    points = []
    for day in window.days:
        row = by_day.get(day.isoformat())
        if row is None:
            points.append(DayPoint(day=day, lower=0, upper=0, line=Decimal(0)))
        else:
            points.append(DayPoint(day=day, lower=row.prompt_tokens, upper=row.completion_tokens, line=row.price))
    return points
