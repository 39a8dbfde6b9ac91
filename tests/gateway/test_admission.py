"""Admission rules, the same for both backends: the Redis script and the database transaction."""

import uuid
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.test import override_settings

from gateway.admission import Limits, admission_acquire, admission_settle, held_totals, hold_settle
from tests.platform.factories import TenantFactory

pytestmark = pytest.mark.django_db

ROOMY = Limits(requests_per_minute=1000, tokens_per_minute=10**9, max_concurrent=1000, budget_tokens=-1,
               budget_spend_micros=-1)  # fmt: skip


def acquire(tenant, tokens=10, spend_micros=0, limits=ROOMY, request_id=None):
    request_id = request_id or uuid.uuid4().hex
    decision = async_to_sync(admission_acquire)(  # the calling thread: it sees this test's transaction
        tenant_id=tenant.pk, request_id=request_id, tokens=tokens, spend_micros=spend_micros, limits=limits
    )
    return decision, request_id


def settle(tenant, request_id, tokens, spend_micros=0, final=True):
    return async_to_sync(admission_settle)(
        tenant_id=tenant.pk, request_id=request_id, tokens=tokens, spend_micros=spend_micros, final=final
    )


def test_requests_per_minute(backend, tenant):
    limits = Limits(2, 10**9, 1000, -1, -1)
    assert acquire(tenant, limits=limits)[0].admitted
    assert acquire(tenant, limits=limits)[0].admitted
    refused, _ = acquire(tenant, limits=limits)
    assert not refused.admitted and refused.reason == "requests" and refused.window_requests == 2
    assert 0 < refused.reset_ms <= 60_000


def test_tokens_per_minute_counts_estimates_and_refunds_unused(backend, tenant):
    limits = Limits(1000, 100, 1000, -1, -1)
    first, request_id = acquire(tenant, tokens=60, limits=limits)
    assert first.admitted and first.window_tokens == 60
    assert acquire(tenant, tokens=60, limits=limits)[0].reason == "tokens"
    settle(tenant, request_id, tokens=20)  # used 20 of the 60 it held
    second, _ = acquire(tenant, tokens=60, limits=limits)
    assert second.admitted and second.window_tokens == 80


def test_concurrency_is_live_holds(backend, tenant):
    limits = Limits(1000, 10**9, 2, -1, -1)
    _, first = acquire(tenant, limits=limits)
    acquire(tenant, limits=limits)
    assert acquire(tenant, limits=limits)[0].reason == "concurrency"
    settle(tenant, first, tokens=5)
    assert acquire(tenant, limits=limits)[0].admitted


def test_budget_holds_then_refuses_when_used(backend, tenant):
    limits = Limits(1000, 10**9, 1000, 100, -1)
    _, first = acquire(tenant, tokens=60, limits=limits)
    held, _ = acquire(tenant, tokens=60, limits=limits)
    assert not held.admitted and held.reason == "budget_held"  # in-flight holds, not usage, are in the way
    settle(tenant, first, tokens=90)
    used, _ = acquire(tenant, tokens=20, limits=limits)
    assert not used.admitted and used.reason == "budget_tokens"
    assert acquire(tenant, tokens=10, limits=limits)[0].admitted


def test_spend_limit(backend, tenant):
    limits = Limits(1000, 10**9, 1000, -1, 1_000)
    assert acquire(tenant, spend_micros=600, limits=limits)[0].admitted
    assert acquire(tenant, spend_micros=600, limits=limits)[0].reason == "budget_held"


def test_a_refusal_consumes_nothing(backend, tenant):
    limits = Limits(1000, 1000, 1000, 100, -1)
    acquire(tenant, tokens=80, limits=limits)
    for _ in range(5):
        assert not acquire(tenant, tokens=50, limits=limits)[0].admitted
    totals = held_totals(tenant_id=tenant.pk)
    assert totals.live_holds == 1 and totals.held_tokens == 80
    decision, _ = acquire(tenant, tokens=20, limits=limits)
    assert decision.admitted and decision.window_requests == 2 and decision.window_tokens == 100


