"""Admission in Redis: `redis_scripts`' acquire decides (and records) a request, its settle releases the hold; run
through redis-py: from the event loop on one asyncio connection per loop (`redis_client`: the calls made while
one is in flight pipelined), from blocking callers (metering's settles, totals, reconcile) on its blocking client. Each script is one
EVALSHA, the script loaded once when the server answers NOSCRIPT (redis-py's `Script`). The keys and their layout:
`redis_scripts`."""

import asyncio
import logging
import math
import time
import weakref
from functools import partial

import redis
import redis.asyncio
from asgiref.sync import sync_to_async

from gateway import metrics
from gateway.admission import limits as admission_limits
from gateway.admission.leases import SHARE, Demand, Lease, Leases, Ticket, new_id
from gateway.admission.limits import (
    Decision,
    HeldTotals,
    Limits,
    Reconciled,
    current_month,
    spend_to_picos,
)
from gateway.admission.redis_client import ScriptCalls, loop_client
from gateway.admission.redis_lease_scripts import LEASE, LEASE_RETURN
from gateway.admission.redis_scripts import (
    ACQUIRE,
    FORGET_UNREPORTED,
    KEY_RECONCILE,
    MARK_UNREPORTED,
    PEEK,
    RECONCILE,
    SETTLE,
    TOTALS,
    UNREPORTED,
)
from gateway.connections import checked_connection
from gateway.hot_settings import hot
from metering.selectors import key_spend_month_recorded, usage_month_recorded
from tenancy.models import Tenant

MONTH_SECONDS = 5356800  # 62 days: a month's totals outlive it


class _Scripts:
    """A client and the scripts registered on it (run by SHA, loaded on first use); on an event loop, the calls that
    send them (`ScriptCalls`)."""

    def __init__(self, client, call: ScriptCalls | None = None):
        self.client = client
        self.call = call
        self.acquire = client.register_script(ACQUIRE)
        self.settle = client.register_script(SETTLE)
        self.totals = client.register_script(TOTALS)
        self.peek = client.register_script(PEEK)
        self.reconcile = client.register_script(RECONCILE)
        self.key_reconcile = client.register_script(KEY_RECONCILE)
        self.unreported = client.register_script(UNREPORTED)
        self.mark_unreported = client.register_script(MARK_UNREPORTED)
        self.forget_unreported = client.register_script(FORGET_UNREPORTED)
        self.lease = client.register_script(LEASE)
        self.lease_return = client.register_script(LEASE_RETURN)


_NO_RETURN = ["", 0, "", 0, 0, 0, 0, 0, 0, 0]  # LEASE's ARGV[19..28] when there is no lease to give back
log = logging.getLogger(__name__)


def _decision(reply: list) -> Decision:
    admitted, reason, requests, tokens, reset_ms, *key = reply  # the key's window: the acquire's, not the peek's
    reason = reason.decode() if isinstance(reason, bytes) else reason
    return Decision(bool(admitted), reason, int(requests), int(tokens), int(reset_ms), *map(int, key))


def _limit_args(limits: Limits, ttl: int) -> tuple:
    """The acquire script's ARGV[4..13]: what a request's plan and key allow."""
    return (
        limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent, limits.budget_tokens,
        limits.budget_spend_micros, ttl, limits.key_prefix, limits.key_requests_per_minute,
        limits.key_tokens_per_minute, limits.key_budget_spend_picos,
    )  # fmt: skip


def _recorded(tenant_id: int) -> tuple[int, int]:
    tokens, price = usage_month_recorded(tenant_id=tenant_id)
    return tokens, spend_to_picos(price)


def _key_recorded(key_prefix: str) -> int:
    return spend_to_picos(key_spend_month_recorded(key_lineage=key_prefix))


class _TenantKeys:
    """A tenant's keys in one month, made once a month rather than twice a request."""

    def __init__(self, prefix: str, tenant_id: int, month: str):
        base = f"{prefix}:{{t{tenant_id}}}"
        self.month = month
        self.settled = f"{base}:settled:"  # + the request id
        self.before = [f"{base}:win", f"{base}:holds", f"{base}:holdinfo", f"{base}:held", f"{base}:month:{month}"]
        self.after = [f"{base}:prov:{month}", f"{base}:keywin", f"{base}:keyheld", f"{base}:keymonth:{month}",
                      f"{base}:unreported", f"{base}:unreported_at", f"{base}:leases"]  # fmt: skip

    def keys(self, request_id: str = "-") -> list[str]:
        return [*self.before, self.settled + request_id, *self.after]


