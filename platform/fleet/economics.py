"""What serving costs, from measured figures: cost per million tokens per base model and per adapter, each engine's
utilisation, the monthly volume above which self-hosting beats an API's price, and the engines a target load needs.

Every figure comes from the usage events (attributed GPU time, tokens, TTFT) and the engines' $/h; money is Decimal.

    cost per token        a request's cost is its attributed GPU time × its engine's $/h (metering), shared over the
                          tokens it computed: uncached input and output tokens alike (the engine attributes each
                          step's time by its share of the step's tokens); a cached input token computes nothing
    cost per 1M output    cost ÷ computed tokens × 1M
    cost per 1M input     the same × uncached ÷ all input tokens: cached prompt tokens make input cheaper
    utilisation           busy (attributed) GPU seconds ÷ the seconds the engine was up in the window: a
                          self-registered engine's lives only (join to last heartbeat), never the gaps between them
    break-even            engine-month cost ÷ API price per token: above that monthly volume one engine costs less
                          than the API, if one engine can serve it at the measured utilisation (else: never)
    capacity              engines = ⌈target req/s ÷ (req/s one engine serves per busy second × ρ)⌉ with
                          ρ = 1 − idle TTFT ÷ target TTFT (queueing delay grows as 1 ÷ (1 − ρ), M/M/1)
"""

import math
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Q, Sum
from django.utils import timezone

from gateway.models import Engine, EngineLife
from metering.models import UsageEvent

MILLION = Decimal(1_000_000)
HOURS_PER_MONTH = Decimal(730)  # 365 × 24 ÷ 12
SECONDS_PER_MONTH = HOURS_PER_MONTH * 3600
MS_PER_SECOND = Decimal(1000)


@dataclass(frozen=True)
class TokenCost:
    """Cost per million tokens of one base model or adapter (None: no tokens computed)."""

    key: str
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    gpu_seconds: Decimal
    cost: Decimal
    per_million_input: Decimal | None
    per_million_output: Decimal | None


def cost_per_million(*, cost: Decimal, input_tokens: int, cached_tokens: int,
                     output_tokens: int) -> tuple[Decimal | None, Decimal | None]:
    """(per 1M input, per 1M output) tokens for `cost` spent on these tokens."""
    computed = input_tokens - cached_tokens + output_tokens
    if computed <= 0:
        return None, None
    per_token = cost / computed
    per_input = per_token * (input_tokens - cached_tokens) / input_tokens * MILLION if input_tokens else None
    return per_input, per_token * MILLION


def utilisation(*, busy_seconds: Decimal, up_seconds: Decimal) -> Decimal:
    """Busy share of the time up, 0..1; 0 for an engine that was not up (or had nothing to do)."""
    if up_seconds <= 0:
        return Decimal(0)
    return min(Decimal(1), busy_seconds / up_seconds)


def break_even_volume(*, engine_price_per_hour: Decimal, tokens_per_busy_second: Decimal, utilisation: Decimal,
                      api_price_per_mtok: Decimal) -> Decimal | None:
    """Monthly tokens above which one engine (at this utilisation) costs less than the API; None if never (a free
    API, no measured throughput or utilisation, or an API cheaper than the engine even when it is full)."""
    if api_price_per_mtok <= 0 or tokens_per_busy_second <= 0 or utilisation <= 0:
        return None
    month_cost = engine_price_per_hour * HOURS_PER_MONTH
    volume = month_cost * MILLION / api_price_per_mtok
    capacity = tokens_per_busy_second * utilisation * SECONDS_PER_MONTH
    return volume if volume <= capacity else None


def self_host_monthly_cost(*, volume: Decimal, engine_price_per_hour: Decimal, tokens_per_engine_month: Decimal) -> Decimal:
    """What serving `volume` tokens a month costs on whole engines (at least one)."""
    engines = max(1, math.ceil(volume / tokens_per_engine_month)) if tokens_per_engine_month > 0 else 1
    return engines * engine_price_per_hour * HOURS_PER_MONTH


