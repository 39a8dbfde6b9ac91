"""Charts rendered on the server as SVG: daily bars (tokens, stacked in two parts) with a line (spend).

Rendering here keeps the console free of a JavaScript charting bundle; each bar carries a <title> with its exact
values, which console.js shows as a tooltip beside the bar (and a browser without scripts as its own).
"""

import math
from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from console.money_format import money_axis_text, money_text

WIDTH, HEIGHT = 760, 240
LEFT, RIGHT, TOP, BOTTOM = 52, 56, 14, 42
# Axis labels are sized for the narrowest screen: at 390 px a 760-unit chart is drawn ~308 px wide, and its axis
# font is set to be 12.5 px on screen (console.js), about 31 units there, so a character is about 18.5 units.
# Margins make room for that, so a label never sits over the data on a phone; on wider screens the same room is
# merely generous.
AXIS_CHAR = 18.5


@dataclass(frozen=True)
class DayPoint:
    day: date
    lower: int  # the bar's first part (input tokens)
    upper: int  # stacked on top (output tokens)
    line: Decimal  # spend


def nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 4, 6 or 8 times a power of ten that is >= value: an axis maximum whose quarters
    (the grid lines) are round numbers."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 4, 6, 8, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def count_ceiling(value: float) -> int:
    """nice_ceiling for things counted in whole units (requests, tokens): at least 4 and a multiple of 4, so that
    every quarter tick is a whole number (never 0.25 requests)."""
    top = nice_ceiling(max(value, 4))
    while top % 4:
        top = nice_ceiling(top + 1)
    return int(top)


def _compact(value: float) -> str:
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= limit:
            text = f"{value / limit:.1f}".rstrip("0").rstrip(".")
            return text + suffix
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"




def axis_margin(labels: list[str], *, minimum: int, char_width: float = 6.6) -> int:
    """Room for an axis's longest label at the chart's axis font (11 px: about 6.6 units a character; the half-width
    charts' 15 px: 9). Labels are anchored at the chart's outer edge, so a larger font (phones) grows them into
    the plot, never out of view."""
    return max(minimum, 12 + math.ceil(char_width * max(len(label) for label in labels)))


def _svg_path(points: list[tuple[float, float]]) -> str:
    """An SVG path through the points: move to the first, a line to each next."""
    return " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(points))


def _lone_indexes(values: list) -> set[int]:
    """Buckets with a value but none on either side: a line can't draw them."""
    return {
        index for index, value in enumerate(values) if value is not None
        and (index == 0 or values[index - 1] is None) and (index == len(values) - 1 or values[index + 1] is None)
    }  # fmt: skip


def _svg_path_runs(values: list, points: list[tuple[float, float]]) -> str:
    """A path through the points, broken where a bucket has no value (a gap is not a straight line)."""
    parts, point = [], iter(points)
    previous = None
    for value in values:
        if value is None:
            previous = None
            continue
        x, y = next(point)
        parts.append(f"{'M' if previous is None else 'L'}{x:.1f},{y:.1f}")
        previous = value
    return " ".join(parts)


