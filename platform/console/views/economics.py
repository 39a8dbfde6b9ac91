"""Staff page of the fleet's economics: cost per million tokens per base model and adapter, each engine's
utilisation, the break-even volume against an API price (with its chart) and the engines a target load needs.
Figures from gateway.economics; this adds only presentation."""

from datetime import timedelta
from decimal import Decimal, InvalidOperation

from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from console.access import staff_page
from console.pages import render_page
from gateway.economics import fleet_economics
from gateway.economics_api import break_even_body, capacity_body, window

DEFAULT_API_PRICE = Decimal("0.60")  # USD per million tokens, a common small-model API price: edit it on the page
DEFAULT_TARGET_RPS, DEFAULT_TARGET_TTFT_MS = 100.0, 500.0
WIDTH, HEIGHT, LEFT, BOTTOM, TOP, RIGHT = 720, 240, 64, 30, 12, 16


def _number(raw: str | None, default, kind, *, low):
    try:
        value = kind(raw) if raw not in (None, "") else default
    except (ValueError, InvalidOperation):
        return default, f"not a number: {raw!r}"
    if value < low or not value == value:  # also NaN
        return default, f"must be at least {low}: {raw!r}"
    return value, None


def break_even_chart(points: list[dict], break_even: str | None) -> SafeString:
    """Monthly cost against monthly tokens: the API's line and self-hosting's steps (whole engines)."""
    volumes = [Decimal(p["tokens_per_month"]) for p in points]
    costs = [Decimal(p[k]) for p in points for k in ("api", "self_host")]
    x_max, y_max = max(volumes) or Decimal(1), max(costs) or Decimal(1)

    def x(v):
        return LEFT + float(v / x_max) * (WIDTH - LEFT - RIGHT)

    def y(v):
        return HEIGHT - BOTTOM - float(v / y_max) * (HEIGHT - BOTTOM - TOP)

    def path(key):
        return " ".join(f"{'M' if i == 0 else 'L'}{x(v):.1f},{y(Decimal(p[key])):.1f}"
                        for i, (v, p) in enumerate(zip(volumes, points, strict=True)))

    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="Break-even chart">',
             f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="currentColor" opacity=".3"/>',
             f'<path d="{path("api")}" fill="none" stroke="#d9480f" stroke-width="2"><title>API</title></path>',
             f'<path d="{path("self_host")}" fill="none" stroke="#1c7ed6" stroke-width="2"><title>Self-hosted</title></path>',
             f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end" font-size="11">${escape(f"{y_max:,.0f}")}</text>',
             f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 8}" text-anchor="end" font-size="11">{escape(f"{x_max:,.0f}")} tokens/month</text>']  # fmt: skip
    if break_even is not None:
        bx = x(Decimal(break_even))
        parts.append(f'<line x1="{bx:.1f}" y1="{TOP}" x2="{bx:.1f}" y2="{HEIGHT - BOTTOM}" stroke="currentColor" '
                     f'stroke-dasharray="4 3"><title>break-even: {escape(break_even)} tokens/month</title></line>')
    parts.append("</svg>")
    return mark_safe("".join(parts))  # every interpolated value is a number or escaped


@staff_page
def economics(request):
    now = timezone.now()
    params = {"start": (now - timedelta(days=29)).date(), "end": now.date()}
    since, until = window(params)
    fleet = fleet_economics(since=since, until=until)
    price, price_error = _number(request.GET.get("api_price"), DEFAULT_API_PRICE, Decimal, low=0)
    rps, rps_error = _number(request.GET.get("target_rps"), DEFAULT_TARGET_RPS, float, low=0)
    ttft, ttft_error = _number(request.GET.get("target_ttft_ms"), DEFAULT_TARGET_TTFT_MS, float, low=0.001)
    even = break_even_body(fleet, price)
    return render_page(request, "console/economics.html", {
        "fleet": fleet, "even": even, "capacity": capacity_body(fleet, rps, ttft),
        "chart": break_even_chart(even["points"], even["break_even_tokens_per_month"]),
        "api_price": price, "target_rps": rps, "target_ttft_ms": ttft,
        "errors": [e for e in (price_error, rps_error, ttft_error) if e],
        "utilisation_percent": round(100 * fleet.utilisation, 1),
    }, section="economics")  # fmt: skip