def engines_needed(*, target_rps: float, target_ttft_ms: float, requests_per_busy_second: float,
                   idle_ttft_ms: float) -> int | None:
    """Engines for `target_rps` at a mean TTFT of `target_ttft_ms`; None if no number of engines gets there."""
    if requests_per_busy_second <= 0 or idle_ttft_ms <= 0 or target_ttft_ms <= idle_ttft_ms:
        return None
    if target_rps <= 0:
        return 0
    rho = 1.0 - idle_ttft_ms / target_ttft_ms
    return math.ceil(target_rps / (requests_per_busy_second * rho) - 1e-9)


def break_even_points(*, engine_price_per_hour: Decimal, tokens_per_engine_month: Decimal,
                      api_price_per_mtok: Decimal, up_to: Decimal, points: int = 24) -> list[dict]:
    """[{volume, self_host, api}] monthly costs from 0 to `up_to` tokens a month: the break-even chart's lines."""
    rows = []
    for k in range(points + 1):
        volume = up_to * k / points
        rows.append({"volume": volume, "api": volume * api_price_per_mtok / MILLION,
                     "self_host": self_host_monthly_cost(volume=volume, engine_price_per_hour=engine_price_per_hour,
                                                         tokens_per_engine_month=tokens_per_engine_month)})  # fmt: skip
    return rows


# reads
@dataclass(frozen=True)
class EngineUse:
    name: str
    pool: str
    gpu_price_per_hour: Decimal
    up_seconds: Decimal
    busy_seconds: Decimal
    utilisation: Decimal
    requests: int
    uptime_cost: Decimal  # what having it up cost, busy or not


@dataclass(frozen=True)
class FleetEconomics:
    since: datetime
    until: datetime
    base_models: list[TokenCost]
    adapters: list[TokenCost]
    engines: list[EngineUse]
    utilisation: Decimal  # busy ÷ up, over the fleet
    tokens_per_busy_second: Decimal  # computed tokens per attributed GPU second
    requests_per_busy_second: Decimal
    idle_ttft_ms: float | None  # TTFT p10 of the window's requests: an engine's answer time with no queue
    mean_price_per_hour: Decimal
    attributed_cost: Decimal
    uptime_cost: Decimal


def _overlap(start: datetime, end: datetime, since: datetime, until: datetime) -> Decimal:
    """Seconds of [start, end] inside [since, until)."""
    return max(Decimal(0), Decimal((min(end, until) - max(start, since)).total_seconds()))


def engine_lives(*, since: datetime, until: datetime) -> dict[int, list[tuple[datetime, datetime]]]:
    """Self-registered engines' lives that may touch [since, until), by engine id: (joined, last heartbeat), the
    last heartbeat being now for the life of an engine up now. The gaps between lives are no uptime."""
    now = timezone.now()
    up_now = set(Engine.objects.up().filter(self_registered=True).values_list("pk", flat=True))
    latest = {}
    found: dict[int, list[list[datetime]]] = {}
    rows = (EngineLife.objects.filter(started_at__lt=until)
            .filter(Q(last_heartbeat_at__gte=since) | Q(engine_id__in=up_now))
            .order_by("engine_id", "started_at").values_list("engine_id", "started_at", "last_heartbeat_at"))
    for engine_id, started_at, last_heartbeat_at in rows:
        found.setdefault(engine_id, []).append([started_at, last_heartbeat_at])
        latest[engine_id] = found[engine_id][-1]
    for engine_id in up_now & latest.keys():
        latest[engine_id][1] = max(latest[engine_id][1], now)
    return {engine_id: [(start, end) for start, end in spans] for engine_id, spans in found.items()}


_SUMS = dict(requests=Count("id"), input_tokens=Sum("prompt_tokens"), cached_tokens=Sum("cached_tokens"),
             output_tokens=Sum("completion_tokens"), gpu_ms=Sum("gpu_ms"), cost=Sum("cost"))  # fmt: skip


