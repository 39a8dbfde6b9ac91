"""Admission leases: a gateway process admits a busy key's requests from a share of its room held
ahead in Redis, with no round trip each, and no limit is ever exceeded: what one process holds no other admits, a
refusal is never late, and once the leases are given back every hold is gone and the month counts exactly what the
requests used. Real Redis; two RedisAdmission instances on one loop stand for two gateway processes."""

import asyncio
import time
import uuid
from dataclasses import replace

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import override_settings

from gateway.admission import Limits, admission_admit, admission_settle
from gateway.admission.leases import BUSY, SHARE, Ticket
from gateway.admission.redis_backend import RedisAdmission
from tests.gateway.test_admission import ROOMY

pytestmark = [pytest.mark.django_db, pytest.mark.parametrize("backend", ["redis"], indirect=True)]  # Redis's alone


def scripts_run(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def gateways(n: int, **options) -> list[RedisAdmission]:
    return [RedisAdmission(url=settings.REDIS_URL, prefix=settings.QUILT_REDIS_KEY_PREFIX, **options) for _ in range(n)]


async def admit(gateway: RedisAdmission, tenant, limits: Limits, *, tokens=10, spend=5, picos=5_000_000):
    request_id = uuid.uuid4().hex
    decision, ticket = await gateway.admit(tenant_id=tenant.pk, request_id=request_id, tokens=tokens,
                                           spend_micros=spend, key_spend_picos=picos, limits=limits)  # fmt: skip
    return decision, request_id, ticket


async def settle(gateway, tenant, request_id, ticket, limits, *, tokens=10, spend=5, picos=5_000_000):
    await gateway.settle(tenant_id=tenant.pk, request_id=request_id, tokens=tokens, spend_micros=spend,
                         key_spend_picos=picos, final=False, key_prefix=limits.key_prefix, lease=ticket)  # fmt: skip


def clear_of_the_minutes_end() -> None:
    """Waits out the current minute's last 3 s: a test counting one window must not see it roll over."""
    if time.time() % 60 > 57:
        time.sleep(60.2 - time.time() % 60)


def totals(tenant):
    gateway = gateways(1)[0]
    return gateway.totals(tenant_id=tenant.pk)


def test_a_busy_key_is_admitted_without_a_round_trip_each(backend, tenant):
    client = redis.Redis.from_url(settings.REDIS_URL)
    (gateway,) = gateways(1)
    clear_of_the_minutes_end()

    async def scenario():
        admitted, before = [], scripts_run(client)
        for _ in range(100):  # one stream: each request settled before the next
            decision, request_id, ticket = await admit(gateway, tenant, ROOMY)
            assert decision.admitted
            admitted.append((decision, request_id, ticket))
            await settle(gateway, tenant, request_id, ticket, ROOMY)
        during = scripts_run(client) - before - 100  # less the settles
        await gateway.give_back_all()
        return admitted, during

    admitted, during = async_to_sync(scenario)()
    assert during <= 20, f"{during} admission scripts for 100 admissions"  # without leases: 100
    leased = [ticket for _, _, ticket in admitted if ticket is not None]
    assert len(leased) >= 80
    counts = [decision.window_requests for decision, _, _ in admitted]
    assert counts == sorted(counts) and counts[-1] >= 100  # the headers' view: each sees the ones before it
    after = totals(tenant)
    assert (after.live_holds, after.held_tokens) == (0, 0)
    assert after.month_tokens == 100 * 10 and after.month_spend_picos == 100 * 5_000_000


def test_leases_can_be_turned_off(backend, tenant):
    (gateway,) = gateways(1)

    async def scenario():
        tickets = []
        for _ in range(3 * BUSY):
            decision, request_id, ticket = await admit(gateway, tenant, ROOMY)
            tickets.append(ticket)
            await settle(gateway, tenant, request_id, ticket, ROOMY)
        return tickets

    with override_settings(QUILT_ADMISSION_LEASES=False):
        assert async_to_sync(scenario)() == [None] * (3 * BUSY)  # each admitted by its own script


def test_two_processes_never_admit_past_a_budget(backend, tenant):
    limits = replace(ROOMY, budget_tokens=2_000)  # 200 requests of 10 tokens
    first, second = gateways(2)

    async def scenario():
        admitted = refused_early = 0
        while True:
            round_admitted = 0
            for gateway in (first, second, first, first, second):
                decision, request_id, ticket = await admit(gateway, tenant, limits)
                if decision.admitted:
                    admitted += 1
                    round_admitted += 1
                    await settle(gateway, tenant, request_id, ticket, limits)
                else:
                    assert decision.reason in ("budget_held", "budget_tokens")
                    refused_early += decision.reason == "budget_held"
            if not round_admitted:
                break
            assert admitted <= 200
        parked = admitted
        await first.give_back_all()
        await second.give_back_all()
        while (await admit(first, tenant, limits))[0].admitted:  # the room the leases held, admitted alone now
            admitted += 1
        return parked, admitted

    parked, admitted = async_to_sync(scenario)()
    assert parked >= 200 - 200 // SHARE  # early by at most what the other process parked
    assert admitted == 200  # and never past the budget
    after = totals(tenant)
    assert after.month_tokens == 2_000


def test_one_process_is_refused_exactly_at_the_limit(backend, tenant):
    limits = replace(ROOMY, requests_per_minute=8 * SHARE)  # leases of up to 7 requests, none near the limit
    (gateway,) = gateways(1)
    clear_of_the_minutes_end()

    async def scenario():
        tickets = []
        for _ in range(8 * SHARE + 2):
            decision, request_id, ticket = await admit(gateway, tenant, limits)
            tickets.append((decision.admitted, ticket))
        return tickets

    tickets = async_to_sync(scenario)()
    assert [admitted for admitted, _ in tickets] == [True] * (8 * SHARE) + [False, False]  # exact at the limit
    assert any(ticket is not None for _, ticket in tickets)  # leases were taken on the way


def test_settles_in_any_order_after_the_return_leave_nothing_held(backend, tenant):
    limits = replace(ROOMY, key_prefix="k1", key_budget_spend_picos=10**15)
    (gateway,) = gateways(1)
    redis_client = redis.Redis.from_url(settings.REDIS_URL)

    async def scenario():
        flight = []
        for _ in range(BUSY + 6):
            decision, request_id, ticket = await admit(gateway, tenant, limits)
            assert decision.admitted
            flight.append((request_id, ticket))
        assert sum(ticket is not None for _, ticket in flight) >= 6
        await gateway.give_back_all()  # the lease given back with its requests in flight
        # their settles' arguments made in order, sent in reverse (they may reach Redis in any order)
        settles = []
        for request_id, ticket in flight:
            lease_args = ticket.lease.settled(ticket, 7) if ticket is not None else None
            settles.append((request_id, lease_args, ticket))
        for request_id, lease_args, ticket in reversed(settles):
            if ticket is None:
                await settle(gateway, tenant, request_id, None, limits, tokens=7)
                continue
            keys = gateway._tenant(tenant.pk).keys(request_id)
            args = [request_id, 7, 5, 0, limits.key_prefix, 5_000_000, "", *lease_args]
            await gateway._run("settle", keys, args)

    async_to_sync(scenario)()
    after = totals(tenant)
    assert (after.live_holds, after.held_tokens) == (0, 0)
    assert after.month_tokens == (BUSY + 6) * 7
    held, used = gateway_key_totals(tenant, "k1")
    assert (held, used) == (0, (BUSY + 6) * 5_000_000)  # the key's picos exact
    assert not [key for key in redis_client.scan_iter(match=f"{settings.QUILT_REDIS_KEY_PREFIX}:*leases")
                if redis_client.hlen(key)]


def gateway_key_totals(tenant, prefix):
    return gateways(1)[0].key_totals(tenant_id=tenant.pk, key_prefix=prefix)


def test_a_dead_process_lease_expires_with_the_hold_ttl(backend, tenant):
    limits = replace(ROOMY, max_concurrent=10 * SHARE)
    (dead,) = gateways(1, hold_ttl_seconds=1)

    async def scenario():
        for _ in range(BUSY + 2):
            decision, request_id, ticket = await admit(dead, tenant, limits)
            await settle(dead, tenant, request_id, ticket, limits)
        lease = next(iter(dead._leases.values())).demands[(tenant.pk, "")].lease
        assert lease is not None  # the process dies holding it: never given back
        dead._leases.clear()
        return lease.slots

    slots = async_to_sync(scenario)()
    assert totals(tenant).live_holds >= slots
    time.sleep(2.1)
    after = totals(tenant)  # TOTALS expires orphans, as every admission does
    assert (after.live_holds, after.held_tokens) == (0, 0)
    decision = async_to_sync(admission_admit)(tenant_id=tenant.pk, request_id="after", tokens=10, spend_micros=5,
                                              key_spend_picos=0, limits=limits)[0]  # fmt: skip
    assert decision.admitted


def test_an_idle_lease_is_given_back(backend, tenant):
    (gateway,) = gateways(1)

    async def scenario():
        for _ in range(BUSY + 2):
            decision, request_id, ticket = await admit(gateway, tenant, ROOMY)
            await settle(gateway, tenant, request_id, ticket, ROOMY)
        assert (await asyncio.to_thread(totals, tenant)).live_holds > 0  # the lease's slots
        await asyncio.sleep(2.0)  # idle: the keeper gives it back

    async_to_sync(scenario)()
    after = totals(tenant)
    assert (after.live_holds, after.held_tokens) == (0, 0)
    assert after.month_tokens == (BUSY + 2) * 10


def test_a_ticket_names_its_lease(backend, tenant):
    (gateway,) = gateways(1)

    async def scenario():
        tickets = []
        for _ in range(BUSY + 2):
            tickets.append((await admit(gateway, tenant, ROOMY))[2])
        return tickets

    tickets = async_to_sync(scenario)()
    leased = [ticket for ticket in tickets if ticket is not None]
    assert leased and all(isinstance(ticket, Ticket) and ticket.lease is leased[0].lease for ticket in leased)


def test_the_gateway_gives_its_leases_back_at_shutdown(backend, tenant):
    from gateway.asgi import application

    async def scenario():
        for number in range(BUSY + 2):
            request_id = f"shutdown-{number}"
            decision, ticket = await admission_admit(tenant_id=tenant.pk, request_id=request_id, tokens=10,
                                                     spend_micros=5, key_spend_picos=0, limits=ROOMY)  # fmt: skip
            await admission_settle(tenant_id=tenant.pk, request_id=request_id, tokens=10, spend_micros=5,
                                   final=False, lease=ticket)  # fmt: skip
        held = (await asyncio.to_thread(totals, tenant)).live_holds
        messages, sent = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}], []

        async def receive():
            return messages.pop(0)

        async def send(message):
            sent.append(message["type"])

        await application({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
        return held, sent, await asyncio.to_thread(totals, tenant)

    held, sent, after = async_to_sync(scenario)()
    assert held > 0  # the lease's slots, until the shutdown
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert (after.live_holds, after.held_tokens) == (0, 0)
    assert after.month_tokens == (BUSY + 2) * 10


def test_lease_ids_differ_between_processes_with_the_same_pid(backend, monkeypatch):
    """Pods run their workers under the same pids: a lease id must not repeat across them."""
    from gateway.admission import leases

    ids = set()
    for _ in range(2):  # two processes, each with pid 7 and a fresh counter
        monkeypatch.setattr(leases, "_process", [0, ""])
        monkeypatch.setattr(leases, "_counter", iter(range(1, 4)))
        monkeypatch.setattr(leases.os, "getpid", lambda: 7)
        ids |= {leases.new_id() for _ in range(3)}
    assert len(ids) == 6
