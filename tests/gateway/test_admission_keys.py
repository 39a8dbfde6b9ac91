"""An API key's own limits (RPM, TPM, monthly budget) are checked in the same atomic step as its tenant's, in both
backends: a key over its budget is refused while its sibling keys still work, holds count against the key's
budget so concurrent requests can't overspend it, and settling or expiring a hold releases the key's share."""

import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from asgiref.sync import async_to_sync
from django.test import override_settings

from gateway.admission import admission_acquire, admission_peek, admission_settle, hold_settle, key_spend_held
from metering.services import usage_ingest
from tests.gateway.test_admission import ROOMY
from tests.metering.usage import priced_tenant, usage_event
from tests.platform.factories import make_key

pytestmark = pytest.mark.django_db


MICRO = 10**6  # picos: a key's spend is counted exactly, in the invoice's 1e-12 units


def keyed(prefix: str, *, rpm=-1, tpm=-1, budget=-1):
    """`budget` in micros (as the acquires below spend)."""
    return replace(ROOMY, key_prefix=prefix, key_requests_per_minute=rpm, key_tokens_per_minute=tpm,
                   key_budget_spend_picos=budget * MICRO if budget >= 0 else -1)  # fmt: skip


def held_and_spent(tenant, prefix: str) -> tuple[int, int]:
    """The key's live holds and settled spend, in micros."""
    held, spent = key_spend_held(tenant_id=tenant.pk, key_prefix=prefix)
    return held / MICRO, spent / MICRO


def acquire(tenant, limits, *, tokens=10, spend_micros=0):
    request_id = uuid.uuid4().hex
    decision = async_to_sync(admission_acquire)(
        tenant_id=tenant.pk, request_id=request_id, tokens=tokens, spend_micros=spend_micros, limits=limits
    )
    return decision, request_id


def settle(tenant, request_id, *, tokens, spend_micros, key_prefix, final=True):
    return async_to_sync(admission_settle)(
        tenant_id=tenant.pk, request_id=request_id, tokens=tokens, spend_micros=spend_micros, final=final,
        key_prefix=key_prefix,
    )  # fmt: skip


def test_a_peek_reads_the_keys_window_beside_the_tenants(backend, tenant):
    """What the headers of a call answered without an admission (a model listing, a 404) are made from."""
    capped, sibling = keyed("peeked00", rpm=3), keyed("sibling0")
    for limits in (capped, capped, sibling):
        assert acquire(tenant, limits, tokens=7)[0].admitted
    window = async_to_sync(admission_peek)(tenant_id=tenant.pk, key_prefix="peeked00")
    assert (window.window_requests, window.window_tokens) == (3, 21)
    assert (window.key_window_requests, window.key_window_tokens) == (2, 14)
    keyless = async_to_sync(admission_peek)(tenant_id=tenant.pk)
    assert (keyless.window_requests, keyless.key_window_requests) == (3, 0)


def test_a_keys_requests_per_minute_leave_its_sibling_alone(backend, tenant):
    capped, sibling = keyed("capped00", rpm=2), keyed("sibling0")
    assert acquire(tenant, capped)[0].admitted and acquire(tenant, capped)[0].admitted
    refused, _ = acquire(tenant, capped)
    assert not refused.admitted and refused.reason == "key_requests"
    assert acquire(tenant, sibling)[0].admitted


def test_a_keys_tokens_per_minute(backend, tenant):
    capped = keyed("tpmkey00", tpm=100)
    _, first = acquire(tenant, capped, tokens=60)
    assert acquire(tenant, capped, tokens=60)[0].reason == "key_tokens"
    settle(tenant, first, tokens=20, spend_micros=0, key_prefix="tpmkey00")  # used 20 of the 60 it held
    assert acquire(tenant, capped, tokens=60)[0].admitted


def test_an_admitted_call_is_told_its_keys_window_as_well_as_its_tenants(backend, tenant):
    """What an admitted call's x-ratelimit-* headers report where the key's own limit is the nearer one."""
    capped = keyed("window00", rpm=5, tpm=1_000)
    acquire(tenant, keyed("other000"), tokens=7)  # the tenant's window counts a sibling's call; the key's does not
    first, _ = acquire(tenant, capped, tokens=30)
    second, _ = acquire(tenant, capped, tokens=40)
    assert (second.window_requests, second.window_tokens) == (3, 77)
    assert (first.key_window_requests, first.key_window_tokens) == (1, 30)
    assert (second.key_window_requests, second.key_window_tokens) == (2, 70)
    keyless, _ = acquire(tenant, ROOMY)
    assert keyless.admitted and (keyless.key_window_requests, keyless.key_window_tokens) == (0, 0)


def test_a_keys_budget_counts_holds_then_usage_and_its_sibling_still_works(backend, tenant):
    capped = keyed("budget00", budget=1_000)
    admitted, first = acquire(tenant, capped, spend_micros=600)
    assert admitted.admitted
    held, _ = acquire(tenant, capped, spend_micros=600)
    assert not held.admitted and held.reason == "key_budget_held"  # the first request's hold is in the way
    assert held_and_spent(tenant, "budget00") == (600, 0)
    settle(tenant, first, tokens=10, spend_micros=900, key_prefix="budget00")
    assert held_and_spent(tenant, "budget00") == (0, 900)
    over, _ = acquire(tenant, capped, spend_micros=200)
    assert not over.admitted and over.reason == "key_budget_spend"
    assert acquire(tenant, capped, spend_micros=100)[0].admitted  # exactly up to the budget
    assert acquire(tenant, keyed("sibling0", budget=1_000), spend_micros=600)[0].admitted


