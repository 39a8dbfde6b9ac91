"""Cost per token, utilisation, break-even and capacity against hand-computed cases: an engine with no traffic
(utilisation 0, no division by zero), a price of 0, and the staff API and console page over the same figures."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.test import Client

from fleet.economics import (
    break_even_volume,
    cost_per_million,
    engines_needed,
    fleet_economics,
    self_host_monthly_cost,
    utilisation,
)
from gateway.models import Engine
from metering.models import UsageEvent
from registry.models import Adapter, AdapterVersion, BaseModel
from tests.engine_states import engine_state_json
from tests.platform.factories import TenantFactory, UserFactory

UNTIL = datetime(2026, 11, 20, 12, 0, tzinfo=UTC)
BASE = "econ-base"  # not the gateway stack's "tiny", whose rows live as long as the package's tests
SINCE = UNTIL - timedelta(hours=10)


def test_cost_per_million_splits_by_computed_tokens():
    # $3.60 over 1,300 uncached input + 800 output = 2,100 computed tokens
    per_input, per_output = cost_per_million(cost=Decimal("3.6"), input_tokens=1500, cached_tokens=200,
                                             output_tokens=800)
    assert per_output == Decimal("3.6") / 2100 * 1_000_000  # 1714.2857...
    assert per_input == per_output * 1300 / 1500  # cached prompt tokens computed nothing: 1485.714...
    assert isinstance(per_input, Decimal) and isinstance(per_output, Decimal)
    assert cost_per_million(cost=Decimal(0), input_tokens=0, cached_tokens=0, output_tokens=0) == (None, None)
    assert cost_per_million(cost=Decimal(1), input_tokens=0, cached_tokens=0, output_tokens=10)[0] is None


def test_utilisation_without_traffic_or_uptime_is_zero():
    assert utilisation(busy_seconds=Decimal(0), up_seconds=Decimal(36000)) == 0
    assert utilisation(busy_seconds=Decimal(0), up_seconds=Decimal(0)) == 0
    assert utilisation(busy_seconds=Decimal(3600), up_seconds=Decimal(36000)) == Decimal("0.1")


def test_break_even_by_hand():
    # $2/h × 730 h = $1,460 a month; one engine at 1,000 tokens per busy second and 50% utilisation serves
    # 1,000 × 0.5 × 2,628,000 s = 1.314e9 tokens a month
    assert break_even_volume(engine_price_per_hour=Decimal(2), tokens_per_busy_second=Decimal(1000),
                             utilisation=Decimal("0.5"), api_price_per_mtok=Decimal(2)) == Decimal(730_000_000)
    # at $1 per 1M the break-even (1.46e9) is past what one engine serves: the API is always cheaper
    assert break_even_volume(engine_price_per_hour=Decimal(2), tokens_per_busy_second=Decimal(1000),
                             utilisation=Decimal("0.5"), api_price_per_mtok=Decimal(1)) is None
    for price, throughput, use in ((Decimal(0), Decimal(1000), Decimal("0.5")), (Decimal(2), Decimal(0), Decimal(1)),
                                   (Decimal(2), Decimal(1000), Decimal(0))):
        assert break_even_volume(engine_price_per_hour=Decimal(2), tokens_per_busy_second=throughput,
                                 utilisation=use, api_price_per_mtok=price) is None
    assert self_host_monthly_cost(volume=Decimal(0), engine_price_per_hour=Decimal(2),
                                  tokens_per_engine_month=Decimal(100)) == Decimal(1460)  # one engine at least
    assert self_host_monthly_cost(volume=Decimal(250), engine_price_per_hour=Decimal(2),
                                  tokens_per_engine_month=Decimal(100)) == Decimal(4380)  # three


def test_engines_needed_by_hand():
    # 10 requests per busy second, 10 ms TTFT idle, 50 ms wanted: rho = 0.8, 100 / 8 = 12.5 -> 13 engines
    assert engines_needed(target_rps=100, target_ttft_ms=50, requests_per_busy_second=10, idle_ttft_ms=10) == 13
    assert engines_needed(target_rps=80, target_ttft_ms=50, requests_per_busy_second=10, idle_ttft_ms=10) == 10
    assert engines_needed(target_rps=100, target_ttft_ms=10, requests_per_busy_second=10, idle_ttft_ms=10) is None
    assert engines_needed(target_rps=100, target_ttft_ms=50, requests_per_busy_second=0, idle_ttft_ms=10) is None
    assert engines_needed(target_rps=0, target_ttft_ms=50, requests_per_busy_second=10, idle_ttft_ms=10) == 0


def _event(tenant, request_id: str, *, engine: str, prompt: int, cached: int, completion: int, gpu_ms: int,
           price_per_hour: Decimal, ttft_ms: float, version=None) -> UsageEvent:
    return UsageEvent.objects.create(
        request_id=request_id, tenant=tenant, model=BASE, base_model=BASE, adapter_version=version,
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion, gpu_ms=Decimal(gpu_ms),
        engine=engine, price_input_per_mtok=Decimal(0), price_cached_input_per_mtok=Decimal(0),
        price_output_per_mtok=Decimal(0), price=Decimal(0), gpu_price_per_hour=price_per_hour,
        cost=Decimal(gpu_ms) * price_per_hour / 3_600_000, ttft_ms=ttft_ms, finished_at=UNTIL - timedelta(hours=1),
    )  # fmt: skip


@pytest.fixture
def fleet_usage(db):
    tenant = TenantFactory(slug="econ")
    base = BaseModel.objects.create(name=BASE, checkpoint_dir="/nowhere", architecture="llama", config={},
                                    max_context=256)
    adapter = Adapter.objects.create(tenant=tenant, name="support", base_model=base)
    version = AdapterVersion.objects.create(adapter=adapter, number=1, digest="d" * 64)
    busy = Engine.objects.create(name="gpu-a", url="http://10.0.0.1:8100", gpu_price_per_hour=Decimal("3.6"))
    idle = Engine.objects.create(name="gpu-idle", url="http://10.0.0.2:8100", gpu_price_per_hour=Decimal(2))
    Engine.objects.filter(pk__in=[busy.pk, idle.pk]).update(created_at=SINCE - timedelta(days=1))
    # half an hour of GPU time each at $3.60/h: $1.80 each
    _event(tenant, "r1", engine="gpu-a", prompt=1000, cached=200, completion=300, gpu_ms=1_800_000,
           price_per_hour=Decimal("3.6"), ttft_ms=20.0)
    _event(tenant, "r2", engine="gpu-a", prompt=500, cached=0, completion=500, gpu_ms=1_800_000,
           price_per_hour=Decimal("3.6"), ttft_ms=40.0, version=version)
    return tenant


def test_fleet_economics_by_hand(fleet_usage):
    fleet = fleet_economics(since=SINCE, until=UNTIL)
    [tiny] = fleet.base_models
    assert (tiny.key, tiny.requests, tiny.cost) == (BASE, 2, Decimal("3.6"))
    assert tiny.per_million_output == Decimal("3.6") / 2100 * 1_000_000
    assert tiny.per_million_input == Decimal("3.6") / 2100 * 1300 / 1500 * 1_000_000
    [support] = fleet.adapters
    assert support.key == "econ/support@1"
    assert support.per_million_input == support.per_million_output == Decimal(1800)
    engines = {e.name: e for e in fleet.engines}
    assert engines["gpu-a"].utilisation == Decimal("0.1")  # 3,600 busy seconds in 36,000 up
    assert engines["gpu-idle"].utilisation == 0 and engines["gpu-idle"].requests == 0
    assert engines["gpu-idle"].uptime_cost == Decimal(20)  # 10 h × $2
    assert fleet.utilisation == Decimal("0.05")
    assert fleet.tokens_per_busy_second == Decimal(2100) / 3600
    assert fleet.requests_per_busy_second == Decimal(2) / 3600
    assert fleet.mean_price_per_hour == Decimal("2.8")
    empty = fleet_economics(since=SINCE - timedelta(days=30), until=SINCE - timedelta(days=29))
    assert empty.base_models == [] and empty.utilisation == 0 and empty.tokens_per_busy_second == 0
    assert empty.idle_ttft_ms is None


def test_a_disaggregated_requests_prefill_time_is_its_prefill_engines_busy_time(fleet_usage):
    """gpu_ms is the whole request's (the tenant's cost); the engines' utilisation splits it where it ran."""
    Engine.objects.filter(name="gpu-idle").update(name="gpu-prefill")
    row = _event(fleet_usage, "r3", engine="gpu-a", prompt=2000, cached=0, completion=10, gpu_ms=1_800_000,
                 price_per_hour=Decimal("3.6"), ttft_ms=30.0)
    UsageEvent.objects.filter(pk=row.pk).update(prefill_engine="gpu-prefill", prefill_gpu_ms=Decimal(720_000))
    engines = {e.name: e for e in fleet_economics(since=SINCE, until=UNTIL).engines}
    assert engines["gpu-a"].busy_seconds == Decimal(3600 + 1080)
    assert engines["gpu-prefill"].busy_seconds == Decimal(720)
    assert engines["gpu-a"].requests == 3 and engines["gpu-prefill"].requests == 0