def test_settling_is_idempotent_and_counts_usage_once(backend, tenant):
    _, request_id = acquire(tenant, tokens=50)
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=30, spend=Decimal("0.000012")) is True
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=30, spend=Decimal("0.000012")) is False
    assert settle(tenant, request_id, tokens=30) is False
    totals = held_totals(tenant_id=tenant.pk)
    assert (totals.live_holds, totals.held_tokens, totals.month_tokens, totals.month_spend_picos) == (0, 0, 30, 12 * 10**6)


def test_usage_of_a_request_with_no_live_hold_still_counts_once(backend, tenant):
    _, request_id = acquire(tenant, tokens=50)  # starts the month's total
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=0, spend=Decimal(0)) is True
    assert hold_settle(tenant_id=tenant.pk, request_id="never-held", tokens=7, spend=Decimal(0)) is False
    assert hold_settle(tenant_id=tenant.pk, request_id="never-held", tokens=7, spend=Decimal(0)) is False
    assert held_totals(tenant_id=tenant.pk).month_tokens == 7


def test_a_settle_never_starts_the_months_total_so_metering_can_not_count_a_request_twice(backend, tenant):
    # Usage metering has recorded (and settles after recording) is already in the record the month starts from.
    assert hold_settle(tenant_id=tenant.pk, request_id="recorded", tokens=7, spend=Decimal(0)) is False
    assert held_totals(tenant_id=tenant.pk).month_tokens == 0


def test_orphaned_holds_expire(backend, tenant):
    limits = Limits(1000, 10**9, 1, -1, -1)
    with override_settings(QUILT_HOLD_TTL_SECONDS=0):
        assert acquire(tenant, limits=limits)[0].admitted  # a hold nobody settles, already past its expiry
    decision, _ = acquire(tenant, limits=limits)
    assert decision.admitted
    assert held_totals(tenant_id=tenant.pk).live_holds == 1


def test_tenants_do_not_share_limits(backend, tenant):
    other = TenantFactory()
    limits = Limits(1, 10**9, 1000, -1, -1)
    assert acquire(tenant, limits=limits)[0].admitted
    assert acquire(other, limits=limits)[0].admitted
    assert not acquire(tenant, limits=limits)[0].admitted


def test_the_month_starts_from_what_metering_recorded(backend, tenant):
    from datetime import UTC, datetime

    from metering.models import UsageMonth

    month = datetime.now(UTC).date().replace(day=1)
    UsageMonth.objects.create(tenant=tenant, month=month, prompt_tokens=60, completion_tokens=30, price=Decimal("0.5"))
    limits = Limits(1000, 10**9, 1000, 100, 600_000)
    assert acquire(tenant, tokens=20, limits=limits)[0].reason == "budget_tokens"
    assert acquire(tenant, tokens=10, spend_micros=200_000, limits=limits)[0].reason == "budget_spend"
    assert acquire(tenant, tokens=10, spend_micros=100_000, limits=limits)[0].admitted


def test_a_provisional_settle_keeps_its_amount_counted_until_the_final_one_replaces_it(backend, tenant):
    limits = Limits(1000, 10**9, 1000, 100, -1)
    _, request_id = acquire(tenant, tokens=60, limits=limits)
    # The client hung up: the gateway settles provisionally with what it held, not with what it relayed.
    assert settle(tenant, request_id, tokens=60, final=False) is True
    assert settle(tenant, request_id, tokens=3, final=False) is False  # a second provisional one changes nothing
    totals = held_totals(tenant_id=tenant.pk)
    assert (totals.live_holds, totals.month_tokens, totals.provisional_tokens) == (0, 60, 60)
    assert acquire(tenant, tokens=50, limits=limits)[0].reason == "budget_tokens"
    # The engine's event, recorded by metering: 45 tokens really served. It replaces the provisional 60.
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=45, spend=Decimal("0.000045")) is False
    totals = held_totals(tenant_id=tenant.pk)
    assert (totals.month_tokens, totals.month_spend_picos, totals.provisional_tokens) == (45, 45 * 10**6, 0)
    assert settle(tenant, request_id, tokens=1, final=False) is False  # late provisional after the final: no-op
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=45, spend=Decimal(0)) is False
    assert held_totals(tenant_id=tenant.pk).month_tokens == 45


