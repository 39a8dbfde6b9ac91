"""Staff API over the fleet's economics (fleet.economics): cost per token, utilisation, break-even, capacity."""

from datetime import UTC, datetime, time, timedelta
from decimal import Decimal

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from fleet.economics import (
    SECONDS_PER_MONTH,
    FleetEconomics,
    break_even_points,
    break_even_volume,
    engines_needed,
    fleet_economics,
)
from quilt.fields import DecimalString
from quilt.query import DayField, QueryInput
from tenancy.api_base import StaffAPIView

MAX_DAYS = 366


class WindowInput(QueryInput):
    start = DayField(required=False, help_text="First UTC day, YYYY-MM-DD (default: 30 days before end).")
    end = DayField(required=False, help_text="Last UTC day, included, YYYY-MM-DD (default: today).")

    def validate(self, attrs):
        attrs.setdefault("end", timezone.now().date())
        attrs.setdefault("start", attrs["end"] - timedelta(days=29))
        if attrs["start"] > attrs["end"]:
            raise serializers.ValidationError("start must not be after end.", code="invalid_range")
        if attrs["end"] - attrs["start"] > timedelta(days=MAX_DAYS):
            raise serializers.ValidationError(f"At most {MAX_DAYS} days at a time.", code="invalid_range")
        return attrs


class BreakEvenInput(WindowInput):
    api_price_per_mtok = DecimalString(
        max_digits=12, decimal_places=6, min_value=Decimal(0),
        help_text="The API's price per million tokens (USD) to compare with.")  # fmt: skip


class CapacityInput(WindowInput):
    target_rps = serializers.FloatField(min_value=0, max_value=10_000_000, help_text="Requests per second to serve.")
    target_ttft_ms = serializers.FloatField(min_value=0.001, max_value=3_600_000,
                                            help_text="Mean time to first token to keep (ms).")


class TokenCostOutput(serializers.Serializer):
    name = serializers.CharField(help_text="The base model, or the adapter as tenant/name@version.")
    requests = serializers.IntegerField()
    input_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    output_tokens = serializers.IntegerField()
    gpu_seconds = serializers.CharField(help_text="Attributed GPU seconds (a decimal).")
    cost = serializers.CharField(help_text="USD (a decimal).")
    cost_per_million_input = serializers.CharField(allow_null=True, help_text="USD; null with no input tokens.")
    cost_per_million_output = serializers.CharField(allow_null=True, help_text="USD; null with no computed tokens.")


class EngineUseOutput(serializers.Serializer):
    name = serializers.CharField()
    pool = serializers.CharField()
    gpu_price_per_hour = serializers.CharField()
    up_seconds = serializers.CharField()
    busy_seconds = serializers.CharField()
    utilisation = serializers.CharField(help_text="Busy ÷ up, 0 to 1 (0 for an engine without traffic).")
    requests = serializers.IntegerField()
    uptime_cost = serializers.CharField(help_text="USD for the time it was up, busy or not.")


class EconomicsOutput(serializers.Serializer):
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    base_models = TokenCostOutput(many=True)
    adapters = TokenCostOutput(many=True)
    engines = EngineUseOutput(many=True)
    utilisation = serializers.CharField()
    tokens_per_busy_second = serializers.CharField()
    requests_per_busy_second = serializers.CharField()
    idle_ttft_ms = serializers.FloatField(allow_null=True)
    attributed_cost = serializers.CharField()
    uptime_cost = serializers.CharField()


class BreakEvenPointOutput(serializers.Serializer):
    tokens_per_month = serializers.CharField()
    self_host = serializers.CharField(help_text="USD a month on whole engines.")
    api = serializers.CharField(help_text="USD a month at the API's price.")


class BreakEvenOutput(serializers.Serializer):
    api_price_per_mtok = serializers.CharField()
    engine_price_per_hour = serializers.CharField()
    utilisation = serializers.CharField()
    tokens_per_engine_month = serializers.CharField()
    break_even_tokens_per_month = serializers.CharField(
        allow_null=True, help_text="Null when self-hosting never costs less (a free API included).")
    points = BreakEvenPointOutput(many=True)


class CapacityOutput(serializers.Serializer):
    target_rps = serializers.FloatField()
    target_ttft_ms = serializers.FloatField()
    requests_per_busy_second = serializers.CharField()
    idle_ttft_ms = serializers.FloatField(allow_null=True)
    engines_needed = serializers.IntegerField(allow_null=True, help_text="Null when no number of engines gets there.")


def window(params: dict) -> tuple[datetime, datetime]:
    """[start 00:00, end + 1 day 00:00) in UTC, cut at now: an engine is not up in the future."""
    since = datetime.combine(params["start"], time.min, tzinfo=UTC)
    until = min(datetime.combine(params["end"] + timedelta(days=1), time.min, tzinfo=UTC), timezone.now())
    return since, max(since, until)


