"""Usage ingest writes each request exactly once, priced in Decimal from the plan, costed from the engine's price."""

import threading
from decimal import Decimal

import msgspec
import pytest
from django.db import connection
from django.utils import timezone

from engine.contract import UsageEvent as EngineUsageEvent
from gateway.admission import held_totals
from metering.models import ModelPrice, UsageEvent, UsageMonth
from metering.services import usage_ingest
from tests.metering.usage import adapter_version, gpu_engine, priced_tenant, usage_event
from tests.platform.factories import make_key


@pytest.fixture
def tenant(db):
    gpu_engine()
    return priced_tenant("acme")


def test_price_and_cost_are_exact_decimals(tenant):
    usage_ingest(events=[usage_event(tenant, request_id="r-1")])
    row = UsageEvent.objects.get(request_id="r-1")
    # 800 uncached × 0.5 + 200 cached × 0.125 + 300 out × 1.5 = 875 per million tokens
    assert row.price == Decimal("0.000875") and isinstance(row.price, Decimal)
    # 120.5 ms × 2.5 per hour / 3,600,000 ms per hour = 0.0000836805555…, to 12 places
    assert row.cost == Decimal("0.000083680556")
    assert (row.gpu_price_per_hour, row.gpu_ms) == (Decimal("2.5"), Decimal("120.5"))
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens, row.total_tokens) == (
        1000,
        200,
        300,
        1300,
    )
    assert (row.model, row.base_model, row.engine, row.finish_reason) == (
        "tiny-llama",
        "tiny-llama",
        "engine-1",
        "stop",
    )


def test_a_per_base_model_price_overrides_the_plan(tenant):
    ModelPrice.objects.create(
        plan=tenant.plan,
        base_model="tiny-llama",
        price_input_per_mtok=Decimal("3"),
        price_cached_input_per_mtok=Decimal("1"),
        price_output_per_mtok=Decimal("7"),
    )
    usage_ingest(
        events=[usage_event(tenant, request_id="r-1"), usage_event(tenant, request_id="r-2", base_model="x")]
    )
    rows = {row.request_id: row for row in UsageEvent.objects.all()}
    assert rows["r-1"].price == Decimal("0.004700")  # (800×3 + 200×1 + 300×7) / 1e6
    assert rows["r-2"].price == Decimal("0.000875")  # another base model keeps the plan's prices


def test_an_unknown_engine_leaves_the_cost_empty_not_zero(tenant):
    usage_ingest(events=[usage_event(tenant, request_id="r-1", engine="nowhere")])
    row = UsageEvent.objects.get(request_id="r-1")
    assert row.cost is None and row.gpu_price_per_hour is None and row.price == Decimal("0.000875")
    assert UsageMonth.objects.get(tenant=tenant).uncosted_requests == 1


def test_a_replayed_batch_changes_nothing(tenant):
    key, _ = make_key(tenant, scopes=["inference"])
    batch = [usage_event(tenant, api_key_id=key.prefix, completion_tokens=n) for n in range(1, 6)]
    first = usage_ingest(events=batch)
    before = list(UsageEvent.objects.order_by("request_id").values())
    month = UsageMonth.objects.get(tenant=tenant)
    replay = usage_ingest(events=batch + batch[:2])
    assert (first.inserted, first.duplicates) == (5, 0)
    assert (replay.inserted, replay.duplicates) == (0, 5)
    assert list(UsageEvent.objects.order_by("request_id").values()) == before
    again = UsageMonth.objects.get(tenant=tenant)
    assert (again.requests, again.completion_tokens, again.price) == (5, 15, month.price)
    assert again.price == sum(Decimal("0.000425") + n * Decimal("0.0000015") for n in range(1, 6))
    assert UsageEvent.objects.filter(api_key=key, api_key_prefix=key.prefix).count() == 5


def test_bad_events_are_dropped_without_blocking_their_batch(tenant):
    good = usage_event(tenant, request_id="good")
    bad = [
        {**usage_event(tenant), "prompt_tokens": -1},
        {**usage_event(tenant), "prompt_tokens": 2**40, "cached_tokens": 0},  # would overflow its column
        {**usage_event(tenant), "cached_tokens": 5000},
        {**usage_event(tenant), "gpu_ms": float("nan")},
        {**usage_event(tenant), "finished_at": "2026-13-45T00:00:00Z"},
        {**usage_event(tenant), "metadata": "model=x"},
        {**usage_event(tenant), "tenant": "no-such-tenant", "metadata": {}},
        {**usage_event(tenant), "v": 2},
        "not an event",
    ]
    result = usage_ingest(events=[good, *bad])
    assert (result.inserted, result.rejected) == (1, len(bad))
    assert list(UsageEvent.objects.values_list("request_id", flat=True)) == ["good"]


def test_a_key_of_another_tenant_is_not_attributed(tenant):
    other = priced_tenant("other")
    foreign_key, _ = make_key(other)
    usage_ingest(events=[usage_event(tenant, request_id="r-1", api_key_id=foreign_key.pk)])
    row = UsageEvent.objects.get(request_id="r-1")
    assert row.tenant == tenant and row.api_key is None