def test_a_key_refusal_consumes_nothing_of_the_tenant(backend, tenant):
    capped = keyed("nothing0", budget=100)
    for _ in range(3):
        assert acquire(tenant, capped, spend_micros=500)[0].reason == "key_budget_spend"
    decision, _ = acquire(tenant, keyed("sibling0"))
    assert decision.admitted and decision.window_requests == 1


def test_an_orphaned_hold_releases_the_keys_share(backend, tenant):
    capped = keyed("orphan00", budget=1_000)
    with override_settings(QUILT_HOLD_TTL_SECONDS=0):
        assert acquire(tenant, capped, spend_micros=900)[0].admitted  # nobody settles it; already expired
    assert acquire(tenant, capped, spend_micros=900)[0].admitted
    assert held_and_spent(tenant, "orphan00") == (900, 0)


def test_a_keys_month_starts_from_what_metering_recorded_and_metering_settles_it(backend):
    tenant = priced_tenant("keyed")
    key, _ = make_key(tenant)
    # 1000 prompt (200 cached) + 300 output at 0.5 / 0.125 / 1.5 per million: $0.000875 = 875 micro-dollars
    usage_ingest(events=[usage_event(tenant, api_key_id=key.pk, finished_at=datetime.now(UTC))])
    capped = keyed(key.prefix, budget=1_000)
    assert acquire(tenant, capped, spend_micros=200)[0].reason == "key_budget_spend"
    decision, request_id = acquire(tenant, capped, spend_micros=100)
    assert decision.admitted
    assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=5, spend=Decimal("0.00005"),
                       key_prefix=key.prefix)  # fmt: skip
    assert held_and_spent(tenant, key.prefix) == (0, 925)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("backend", ["database", "redis"], indirect=True)
def test_concurrent_requests_never_hold_past_a_keys_budget(backend):
    """40 requests at once, each holding 300 micro-dollars of a 3,000 budget: exactly 10 are admitted, on
    PostgreSQL (the tenant's row locked) as on Redis (one script)."""
    import threading

    from django.db import connection

    from tests.platform.factories import TenantFactory

    tenant = TenantFactory()
    capped = keyed("racing00", budget=3_000)
    decisions, start = [], threading.Barrier(40)

    def one():
        try:
            start.wait()
            decisions.append(acquire(tenant, capped, spend_micros=300)[0])
        finally:
            connection.close()

    threads = [threading.Thread(target=one) for _ in range(40)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    admitted = [decision for decision in decisions if decision.admitted]
    assert len(decisions) == 40 and len(admitted) == 10
    assert {d.reason for d in decisions if not d.admitted} == {"key_budget_held"}
    assert held_and_spent(tenant, "racing00") == (3_000, 0)


def test_a_keys_spend_is_exact_and_reconciled_with_what_metering_recorded(backend):
    """A key's spend adds each request's price exactly (no rounding up to a micro-dollar), and reconciling sets it
    back to metering's record of the key's lineage when a settle counted usage metering never recorded."""
    from gateway.admission import key_reconcile

    tenant = priced_tenant("exact")
    key, _ = make_key(tenant)
    capped = keyed(key.prefix, budget=1_000)
    for _ in range(3):  # 0.4 micro-dollars each: counted whole, 3 of them would be 3 micro-dollars
        decision, request_id = acquire(tenant, capped, spend_micros=1)
        assert decision.admitted
        assert hold_settle(tenant_id=tenant.pk, request_id=request_id, tokens=5, spend=Decimal("0.0000004"),
                           key_prefix=key.prefix)  # fmt: skip
    assert key_spend_held(tenant_id=tenant.pk, key_prefix=key.prefix) == (0, 1_200_000)  # 1.2 micro-dollars, in picos
    usage_ingest(events=[usage_event(tenant, api_key_id=key.pk, finished_at=datetime.now(UTC))])  # 875 micro-dollars
    reconciled = key_reconcile(tenant_id=tenant.pk, key_prefix=key.prefix)
    assert reconciled.applied and reconciled.spend_picos_after == 875 * MICRO  # the 3 unrecorded settles are gone
    assert key_spend_held(tenant_id=tenant.pk, key_prefix=key.prefix) == (0, 875 * MICRO)


def test_a_served_requests_usage_is_kept_until_metering_records_it(backend, tenant):
    """The gateway's provisional settle keeps the usage it relayed; it is listed as unreported once older than the
    grace period, and the final settle (metering recorded the request) lets go of it."""
    from gateway.admission import unreported_usage

    decision, request_id = acquire(tenant, keyed("served00"))
    assert decision.admitted
    settle(tenant, request_id, tokens=7, spend_micros=3, key_prefix="served00", final=False)
    async_to_sync(admission_settle)(tenant_id=tenant.pk, request_id="other", tokens=1, spend_micros=1, final=False,
                                    usage='{"request_id": "other"}')  # fmt: skip
    decision, served = acquire(tenant, keyed("served00"))
    served_usage = json.dumps({"request_id": served})
    async_to_sync(admission_settle)(tenant_id=tenant.pk, request_id=served, tokens=7, spend_micros=3, final=False,
                                    key_prefix="served00", usage=served_usage)  # fmt: skip
    assert unreported_usage(tenant_id=tenant.pk, older_than_seconds=60) == []  # within the grace period
    assert sorted(unreported_usage(tenant_id=tenant.pk, older_than_seconds=-1)) == sorted(
        ['{"request_id": "other"}', served_usage]
    )
    hold_settle(tenant_id=tenant.pk, request_id=served, tokens=7, spend=Decimal("0.000003"), key_prefix="served00")
    assert unreported_usage(tenant_id=tenant.pk, older_than_seconds=-1) == ['{"request_id": "other"}']