def test_api_and_console(fleet_usage):
    staff = UserFactory(username="ops-econ", is_staff=True)
    web = Client()
    web.force_login(staff)
    body = web.get("/api/v1/fleet/economics", {"start": "2026-11-20", "end": "2026-11-20"}).json()
    assert body["base_models"][0]["cost_per_million_output"] == str((Decimal("3.6") / 2100 * 1_000_000).quantize(
        Decimal("0.000001")))  # fmt: skip
    assert {e["name"]: e["utilisation"] for e in body["engines"]}["gpu-idle"] == "0.000000"
    free = web.get("/api/v1/fleet/break-even", {"api_price_per_mtok": "0", "start": "2026-11-20", "end": "2026-11-20"})
    assert free.status_code == 200 and free.json()["break_even_tokens_per_month"] is None
    assert web.get("/api/v1/fleet/break-even", {"api_price_per_mtok": "-1"}).status_code == 400
    assert web.get("/api/v1/fleet/break-even", {"price": "1"}).status_code == 400  # unknown parameter
    capacity = web.get("/api/v1/fleet/capacity", {"target_rps": "1", "target_ttft_ms": "1000",
                                                  "start": "2026-11-20", "end": "2026-11-20"}).json()
    # 2 requests in 3,600 busy seconds; idle TTFT 20 ms (p10 of 20, 40); rho = 0.98: ⌈1 / (2/3600 × 0.98)⌉ = 1837
    assert capacity["engines_needed"] == 1837
    outsider = Client()
    outsider.force_login(UserFactory(username="not-staff"))
    assert outsider.get("/api/v1/fleet/economics").status_code == 403
    page = web.get("/platform/economics/", {"api_price": "0"})
    assert page.status_code == 200
    html = page.content.decode()
    assert "gpu-idle" in html and "never costs less" in html and "<svg" in html
    assert outsider.get("/platform/economics/").status_code == 403
    assert "not a number" in web.get("/platform/economics/", {"target_rps": "lots"}).content.decode()