def usage_chart(points: list[DayPoint], *, label: str = "Daily tokens and spend") -> SafeString:
    if not any(point.lower or point.upper for point in points):
        return mark_safe("")
    bar_max = count_ceiling(max(point.lower + point.upper for point in points))
    line_max = nice_ceiling(float(max(point.line for point in points)))
    money_ticks = [money_axis_text(line_max * (1 - i / 4), step=line_max / 4) for i in range(5)]
    count_ticks = [_compact(bar_max * (1 - i / 4)) for i in range(5)]
    right = axis_margin(money_ticks, minimum=RIGHT, char_width=AXIS_CHAR)
    left = axis_margin(count_ticks, minimum=LEFT, char_width=AXIS_CHAR)
    plot_w, plot_h = WIDTH - left - right, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(points)
    bar_w = max(2.0, min(26.0, slot * 0.62))
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}" '
        f'data-days="{len(points)}" data-total-tokens="{sum(p.lower + p.upper for p in points)}">',
        '<defs><linearGradient id="bar-fill" x1="0" y1="0" x2="0" y2="1">'
        '<stop offset="0" stop-color="#6366f1"/><stop offset="1" stop-color="#4f46e5"/></linearGradient></defs>',
    ]
    for i in range(5):
        y = TOP + plot_h * i / 4
        parts.append(f'<line class="grid-line" x1="{left}" x2="{WIDTH - right}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="axis" x="2" y="{y + 4:.1f}">{count_ticks[i]}</text>')
        parts.append(f'<text class="axis" x="{WIDTH - 2}" y="{y + 4:.1f}" text-anchor="end">{money_ticks[i]}</text>')
    label_every = max(1, math.ceil(len(points) / 10))
    line_points = []
    for index, point in enumerate(points):
        center = left + slot * (index + 0.5)
        lower_h = plot_h * point.lower / bar_max
        upper_h = plot_h * point.upper / bar_max
        x = center - bar_w / 2
        base = TOP + plot_h
        title = (
            f"{point.day:%b %d}: {point.lower:,} input + {point.upper:,} output tokens, "
            f"{money_text(point.line)} spend"
        )
        parts.append(f'<g class="day" data-day="{point.day.isoformat()}"><title>{escape(title)}</title>')
        parts.append(f'<rect class="bar" x="{x:.1f}" y="{base - lower_h:.1f}" width="{bar_w:.1f}" height="{lower_h:.1f}" rx="2"/>')
        if upper_h > 0:
            parts.append(
                f'<rect class="bar-2" x="{x:.1f}" y="{base - lower_h - upper_h:.1f}" width="{bar_w:.1f}" '
                f'height="{upper_h:.1f}" rx="2"/>'
            )
        parts.append(f'<rect x="{center - slot / 2:.1f}" y="{TOP}" width="{slot:.1f}" height="{plot_h}" fill="transparent"/></g>')
        if index % label_every == 0:
            odd = " x-odd" if (index // label_every) % 2 else ""
            parts.append(
                f'<text class="axis x{odd}" x="{center:.1f}" y="{HEIGHT - 6}" text-anchor="middle">{point.day:%b %d}</text>'
            )
        line_points.append((center, TOP + plot_h * (1 - float(point.line) / line_max)))
    path = _svg_path(line_points)
    parts.append(f'<path class="line" d="{path}"/>')
    if len(points) <= 31:
        parts += [f'<circle class="dot" cx="{x:.1f}" cy="{y:.1f}" r="2.6"/>' for x, y in line_points]
    parts.append("</svg>")
    return mark_safe("".join(parts))


@dataclass(frozen=True)
class Series:
    label: str
    values: list  # one number (or None: no data) per bucket
    tone: str  # css class: tone-1 .. tone-4


def _axis_number(value: float, *, step: float) -> str:
    if step >= 1 or value == 0:
        return _compact(value)
    places = min(4, max(1, -Decimal(f"{step:.12g}").normalize().as_tuple().exponent))
    return f"{value:.{places}f}"


def _bucket_label(start: datetime, bucket: str) -> str:
    """A bucket in a readout: the day, and the hour for hourly buckets."""
    return f"{start:%b %d %H:%M}" if bucket == "hour" else f"{start:%b %d}"


def _axis_labels(starts: list[datetime], bucket: str, every: int) -> dict[int, str]:
    """Index -> axis label for every `every`-th bucket: days as "Nov 24"; hours as "13:00", except the first
    label of each day, which names the day, so an hourly axis always says which day it shows."""
    labels, last_day = {}, None
    for index in range(0, len(starts), every):
        start = starts[index]
        new_day = bucket == "day" or start.date() != last_day
        labels[index] = f"{start:%b %d}" if new_day else f"{start:%H:%M}"
        last_day = start.date()
    return labels


def quarter_grid(*, x1: float, x2: float, plot_h: float, ticks: list[str], tick_x: float) -> list[str]:
    """A grid line at the top, each quarter and the bottom of the plot, each with its tick on the left axis."""
    parts = []
    for i, tick in enumerate(ticks):
        y = TOP + plot_h * i / 4
        parts.append(f'<line class="grid-line" x1="{x1}" x2="{x2}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="axis" x="{tick_x}" y="{y + 4:.1f}">{tick}</text>')
    return parts


def series_chart(
    *, starts: list[datetime], bucket: str, left: list[Series], right: Series | None = None, bars: Series | None = None,
    left_unit: str = "", right_unit: str = "", label: str = "",
) -> SafeString:
    """Hourly or daily series: optional bars and lines on the left axis, one line on a right axis.
    Returns "" when nothing has data, so the page shows its empty state."""
    everything = [*(left or []), *([right] if right else []), *([bars] if bars else [])]
    if not any(value for series in everything for value in series.values if value):
        return mark_safe("")
    left_values = [v for series in [*left, *([bars] if bars else [])] for v in series.values if v is not None]
    counts = all(isinstance(value, int) for value in left_values)
    left_max = (count_ceiling if counts else nice_ceiling)(max(left_values, default=0))
    right_max = nice_ceiling(max((v for v in right.values if v is not None), default=0)) if right else 1.0
    left_ticks = [_axis_number(left_max * (1 - i / 4), step=left_max / 4) + left_unit for i in range(5)]
    right_ticks = [_axis_number(right_max * (1 - i / 4), step=right_max / 4) + right_unit for i in range(5)]
    left_room = axis_margin(left_ticks, minimum=LEFT, char_width=AXIS_CHAR)
    right_room = axis_margin(right_ticks, minimum=RIGHT, char_width=AXIS_CHAR) if right else RIGHT
    plot_w, plot_h = WIDTH - left_room - right_room, HEIGHT - TOP - BOTTOM
    slot = plot_w / len(starts)
    parts = [
        f'<svg class="chart series-chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(label)}" '
        f'data-buckets="{len(starts)}" data-bucket="{bucket}">'
    ]
    parts += quarter_grid(x1=left_room, x2=WIDTH - right_room, plot_h=plot_h, ticks=left_ticks, tick_x=2)
    if right:
        parts += [f'<text class="axis" x="{WIDTH - 2}" y="{TOP + plot_h * i / 4 + 4:.1f}" text-anchor="end">'
                  f'{right_ticks[i]}</text>' for i in range(5)]  # fmt: skip
    label_every = max(1, math.ceil(len(starts) / 8))
    axis_labels = _axis_labels(starts, bucket, label_every)
    base = TOP + plot_h
    bar_w = max(2.0, min(22.0, slot * 0.6))
    for index, start in enumerate(starts):
        center = left_room + slot * (index + 0.5)
        values = "; ".join(
            f"{series.label} {series.values[index]:,.1f}" if isinstance(series.values[index], float)
            else f"{series.label} {series.values[index] if series.values[index] is not None else '—'}"
            for series in everything
        )  # fmt: skip
        parts.append(f'<g class="bucket" data-start="{start.isoformat()}"><title>{escape(_bucket_label(start, bucket))}: '
                     f'{escape(values)}</title>')  # fmt: skip
        if bars and bars.values[index]:
            height = plot_h * bars.values[index] / left_max
            parts.append(f'<rect class="bar {bars.tone}" x="{center - bar_w / 2:.1f}" y="{base - height:.1f}" '
                         f'width="{bar_w:.1f}" height="{height:.1f}" rx="2"/>')  # fmt: skip
        parts.append(f'<rect x="{center - slot / 2:.1f}" y="{TOP}" width="{slot:.1f}" height="{plot_h}" fill="transparent"/></g>')
        if index in axis_labels:
            odd = " x-odd" if (index // label_every) % 2 else ""
            parts.append(f'<text class="axis x{odd}" x="{center:.1f}" y="{HEIGHT - 6}" text-anchor="middle">'
                         f'{axis_labels[index]}</text>')  # fmt: skip
    for series, top in [*((s, left_max) for s in left), *(((right, right_max),) if right else ())]:
        points = [
            (left_room + slot * (index + 0.5), TOP + plot_h * (1 - value / top))
            for index, value in enumerate(series.values) if value is not None
        ]  # fmt: skip
        if not points:
            continue
        path = _svg_path_runs(series.values, points)
        parts.append(f'<path class="series-line {series.tone}" d="{path}" data-series="{escape(series.label)}"/>')
        lone = _lone_indexes(series.values)
        for (x, y), index in zip(points, [i for i, v in enumerate(series.values) if v is not None], strict=True):
            if len(starts) <= 48 or index in lone:  # a point with no neighbour has no line: its dot shows it
                size = 4 if index in lone else 2.4
                parts.append(f'<circle class="series-dot {series.tone}" cx="{x:.1f}" cy="{y:.1f}" r="{size}" '
                             f'data-series="{escape(series.label)}"/>')  # fmt: skip
    parts.append("</svg>")
    return mark_safe("".join(parts))


TITLE_ROOM = 40  # a rotated y-axis title, or an x-axis title below the ticks, at the phone's axis font


def break_even_chart(points: list[dict], break_even: str | None) -> SafeString:
    """Monthly cost against monthly tokens (economics' break-even points: volume, API cost, self-hosted cost):
    the API's line and self-hosting's steps (whole engines), both axes ticked in quarters and titled, the
    break-even volume marked, and each point read out on hover or tap."""
    volumes = [float(point["tokens_per_month"]) for point in points]
    api = [float(point["api"]) for point in points]
    self_host = [float(point["self_host"]) for point in points]
    x_max = max(volumes) or 1.0
    y_max = nice_ceiling(max([*api, *self_host]))
    y_ticks = [money_axis_text(y_max * (1 - i / 4), step=y_max / 4) for i in range(5)]
    height, bottom = HEIGHT + TITLE_ROOM, BOTTOM + TITLE_ROOM
    left = TITLE_ROOM + axis_margin(y_ticks, minimum=LEFT, char_width=AXIS_CHAR)
    plot_w, plot_h = WIDTH - left - RIGHT, height - TOP - bottom

    def x(volume: float) -> float:
        return left + plot_w * volume / x_max

    def y(cost: float) -> float:
        return TOP + plot_h * (1 - cost / y_max)

    parts = [
        f'<svg class="chart break-even-chart" viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="Monthly cost of the API and of self-hosting, by tokens a month">'
    ]
    parts += quarter_grid(x1=left, x2=WIDTH - RIGHT, plot_h=plot_h, ticks=y_ticks, tick_x=TITLE_ROOM)
    for i in range(5):
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        odd = " x-odd" if i % 2 else ""
        parts.append(f'<text class="axis x{odd}" x="{x(x_max * i / 4):.1f}" y="{height - TITLE_ROOM - 6}" '
                     f'text-anchor="{anchor}">{_compact(x_max * i / 4)}</text>')  # fmt: skip
    middle = TOP + plot_h / 2
    parts.append(f'<text class="axis axis-title" x="0" y="0" text-anchor="middle" '
                 f'transform="translate(24 {middle:.1f}) rotate(-90)">$ a month</text>')  # fmt: skip
    parts.append(f'<text class="axis axis-title" x="{left + plot_w / 2:.1f}" y="{height - 6}" '
                 f'text-anchor="middle">Tokens a month</text>')  # fmt: skip
    slot = plot_w / max(1, len(points) - 1)
    for volume, api_cost, own_cost in zip(volumes, api, self_host, strict=True):
        title = f"{volume:,.0f} tokens a month: API {money_text(api_cost)}, self-hosted {money_text(own_cost)}"
        parts.append(f'<g class="bucket"><title>{escape(title)}</title><rect x="{x(volume) - slot / 2:.1f}" '
                     f'y="{TOP}" width="{slot:.1f}" height="{plot_h:.1f}" fill="transparent"/></g>')  # fmt: skip
    for label, costs, tone in (("API", api, "tone-2"), ("Self-hosted", self_host, "tone-1")):
        path = _svg_path([(x(volume), y(cost)) for volume, cost in zip(volumes, costs, strict=True)])
        parts.append(f'<path class="series-line {tone}" d="{path}" data-series="{label}"/>')
    if break_even is not None:
        marker = x(float(break_even))
        parts.append(f'<line class="break-even" x1="{marker:.1f}" y1="{TOP}" x2="{marker:.1f}" y2="{TOP + plot_h:.1f}"/>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every interpolated value is a number, a fixed word or escaped