def _token_cost(key: str, row: dict) -> TokenCost:
    cost = row["cost"] or Decimal(0)
    inputs, cached, outputs = row["input_tokens"] or 0, row["cached_tokens"] or 0, row["output_tokens"] or 0
    per_input, per_output = cost_per_million(cost=cost, input_tokens=inputs, cached_tokens=cached,
                                             output_tokens=outputs)
    return TokenCost(key=key, requests=row["requests"], input_tokens=inputs, cached_tokens=cached,
                     output_tokens=outputs, gpu_seconds=(row["gpu_ms"] or Decimal(0)) / MS_PER_SECOND, cost=cost,
                     per_million_input=per_input, per_million_output=per_output)  # fmt: skip


def fleet_economics(*, since: datetime, until: datetime) -> FleetEconomics:
    """Costs, utilisation and throughput of the requests that finished in [since, until)."""
    events = UsageEvent.objects.filter(finished_at__gte=since, finished_at__lt=until)
    base_models = [_token_cost(row["base_model"], row)
                   for row in events.values("base_model").annotate(**_SUMS).order_by("base_model")]  # fmt: skip
    adapter_rows = (events.filter(adapter_version__isnull=False)
                    .values("adapter_version__adapter__tenant__slug", "adapter_version__adapter__name",
                            "adapter_version__number").annotate(**_SUMS).order_by("-cost", "adapter_version__number"))
    adapters = [_token_cost(f"{r['adapter_version__adapter__tenant__slug']}/{r['adapter_version__adapter__name']}"
                            f"@{r['adapter_version__number']}", r) for r in adapter_rows]  # fmt: skip
    busy = {row["engine"]: row for row in events.values("engine").annotate(
        requests=Count("id"), gpu_ms=Sum("gpu_ms") - Sum("prefill_gpu_ms"))}  # the prefill hop's part: its engine's
    prefilled = dict(events.exclude(prefill_engine="").values_list("prefill_engine").annotate(Sum("prefill_gpu_ms")))
    engines = []
    lives = engine_lives(since=since, until=until)
    for engine in Engine.objects.order_by("name"):
        if engine.self_registered:
            up = sum((_overlap(start, end, since, until) for start, end in lives.get(engine.pk, [])), Decimal(0))
        else:  # a static engine is up from its registration (its health check keeps no history)
            up = _overlap(engine.created_at, until, since, until)
        row = busy.get(engine.name, {})
        busy_seconds = ((row.get("gpu_ms") or Decimal(0)) + (prefilled.get(engine.name) or Decimal(0))) / MS_PER_SECOND
        engines.append(EngineUse(
            name=engine.name, pool=engine.pool, gpu_price_per_hour=engine.gpu_price_per_hour, up_seconds=up,
            busy_seconds=busy_seconds, utilisation=utilisation(busy_seconds=busy_seconds, up_seconds=up),
            requests=row.get("requests") or 0, uptime_cost=engine.gpu_price_per_hour * up / 3600,
        ))  # fmt: skip
    totals = events.aggregate(**_SUMS)
    gpu_seconds = (totals["gpu_ms"] or Decimal(0)) / MS_PER_SECOND
    computed = (totals["input_tokens"] or 0) - (totals["cached_tokens"] or 0) + (totals["output_tokens"] or 0)
    up_total = sum((e.up_seconds for e in engines), Decimal(0))
    busy_total = sum((e.busy_seconds for e in engines), Decimal(0))
    ttfts = sorted(events.filter(ttft_ms__isnull=False).values_list("ttft_ms", flat=True))
    priced = [e.gpu_price_per_hour for e in engines if e.up_seconds > 0] or [e.gpu_price_per_hour for e in engines]
    return FleetEconomics(
        since=since, until=until, base_models=base_models, adapters=adapters, engines=engines,
        utilisation=utilisation(busy_seconds=busy_total, up_seconds=up_total),
        tokens_per_busy_second=Decimal(computed) / gpu_seconds if gpu_seconds else Decimal(0),
        requests_per_busy_second=Decimal(totals["requests"]) / gpu_seconds if gpu_seconds else Decimal(0),
        idle_ttft_ms=ttfts[len(ttfts) // 10] if ttfts else None,
        mean_price_per_hour=sum(priced, Decimal(0)) / len(priced) if priced else Decimal(0),
        attributed_cost=totals["cost"] or Decimal(0), uptime_cost=sum((e.uptime_cost for e in engines), Decimal(0)),
    )  # fmt: skip