class RedisAdmission:
    def __init__(self, *, url: str, prefix: str, hold_ttl_seconds: int | None = None):
        self.url = url
        self.prefix = prefix
        self._hold_ttl = hold_ttl_seconds
        self._async: weakref.WeakKeyDictionary[object, _Scripts] = weakref.WeakKeyDictionary()
        self._last: tuple[object, _Scripts | None] = (None, None)  # the loop a script last ran from, and its scripts
        self._sync: _Scripts | None = None
        self._tenants: dict[int, _TenantKeys] = {}
        self._leases: weakref.WeakKeyDictionary[object, Leases] = weakref.WeakKeyDictionary()
        self._unreported_tenants = f"{prefix}:unreported_tenants"
        self._unreported_seeded = f"{prefix}:unreported_tenants_seeded"
        self._marked: dict[int, float] = {}  # tenant id -> when this process last marked it (unix seconds)

    def _tenant(self, tenant_id: int) -> _TenantKeys:
        month = current_month()
        tenant = self._tenants.get(tenant_id)
        if tenant is None or tenant.month != month:
            tenant = self._tenants[tenant_id] = _TenantKeys(self.prefix, tenant_id, month)
        return tenant

    def keys(self, tenant_id: int, *, request_id: str = "-") -> list[str]:
        return self._tenant(tenant_id).keys(request_id)

    def _on_loop(self) -> _Scripts:
        """The running loop's client and scripts (`redis_client.loop_client`)."""
        loop = asyncio.get_running_loop()
        last_loop, scripts = self._last
        if last_loop is loop:
            return scripts
        scripts = self._async.get(loop)
        if scripts is None:
            reply_seconds = hot.QUILT_REDIS_REPLY_TIMEOUT_SECONDS
            client = loop_client(self.url, reply_seconds=reply_seconds)
            scripts = self._async[loop] = _Scripts(client, ScriptCalls(self.url, reply_seconds=reply_seconds))
        self._last = (loop, scripts)
        return scripts

    async def _run(self, name: str, keys: list[str], args: list):
        """One of the scripts, from the event loop."""
        scripts = self._on_loop()
        return await scripts.call(getattr(scripts, name), keys, args)

    def _blocking(self) -> _Scripts:
        if self._sync is None:
            self._sync = _Scripts(redis.Redis.from_url(self.url))
        return self._sync

    async def acquire(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> Decision:
        tenant = self._tenant(tenant_id)
        ttl = self._hold_ttl if self._hold_ttl is not None else hot.QUILT_HOLD_TTL_SECONDS
        args = [request_id, tokens, spend_micros, *_limit_args(limits, ttl), key_spend_picos]
        scripts = self._on_loop()
        script = partial(scripts.call, scripts.acquire, tenant.keys(), args)
        decision = _decision(await script())
        if decision.reason == "month_unknown":
            recorded = await sync_to_async(checked_connection(_recorded))(tenant_id)  # rare: once a month
            await self._start_month(scripts.client, tenant.keys()[4], recorded)
            decision = _decision(await script())
        if decision.reason == "key_month_unknown":  # once a month per key with a budget
            spend = await sync_to_async(checked_connection(_key_recorded))(limits.key_prefix)
            async with scripts.client.pipeline(transaction=True) as pipe:
                key_month = tenant.keys()[9]
                pipe.hsetnx(key_month, f"{limits.key_prefix}:picos", spend).expire(key_month, MONTH_SECONDS)
                await pipe.execute()
            decision = _decision(await script())
        return decision

    def _leases_here(self) -> Leases:
        loop = asyncio.get_running_loop()
        leases = self._leases.get(loop)
        if leases is None:
            leases = self._leases[loop] = Leases(self._give_back)
        return leases

    async def admit(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> tuple[Decision, Ticket | None]:
        """`acquire`, from this process's lease of the tenant's key where it has one with room (no round trip), and
        taking one where the key is busy here (`leases`). The ticket, for a request admitted from a lease, goes with
        its settle."""
        demand = self._leases_here().demand(tenant_id, limits.key_prefix)
        lease, now = demand.lease, time.monotonic()
        if lease is not None and lease.limits is limits:
            decision = lease.admit(tokens, spend_micros, key_spend_picos, now)
            if decision is not None:
                demand.note(now, lease.in_flight)
                return decision, Ticket(lease, tokens, spend_micros, key_spend_picos)
        busy = demand.note(now, 0 if lease is None else lease.in_flight + 1)
        if demand.renewing or not (busy or lease is not None) or not hot.QUILT_ADMISSION_LEASES:
            decision = await self.acquire(tenant_id=tenant_id, request_id=request_id, tokens=tokens,
                                          spend_micros=spend_micros, key_spend_picos=key_spend_picos, limits=limits)
            return decision, None
        return await self._lease(demand, tenant_id, request_id, tokens, spend_micros, key_spend_picos, limits)

    async def _lease(
        self, demand: Demand, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int,
        limits: Limits,
    ) -> tuple[Decision, Ticket | None]:  # fmt: skip
        """One LEASE: the old lease given back, the request admitted, from a new lease where there is room."""
        old, demand.lease = demand.lease, None
        back = old.give_back() if old is not None else _NO_RETURN
        wanted, slots = demand.wants()
        ttl = self._hold_ttl if self._hold_ttl is not None else hot.QUILT_HOLD_TTL_SECONDS
        lease_id = new_id()
        args = [request_id, tokens, spend_micros, *_limit_args(limits, ttl), key_spend_picos, lease_id, wanted, slots,
                SHARE, *back]  # fmt: skip
        demand.renewing, sent = True, time.monotonic()  # the window's end is counted from before Redis read its clock
        try:
            reply = await self._run("lease", self._tenant(tenant_id).keys(request_id), args)
        finally:
            demand.renewing = False
        decision = _decision(reply[:7])
        if decision.reason in ("month_unknown", "key_month_unknown"):  # the old lease is given back: start the month
            decision = await self.acquire(tenant_id=tenant_id, request_id=request_id, tokens=tokens,
                                          spend_micros=spend_micros, key_spend_picos=key_spend_picos, limits=limits)
            return decision, None
        if not decision.admitted or not int(reply[8]):  # refused, or held alone (no room for a lease)
            return decision, None
        window, n, c, *counts = map(int, reply[7:])
        lease = demand.lease = Lease(
            lease_id=lease_id, limits=limits, window=window, reset_ms=decision.reset_ms, n=n, c=c, tokens=tokens,
            spend=spend_micros, picos=key_spend_picos, counts=tuple(counts), now=sent,
        )  # fmt: skip
        self._leases_here().keep()
        metrics.admission_leases.labels(str(tenant_id)).inc()
        return decision, Ticket(lease, tokens, spend_micros, key_spend_picos)

    async def give_back_all(self) -> None:
        """This loop's leases given back (the gateway's shutdown), its requests in flight keeping their share."""
        leases = self._leases.get(asyncio.get_running_loop())
        for tenant_id, arguments in leases.give_back_all() if leases is not None else ():
            await self._give_back(tenant_id, arguments)

    async def _give_back(self, tenant_id: int, arguments: list) -> None:
        """A lease returned off any request's path (idle, or its window over); one that cannot be is left to expire."""
        try:
            await self._run("lease_return", self._tenant(tenant_id).keys(), arguments)
        except Exception:
            log.exception("could not give back admission lease %s (it expires with its hold)", arguments[0])

    @staticmethod
    async def _start_month(client, key: str, recorded: tuple[int, int]) -> None:
        tokens, spend = recorded
        async with client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "tokens", tokens).hsetnx(key, "picos", spend).expire(key, MONTH_SECONDS)
            await pipe.execute()

    async def peek(self, *, tenant_id: int, key_prefix: str = "") -> Decision:
        return _decision(await self._run("peek", self.keys(tenant_id), [key_prefix]))

    async def settle(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "", lease: Ticket | None = None,
    ) -> bool:  # fmt: skip
        if usage and self._mark_due(tenant_id):  # before the copy is kept, so the sweep can not miss it
            await self._run("mark_unreported", [self._unreported_tenants], [tenant_id, repr(self._marked[tenant_id])])
        args = [request_id, tokens, spend_micros, int(final), key_prefix, key_spend_picos, usage]
        if lease is not None:  # admitted from a lease: its estimate leaves the lease (SETTLE's ARGV[8..15])
            args += lease.lease.settled(lease, tokens)
        return bool(await self._run("settle", self._tenant(tenant_id).keys(request_id), args))

    def settle_sync(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "",
    ) -> bool:  # fmt: skip
        keys = self.keys(tenant_id, request_id=request_id)
        if usage and self._mark_due(tenant_id):
            self._blocking().mark_unreported(keys=[self._unreported_tenants],
                                             args=[tenant_id, repr(self._marked[tenant_id])])  # fmt: skip
        args = [request_id, tokens, spend_micros, int(final), key_prefix, key_spend_picos, usage]
        return bool(self._blocking().settle(keys=keys, args=args))

    def _mark_due(self, tenant_id: int) -> bool:
        """Whether this process marks the tenant in `unreported_tenants` now (and notes when): at most once every
        UNREPORTED_MARK_SECONDS, so that a busy tenant costs one command a while, not one a request."""
        now = time.time()
        if now - self._marked.get(tenant_id, -math.inf) < admission_limits.UNREPORTED_MARK_SECONDS:
            return False
        self._marked[tenant_id] = now
        return True

    def key_totals(self, *, tenant_id: int, key_prefix: str) -> tuple[int, int]:
        """The key lineage's held and settled spend this month (picos), as admission sees them."""
        keys, client = self.keys(tenant_id), self._blocking().client
        held, used = client.hget(keys[8], f"{key_prefix}:picos"), client.hget(keys[9], f"{key_prefix}:picos")
        return int(held or 0), int(used or 0)

    def key_reconcile(self, *, tenant_id: int, key_prefix: str, attempts: int = 3) -> Reconciled | None:
        """The key lineage's month spend set to metering's record (+ its provisional settles), as `reconcile` does
        for the tenant: only if no final settle of the key landed while the record was read."""
        keys, client = self.keys(tenant_id), self._blocking().client
        for _ in range(attempts):
            seq = int(client.hget(keys[9], f"{key_prefix}:seq") or 0)
            recorded = _key_recorded(key_prefix)
            applied, before = self._blocking().key_reconcile(keys=keys, args=[key_prefix, recorded, seq])
            if applied == -1:
                return None
            if applied == 1:
                return Reconciled(True, 0, int(before), 0, self.key_totals(tenant_id=tenant_id, key_prefix=key_prefix)[1])
        now = self.key_totals(tenant_id=tenant_id, key_prefix=key_prefix)[1]
        return Reconciled(False, 0, now, 0, now)

    def unreported(self, *, tenant_id: int, older_than_seconds: float, limit: int) -> list[str]:
        """Usage events the gateway relayed and settled provisionally over `older_than_seconds` ago that metering has
        not recorded since (JSON)."""
        replies = self._blocking().unreported(keys=self.keys(tenant_id), args=[older_than_seconds, limit])
        return [reply.decode() for reply in replies if reply is not None]

    def unreported_tenants(self) -> list[int]:
        """The marked tenants; one marked over twice UNREPORTED_MARK_SECONDS ago with no copy left is forgotten,
        unless a gateway marked it again meanwhile (a gateway re-marks within UNREPORTED_MARK_SECONDS). The first
        sweep on a Redis without the seeded flag marks every tenant that keeps a copy (kept before marks were)."""
        scripts = self._blocking()
        if not scripts.client.exists(self._unreported_seeded):
            self._seed_unreported_tenants()
        forget_before = time.time() - 2 * admission_limits.UNREPORTED_MARK_SECONDS
        tenants = []
        for member, mark in scripts.client.zrange(self._unreported_tenants, 0, -1, withscores=True):
            tenant_id = int(member)
            if mark < forget_before and not scripts.client.zcard(self.keys(tenant_id)[11]):  # its unreported_at
                scripts.forget_unreported(keys=[self._unreported_tenants], args=[member, repr(mark)])
                continue
            tenants.append(tenant_id)
        return tenants

    def _seed_unreported_tenants(self) -> None:
        """One walk over every tenant, once per Redis: each that keeps a copy is marked."""
        client, now = self._blocking().client, time.time()
        tenant_ids = list(Tenant.objects.values_list("pk", flat=True))
        with client.pipeline(transaction=False) as pipe:
            for tenant_id in tenant_ids:
                pipe.zcard(self.keys(tenant_id)[11])
            kept = [tenant_id for tenant_id, count in zip(tenant_ids, pipe.execute(), strict=True) if count]
        if kept:
            client.zadd(self._unreported_tenants, dict.fromkeys(kept, now), gt=True)
        client.set(self._unreported_seeded, now)

    def _totals(self, tenant_id: int) -> list[int]:
        return [int(value) for value in self._blocking().totals(keys=self.keys(tenant_id))]

    def totals(self, *, tenant_id: int) -> HeldTotals:
        live, held, month_tokens, month_spend, prov_tokens, prov_spend, _, _ = self._totals(tenant_id)
        return HeldTotals(
            live_holds=live, held_tokens=held, month_tokens=month_tokens, month_spend_picos=month_spend,
            provisional_tokens=prov_tokens, provisional_spend_picos=prov_spend,
        )  # fmt: skip

    def reconcile(self, *, tenant_id: int, attempts: int = 3) -> Reconciled | None:
        """Reads the final-settle count, then metering's record, then sets the total only if no final settle
        landed in between (one that did may or may not be in the record read)."""
        for _ in range(attempts):
            *_, exists, seq = self._totals(tenant_id)
            if not exists:
                return None
            tokens, spend = _recorded(tenant_id)
            applied, before_t, before_s = self._blocking().reconcile(keys=self.keys(tenant_id), args=[tokens, spend, seq])
            if applied == -1:
                return None
            if applied == 1:
                after = self.totals(tenant_id=tenant_id)
                return Reconciled(True, int(before_t), int(before_s), after.month_tokens, after.month_spend_picos)
        now = self.totals(tenant_id=tenant_id)
        return Reconciled(False, now.month_tokens, now.month_spend_picos, now.month_tokens, now.month_spend_picos)