def test_an_engine_is_up_only_during_its_lives_not_between_them(db, settings):
    """An engine that is killed and rejoins under the same name was counted up from its first join to its last
    heartbeat's expiry, the gap included (137 s counted for 90 s alive). Its uptime is the sum of its lives: from
    each join to its last heartbeat (or now, while it beats)."""
    from freezegun import freeze_time

    settings.QUILT_ENGINE_TOKEN = "economics-heartbeat-token"
    t0 = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)

    def beat(at: float) -> None:
        clock.move_to(t0 + timedelta(seconds=at))
        answer = Client().post("/internal/engines/heartbeat", {
            "name": "gpu-lives", "url": "http://10.0.0.8:8100", "gpu_price_per_hour": "3.6", "interval_s": 2.0,
            "state": engine_state_json()}, content_type="application/json",
            HTTP_AUTHORIZATION="Bearer economics-heartbeat-token")  # fmt: skip
        assert answer.status_code == 200, answer.content

    with freeze_time(t0) as clock:  # one freezer, moved (each freeze_time scans every loaded module: seconds)
        for at in range(0, 41, 2):  # alive 40 s, then SIGKILLed: it says nothing more
            beat(at)
        for at in range(130, 181, 2):  # back under the same name 90 s later, alive 50 s so far
            beat(at)
        # at its last heartbeat so far: up now
        engines = {e.name: e for e in fleet_economics(since=t0 - timedelta(minutes=5),
                                                      until=t0 + timedelta(minutes=10)).engines}
        assert engines["gpu-lives"].up_seconds == Decimal(90)
        assert engines["gpu-lives"].uptime_cost == Decimal("0.09")  # 90 s at $3.60/h
        later = {e.name: e for e in fleet_economics(since=t0 + timedelta(seconds=20),
                                                    until=t0 + timedelta(seconds=150)).engines}
        assert later["gpu-lives"].up_seconds == Decimal(20 + 20)  # the window cuts each life
