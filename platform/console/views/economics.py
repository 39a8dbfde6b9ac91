"""Staff page of the fleet's economics: cost per million tokens per base model and adapter, each engine's
utilisation, the break-even volume against an API price (with its chart) and the engines a target load needs.
Figures from fleet.economics; this adds only presentation."""

from datetime import timedelta
from decimal import Decimal, InvalidOperation

from django.utils import timezone

from console.access import staff_page
from console.charts import break_even_chart
from console.pages import render_page
from fleet.api import break_even_body, capacity_body, window
from fleet.economics import fleet_economics

DEFAULT_API_PRICE = Decimal("0.60")  # USD per million tokens, a common small-model API price: edit it on the page
DEFAULT_TARGET_RPS, DEFAULT_TARGET_TTFT_MS = 100.0, 500.0


def _number(raw: str | None, default, kind, *, low):
    try:
        value = kind(raw) if raw not in (None, "") else default
    except (ValueError, InvalidOperation):
        return default, f"not a number: {raw!r}"
    if value < low or not value == value:  # also NaN
        return default, f"must be at least {low}: {raw!r}"
    return value, None


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