def _money(value: Decimal | None) -> str | None:
    return None if value is None else str(value.quantize(Decimal("0.000001")))


def economics_body(fleet: FleetEconomics) -> dict:
    def costs(rows):
        return [{"name": r.key, "requests": r.requests, "input_tokens": r.input_tokens, "cached_tokens": r.cached_tokens,
                 "output_tokens": r.output_tokens, "gpu_seconds": str(r.gpu_seconds), "cost": _money(r.cost),
                 "cost_per_million_input": _money(r.per_million_input),
                 "cost_per_million_output": _money(r.per_million_output)} for r in rows]  # fmt: skip

    return {
        "since": fleet.since.isoformat(), "until": fleet.until.isoformat(),
        "base_models": costs(fleet.base_models), "adapters": costs(fleet.adapters),
        "engines": [{"name": e.name, "pool": e.pool, "gpu_price_per_hour": str(e.gpu_price_per_hour),
                     "up_seconds": str(round(e.up_seconds, 3)), "busy_seconds": str(round(e.busy_seconds, 3)),
                     "utilisation": str(round(e.utilisation, 6)), "requests": e.requests,
                     "uptime_cost": _money(e.uptime_cost)} for e in fleet.engines],
        "utilisation": str(round(fleet.utilisation, 6)),
        "tokens_per_busy_second": str(round(fleet.tokens_per_busy_second, 3)),
        "requests_per_busy_second": str(round(fleet.requests_per_busy_second, 6)),
        "idle_ttft_ms": fleet.idle_ttft_ms,
        "attributed_cost": _money(fleet.attributed_cost), "uptime_cost": _money(fleet.uptime_cost),
    }  # fmt: skip


def break_even_body(fleet: FleetEconomics, api_price_per_mtok: Decimal) -> dict:
    price = fleet.mean_price_per_hour
    tokens_per_engine_month = fleet.tokens_per_busy_second * fleet.utilisation * SECONDS_PER_MONTH
    volume = break_even_volume(engine_price_per_hour=price, tokens_per_busy_second=fleet.tokens_per_busy_second,
                               utilisation=fleet.utilisation, api_price_per_mtok=api_price_per_mtok)
    up_to = 2 * (volume if volume is not None else tokens_per_engine_month or Decimal(1_000_000_000))
    points = break_even_points(engine_price_per_hour=price, tokens_per_engine_month=tokens_per_engine_month,
                               api_price_per_mtok=api_price_per_mtok, up_to=up_to)
    return {
        "api_price_per_mtok": str(api_price_per_mtok), "engine_price_per_hour": str(price),
        "utilisation": str(round(fleet.utilisation, 6)),
        "tokens_per_engine_month": str(round(tokens_per_engine_month)),
        "break_even_tokens_per_month": None if volume is None else str(round(volume)),
        "points": [{"tokens_per_month": str(round(p["volume"])), "self_host": _money(p["self_host"]),
                    "api": _money(p["api"])} for p in points],
    }  # fmt: skip


def capacity_body(fleet: FleetEconomics, target_rps: float, target_ttft_ms: float) -> dict:
    needed = engines_needed(target_rps=target_rps, target_ttft_ms=target_ttft_ms,
                            requests_per_busy_second=float(fleet.requests_per_busy_second),
                            idle_ttft_ms=fleet.idle_ttft_ms or 0.0)  # fmt: skip
    return {"target_rps": target_rps, "target_ttft_ms": target_ttft_ms,
            "requests_per_busy_second": str(round(fleet.requests_per_busy_second, 6)),
            "idle_ttft_ms": fleet.idle_ttft_ms, "engines_needed": needed}  # fmt: skip


class FleetEconomicsApi(StaffAPIView):
    @extend_schema(parameters=[WindowInput], responses={200: EconomicsOutput})
    def get(self, request):
        query = WindowInput(data=request.query_params)
        query.is_valid(raise_exception=True)
        since, until = window(query.validated_data)
        return Response(economics_body(fleet_economics(since=since, until=until)))


class BreakEvenApi(StaffAPIView):
    @extend_schema(parameters=[BreakEvenInput], responses={200: BreakEvenOutput})
    def get(self, request):
        query = BreakEvenInput(data=request.query_params)
        query.is_valid(raise_exception=True)
        since, until = window(query.validated_data)
        fleet = fleet_economics(since=since, until=until)
        return Response(break_even_body(fleet, query.validated_data["api_price_per_mtok"]))


class CapacityApi(StaffAPIView):
    @extend_schema(parameters=[CapacityInput], responses={200: CapacityOutput})
    def get(self, request):
        query = CapacityInput(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        since, until = window(params)
        fleet = fleet_economics(since=since, until=until)
        return Response(capacity_body(fleet, params["target_rps"], params["target_ttft_ms"]))