def test_a_tenants_spend_is_exactly_the_sum_of_its_requests_prices(backend, tenant):
    """Metering's prices are exact to 1e-12 and often under a micro-dollar: the tenant's month is their sum, not each
    rounded up to a micro-dollar, through a provisional settle that the final one replaces; and a spend limit holds
    against that sum."""
    price = Decimal("0.00000058137")  # 581,370 picos
    for _ in range(6):
        _, request_id = acquire(tenant, tokens=3)
        hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=3, spend=price)
    _, broken = acquire(tenant, tokens=3)
    async_to_sync(admission_settle)(tenant_id=tenant.pk, request_id=broken, tokens=3, spend_micros=1,
                                    key_spend_picos=999_999, final=False)  # fmt: skip
    assert held_totals(tenant_id=tenant.pk).month_spend_picos == 6 * 581_370 + 999_999
    hold_settle(tenant_id=tenant.pk, request_id=broken, tokens=3, spend=price)
    totals = held_totals(tenant_id=tenant.pk)
    assert (totals.month_spend_picos, totals.provisional_spend_picos) == (7 * 581_370, 0)
    limits = Limits(1000, 10**9, 1000, -1, 5)  # $0.000005: 4.07 of it spent, 0.93 left
    assert acquire(tenant, spend_micros=1, limits=limits)[0].reason == "budget_spend"
    assert not held_totals(tenant_id=tenant.pk).live_holds


def test_the_final_settle_first_makes_a_later_provisional_one_a_no_op(backend, tenant):
    _, request_id = acquire(tenant, tokens=60)
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=20, spend=Decimal(0)) is True
    assert settle(tenant, request_id, tokens=60, final=False) is False
    totals = held_totals(tenant_id=tenant.pk)
    assert (totals.month_tokens, totals.provisional_tokens) == (20, 0)


def test_reconcile_sets_the_month_to_metering_record_plus_provisional_settles(backend, tenant):
    from datetime import UTC, datetime

    from gateway.admission import admission_reconcile
    from metering.models import UsageMonth

    assert admission_reconcile(tenant_id=tenant.pk) is None  # no total yet: the next admission starts it
    _, done = acquire(tenant, tokens=50)
    _, broken = acquire(tenant, tokens=40)
    hold_settle(tenant_id=tenant.pk, request_id=done, tokens=30, spend=Decimal("0.00003"))
    settle(tenant, broken, tokens=40, spend_micros=40, final=False)
    # Drift: metering recorded 30 tokens for `done` and 70 more that admission never saw (e.g. a flushed Redis).
    month = datetime.now(UTC).date().replace(day=1)
    UsageMonth.objects.create(tenant=tenant, month=month, prompt_tokens=60, completion_tokens=40, price=Decimal("0.0001"))
    assert held_totals(tenant_id=tenant.pk).month_tokens == 70
    result = admission_reconcile(tenant_id=tenant.pk)
    assert result.applied and (result.tokens_before, result.tokens_after) == (70, 140)
    assert (result.spend_picos_before, result.spend_picos_after) == (70 * 10**6, 140 * 10**6)
    totals = held_totals(tenant_id=tenant.pk)
    assert (totals.month_tokens, totals.provisional_tokens) == (140, 40)


def test_the_reconcile_task_corrects_budgeted_tenants_totals(backend):
    from datetime import UTC, datetime

    from gateway.tasks import reconcile_admission
    from metering.models import UsageMonth
    from tenancy.models import Plan

    budgeted = TenantFactory(plan=Plan.objects.create(slug=f"b-{uuid.uuid4().hex[:6]}", name="B",
                                                      monthly_token_budget=1000))  # fmt: skip
    acquire(budgeted, tokens=10)  # admission starts the month's total (0)
    month = datetime.now(UTC).date().replace(day=1)
    UsageMonth.objects.create(tenant=budgeted, month=month, prompt_tokens=300, completion_tokens=200,
                              price=Decimal("0.001"))  # fmt: skip
    assert reconcile_admission() == 1
    assert held_totals(tenant_id=budgeted.pk).month_tokens == 500
    assert reconcile_admission() == 0  # nothing left to correct