def test_the_adapter_version_is_linked_only_when_it_is_the_tenants(tenant):
    own, foreign = adapter_version(tenant), adapter_version(priced_tenant("other"))
    usage_ingest(
        events=[
            usage_event(
                tenant, request_id="own", model="support-bot", metadata={"adapter_version_id": own.pk}
            ),
            usage_event(tenant, request_id="foreign", metadata={"adapter_version_id": foreign.pk}),
            usage_event(tenant, request_id="gone", metadata={"adapter_version_id": 10**9}),
        ]
    )
    versions = dict(UsageEvent.objects.values_list("request_id", "adapter_version"))
    assert versions == {"own": own.pk, "foreign": None, "gone": None}


def test_an_event_as_the_engine_server_sends_it_without_gateway_metadata(tenant):
    version = adapter_version(tenant)
    event = EngineUsageEvent(
        request_id="bare", tenant=str(tenant.pk), api_key_id=None, adapter_digest=version.digest,
        base_model="tiny-llama", prompt_tokens=10, cached_tokens=0, completion_tokens=5, gpu_ms=1.5, queue_ms=0.1,
        ttft_ms=None, e2e_ms=9.0, finish_reason="abort", finished_at=timezone.now(),
    )  # fmt: skip
    assert usage_ingest(events=[msgspec.to_builtins(event)]).inserted == 1
    row = UsageEvent.objects.get(request_id="bare")
    assert (row.model, row.adapter_version, row.adapter_digest) == ("support-bot", version, version.digest)
    assert (row.finish_reason, row.ttft_ms, row.cost) == ("abort", None, None)  # no engine named: no cost
    assert row.price == Decimal("0.0000125")


def test_ingest_settles_the_requests_usage_with_admission_once(tenant):
    batch = [usage_event(tenant, finished_at=timezone.now()) for _ in range(3)]
    usage_ingest(events=batch)
    usage_ingest(events=batch)
    assert held_totals(tenant_id=tenant.pk).month_tokens == 3 * 1300


@pytest.mark.django_db(transaction=True)
def test_concurrent_duplicate_batches_write_each_request_once():
    gpu_engine()
    tenant = priced_tenant("busy")
    batches = [
        [usage_event(tenant, request_id=f"c-{i:03d}") for i in range(start, start + 60)] for start in (0, 30)
    ]
    barrier = threading.Barrier(4)
    results, errors = [], []

    def ingest(batch):
        try:
            barrier.wait()
            results.append(usage_ingest(events=batch))
        except Exception as error:  # reported below: a thread's failure must fail the test
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=ingest, args=(batch,)) for batch in batches + batches[::-1]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert UsageEvent.objects.count() == 90
    assert sum(result.inserted for result in results) == 90
    month = UsageMonth.objects.get(tenant=tenant)
    assert (month.requests, month.prompt_tokens) == (90, 90 * 1000)
    assert month.price == 90 * Decimal("0.000875")


def test_a_disaggregated_request_costs_both_engines_gpu_time_at_their_own_prices(tenant):
    """The gateway names the prefill hop's engine and GPU time in the metadata (the decode engine echoes it)."""
    gpu_engine("prefill-1", price="10.0000")
    prefill = {"prefill": {"engine": "prefill-1", "gpu_ms": 36.0, "cached_tokens": 200}}
    usage_ingest(events=[usage_event(tenant, request_id="r-1", metadata=prefill),
                         usage_event(tenant, request_id="r-2", metadata={"prefill": {"engine": "gone", "gpu_ms": 9}})])
    row = UsageEvent.objects.get(request_id="r-1")
    assert (row.gpu_ms, row.prefill_gpu_ms, row.prefill_engine, row.engine) == (
        Decimal("156.5"), Decimal("36"), "prefill-1", "engine-1")
    # 120.5 ms × 2.5 + 36 ms × 10, per 3,600,000 ms an hour; the price is the tokens', as if served by one engine
    assert row.cost == Decimal("0.000083680556") + Decimal("0.000100000000")
    assert row.price == Decimal("0.000875")
    unknown = UsageEvent.objects.get(request_id="r-2")  # an unknown prefill engine: its part goes uncosted, loudly
    assert unknown.cost == Decimal("0.000083680556") and unknown.prefill_gpu_ms == Decimal("9")
    month = UsageMonth.objects.get(tenant=tenant)
    assert (month.requests, month.cost) == (2, row.cost + unknown.cost)


def test_a_prefill_entry_without_an_engine_is_a_bad_event(tenant):
    result = usage_ingest(events=[usage_event(tenant, request_id="r-1", metadata={"prefill": {"gpu_ms": 5}})])
    assert result.rejected == 1 and not UsageEvent.objects.filter(request_id="r-1").exists()


def test_a_disaggregated_request_is_billed_the_prefill_engines_cached_tokens_not_the_pulled_blocks(tenant):
    """The decode engine counts the blocks it pulled as prefix hits (800 of the 1,000 prompt tokens here); they were
    computed for this request on the prefill engine, which had 64 cached: the request is billed 64 cached."""
    usage_ingest(events=[usage_event(tenant, request_id="r-1", cached_tokens=800,
                                     metadata={"prefill": {"engine": "engine-1", "gpu_ms": 1, "cached_tokens": 64}})])
    row = UsageEvent.objects.get(request_id="r-1")
    assert (row.prompt_tokens, row.cached_tokens) == (1000, 64)
    assert row.price == Decimal("0.000926")  # 936 uncached × 0.5 + 64 cached × 0.125 + 300 out × 1.5, per million
