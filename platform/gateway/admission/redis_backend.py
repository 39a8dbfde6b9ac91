"""Admission in Redis: one Lua script decides (and records) a request; another settles its hold.

Keys per tenant share a hash tag, so a tenant's state lives on one shard:
  win       hash  start, requests, tokens of the current one-minute window
  holds     zset  request id -> expiry (unix seconds); its size is the concurrent requests
  holdinfo  hash  request id -> "tokens:spend_micros:window_start:key:key_spend_picos"
  held      hash  tokens, spend: the sum over live holds
  month:M   hash  tokens, spend: settled usage of month M (final + provisional); seq: final settles so far
  prov:M    hash  request id -> "tokens:spend_micros:key:key_spend_picos" settled provisionally in month M, awaiting the final settle
  settled:R       "f" once request R is settled finally, "p:tokens:spend:key_spend" while provisionally (idempotency)
  unreported      hash  request id -> the usage event the gateway relayed (JSON), from its provisional settle until
                        metering's final one: what `unreported_usage` bills if the engine's own event never comes
  unreported_at   zset  request id -> when the gateway settled it (unix seconds)
Per API key lineage (a key and its rotations: `ApiKey.lineage`), in three hashes of the tenant (so an orphan of any
key is released by the tenant's own scripts), fields prefixed by the lineage's id K:
  keywin     K:start, K:requests, K:tokens of the key's current one-minute window
  keyheld    K:tokens, K:picos: the sum over the key's live holds
  keymonth:M K:tokens, K:picos: the key's settled usage of month M (K:picos missing: not started yet); K:seq: its
             final settles so far (reconcile's guard)
A key's spend is counted in picos (1e-12, the unit metering's prices are exact to: never rounded, so it equals the
sum of its requests' billed prices); the tenant's in micros, rounded up per request and reconciled. A pico amount is
handed to HINCRBY as the digits it came in (ARGV or a stored field), never through Lua's doubles.
A hold's holdinfo carries its key and the key's pico share, so settling or expiring it releases the key's share too.
"""

import asyncio
import weakref

import redis
import redis.asyncio
from asgiref.sync import sync_to_async
from django.conf import settings

from gateway.admission.limits import (
    Decision,
    HeldTotals,
    Limits,
    Reconciled,
    current_month,
    spend_to_micros,
    spend_to_picos,
)
from gateway.admission.redis_wire import RedisWire, WireScript, wire_supports
from gateway.connections import checked_connection
from metering.selectors import key_spend_month_recorded, usage_month_recorded

MONTH_SECONDS = 5356800  # 62 days: a month's totals outlive it

_EXPIRE_ORPHANS = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(ids) do
  local info = redis.call('HGET', KEYS[3], id)
  if info then
    local t, s, _, k, kp = string.match(info, '^(%d+):(%d+):(%d+):?(%w*):?(%d*)$')
    redis.call('HINCRBY', KEYS[4], 'tokens', 0 - tonumber(t))
    redis.call('HINCRBY', KEYS[4], 'spend', 0 - tonumber(s))
    if k ~= '' then
      redis.call('HINCRBY', KEYS[9], k .. ':tokens', 0 - tonumber(t))
      if kp ~= '' and kp ~= '0' then redis.call('HINCRBY', KEYS[9], k .. ':picos', '-' .. kp) end
    end
    redis.call('HDEL', KEYS[3], id)
  end
  redis.call('ZREM', KEYS[2], id)
end
"""

_CLOCK = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local window = math.floor(now / 60) * 60
"""

ACQUIRE = (
    _CLOCK
    + _EXPIRE_ORPHANS
    + """
local rid, tokens, spend = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm, maxc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local budget_tokens, budget_spend, ttl = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local reqs, toks = 0, 0
if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == window then
  reqs = tonumber(redis.call('HGET', KEYS[1], 'requests') or 0)
  toks = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
end
local reset_ms = math.ceil((window + 60 - now) * 1000)
if reqs + 1 > rpm then return {0, 'requests', reqs, toks, reset_ms} end
if toks + tokens > tpm then return {0, 'tokens', reqs, toks, reset_ms} end
if redis.call('ZCARD', KEYS[2]) + 1 > maxc then return {0, 'concurrency', reqs, toks, reset_ms} end
if redis.call('EXISTS', KEYS[5]) == 0 then
  return {0, 'month_unknown', reqs, toks, reset_ms}
end
local used_t = tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0)
local used_s = tonumber(redis.call('HGET', KEYS[5], 'spend') or 0)
local held_t = tonumber(redis.call('HGET', KEYS[4], 'tokens') or 0)
local held_s = tonumber(redis.call('HGET', KEYS[4], 'spend') or 0)
if budget_tokens >= 0 and used_t + held_t + tokens > budget_tokens then
  if used_t + tokens > budget_tokens then return {0, 'budget_tokens', reqs, toks, reset_ms} end
  return {0, 'budget_held', reqs, toks, reset_ms}
end
if budget_spend >= 0 and used_s + held_s + spend > budget_spend then
  if used_s + spend > budget_spend then return {0, 'budget_spend', reqs, toks, reset_ms} end
  return {0, 'budget_held', reqs, toks, reset_ms}
end
local key, key_rpm, key_tpm, key_budget = ARGV[10], tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local key_spend = ARGV[14]  -- picos, as digits
local key_reqs, key_toks = 0, 0
if key ~= '' then
  if tonumber(redis.call('HGET', KEYS[8], key .. ':start') or -1) == window then
    key_reqs = tonumber(redis.call('HGET', KEYS[8], key .. ':requests') or 0)
    key_toks = tonumber(redis.call('HGET', KEYS[8], key .. ':tokens') or 0)
  end
  if key_rpm >= 0 and key_reqs + 1 > key_rpm then return {0, 'key_requests', key_reqs, key_toks, reset_ms} end
  if key_tpm >= 0 and key_toks + tokens > key_tpm then return {0, 'key_tokens', key_reqs, key_toks, reset_ms} end
  if key_budget >= 0 then
    local key_used = redis.call('HGET', KEYS[10], key .. ':picos')
    if not key_used then return {0, 'key_month_unknown', reqs, toks, reset_ms} end
    local key_held = tonumber(redis.call('HGET', KEYS[9], key .. ':picos') or 0)
    if tonumber(key_used) + key_held + tonumber(key_spend) > key_budget then
      if tonumber(key_used) + tonumber(key_spend) > key_budget then return {0, 'key_budget_spend', reqs, toks, reset_ms} end
      return {0, 'key_budget_held', reqs, toks, reset_ms}
    end
  end
  redis.call('HSET', KEYS[8], key .. ':start', window, key .. ':requests', key_reqs + 1, key .. ':tokens', key_toks + tokens)
  redis.call('EXPIRE', KEYS[8], 120)
  redis.call('HINCRBY', KEYS[9], key .. ':tokens', tokens)
  redis.call('HINCRBY', KEYS[9], key .. ':picos', key_spend)
  redis.call('EXPIRE', KEYS[9], ttl + 60)
end
redis.call('HSET', KEYS[1], 'start', window, 'requests', reqs + 1, 'tokens', toks + tokens)
redis.call('EXPIRE', KEYS[1], 120)
redis.call('ZADD', KEYS[2], now + ttl, rid)
redis.call('HSET', KEYS[3], rid, string.format('%d:%d:%d:%s:', tokens, spend, window, key) .. (key ~= '' and key_spend or '0'))
redis.call('HINCRBY', KEYS[4], 'tokens', tokens)
redis.call('HINCRBY', KEYS[4], 'spend', spend)
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ttl + 60) end
return {1, 'ok', reqs + 1, toks + tokens, reset_ms}
"""
)

SETTLE = (
    _CLOCK
    + """
local rid, tokens, spend, final = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4] == '1'
local key, key_spend, usage = ARGV[5] or '', ARGV[6] or '0', ARGV[7] or ''
local prior = redis.call('GET', KEYS[6])
if final then  -- metering recorded the request: nothing left for unreported_usage to bill
  redis.call('HDEL', KEYS[11], rid)
  redis.call('ZREM', KEYS[12], rid)
end
if prior == 'f' or (prior and not final) then return 0 end
local live = 0
local info = redis.call('HGET', KEYS[3], rid)
if info then
  local t, s, w, k, kp = string.match(info, '^(%d+):(%d+):(%d+):?(%w*):?(%d*)$')
  redis.call('HINCRBY', KEYS[4], 'tokens', 0 - tonumber(t))
  redis.call('HINCRBY', KEYS[4], 'spend', 0 - tonumber(s))
  redis.call('HDEL', KEYS[3], rid)
  redis.call('ZREM', KEYS[2], rid)
  live = 1
  if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == tonumber(w) then
    redis.call('HINCRBY', KEYS[1], 'tokens', tokens - tonumber(t))
  end
  if k ~= '' then
    key = k
    redis.call('HINCRBY', KEYS[9], k .. ':tokens', 0 - tonumber(t))
    if kp ~= '' and kp ~= '0' then redis.call('HINCRBY', KEYS[9], k .. ':picos', '-' .. kp) end
    if tonumber(redis.call('HGET', KEYS[8], k .. ':start') or -1) == tonumber(w) then
      redis.call('HINCRBY', KEYS[8], k .. ':tokens', tokens - tonumber(t))
    end
  end
end
local pt, ps, pkp = '0', '0', '0'
if prior then  -- the final settle replaces what the provisional one counted
  pt, ps, pkp = string.match(prior, '^p:(%d+):(%d+):?(%d*)$')
  if pkp == '' then pkp = '0' end
  redis.call('HDEL', KEYS[7], rid)
end
-- A month total that is missing starts, at the next admission, from metering's record, which holds this usage
-- once ingested: creating it here would start it from this request alone and forget the month before.
local counted = redis.call('EXISTS', KEYS[5]) == 1
if counted then
  redis.call('HINCRBY', KEYS[5], 'tokens', tokens - tonumber(pt))
  redis.call('HINCRBY', KEYS[5], 'spend', spend - tonumber(ps))
  if final then redis.call('HINCRBY', KEYS[5], 'seq', 1) end
end
local key_counted = key ~= '' and redis.call('HEXISTS', KEYS[10], key .. ':picos') == 1  -- the same rule
if key_counted then
  redis.call('HINCRBY', KEYS[10], key .. ':tokens', tokens - tonumber(pt))
  redis.call('HINCRBY', KEYS[10], key .. ':picos', key_spend)
  if pkp ~= '0' then redis.call('HINCRBY', KEYS[10], key .. ':picos', '-' .. pkp) end
  if final then redis.call('HINCRBY', KEYS[10], key .. ':seq', 1) end
end
if final then
  redis.call('SET', KEYS[6], 'f', 'EX', 5356800)
  return live
end
local kp = '0'
if key_counted then kp = key_spend end
local counted_t, counted_s = 0, 0
if counted then counted_t, counted_s = tokens, spend end
redis.call('SET', KEYS[6], string.format('p:%d:%d:', counted_t, counted_s) .. kp, 'EX', 5356800)
if counted or kp ~= '0' then
  redis.call('HSET', KEYS[7], rid, string.format('%d:%d:%s:', counted_t, counted_s, key) .. kp)
  redis.call('EXPIRE', KEYS[7], 5356800)
end
if usage ~= '' then
  redis.call('HSET', KEYS[11], rid, usage)
  redis.call('ZADD', KEYS[12], now, rid)
  redis.call('EXPIRE', KEYS[11], 5356800)
  redis.call('EXPIRE', KEYS[12], 5356800)
end
return live
"""
)

PEEK = (
    _CLOCK
    + """
local reqs, toks = 0, 0
if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == window then
  reqs = tonumber(redis.call('HGET', KEYS[1], 'requests') or 0)
  toks = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
end
return {1, 'ok', reqs, toks, math.ceil((window + 60 - now) * 1000)}
"""
)

_PROVISIONAL_SUMS = """
local pt, ps = 0, 0
for _, v in ipairs(redis.call('HVALS', KEYS[7])) do
  local t, s = string.match(v, '^(%d+):(%d+)')
  pt, ps = pt + tonumber(t), ps + tonumber(s)
end
"""

TOTALS = (
    _CLOCK
    + _EXPIRE_ORPHANS
    + _PROVISIONAL_SUMS
    + """
return {redis.call('ZCARD', KEYS[2]), tonumber(redis.call('HGET', KEYS[4], 'tokens') or 0),
        tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0), tonumber(redis.call('HGET', KEYS[5], 'spend') or 0),
        pt, ps, redis.call('EXISTS', KEYS[5]), tonumber(redis.call('HGET', KEYS[5], 'seq') or 0)}
"""
)

RECONCILE = (
    _PROVISIONAL_SUMS
    + """
if redis.call('EXISTS', KEYS[5]) == 0 then return {-1, 0, 0} end
if tonumber(redis.call('HGET', KEYS[5], 'seq') or 0) ~= tonumber(ARGV[3]) then return {0, 0, 0} end
local before_t = tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0)
local before_s = tonumber(redis.call('HGET', KEYS[5], 'spend') or 0)
redis.call('HSET', KEYS[5], 'tokens', tonumber(ARGV[1]) + pt, 'spend', tonumber(ARGV[2]) + ps)
return {1, before_t, before_s}
"""
)


KEY_RECONCILE = """
local key = ARGV[1]
if redis.call('HEXISTS', KEYS[10], key .. ':picos') == 0 then return {-1, '0'} end
if tonumber(redis.call('HGET', KEYS[10], key .. ':seq') or 0) ~= tonumber(ARGV[3]) then return {0, '0'} end
local before = redis.call('HGET', KEYS[10], key .. ':picos')
local provisional = 0
for _, v in ipairs(redis.call('HVALS', KEYS[7])) do
  local k, kp = string.match(v, '^%d+:%d+:(%w*):(%d+)$')
  if k == key then provisional = provisional + tonumber(kp) end
end
redis.call('HSET', KEYS[10], key .. ':picos', ARGV[2])
if provisional > 0 then redis.call('HINCRBY', KEYS[10], key .. ':picos', provisional) end
return {1, before}
"""

UNREPORTED = """
local clock = redis.call('TIME')
local ids = redis.call('ZRANGEBYSCORE', KEYS[12], '-inf', tonumber(clock[1]) - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then return {} end
return redis.call('HMGET', KEYS[11], unpack(ids))
"""


class _Scripts:
    """A client and the scripts registered on it (run by SHA, loaded on first use)."""

    def __init__(self, client):
        self.client = client
        self.acquire = client.register_script(ACQUIRE)
        self.settle = client.register_script(SETTLE)
        self.totals = client.register_script(TOTALS)
        self.peek = client.register_script(PEEK)
        self.reconcile = client.register_script(RECONCILE)
        self.key_reconcile = client.register_script(KEY_RECONCILE)
        self.unreported = client.register_script(UNREPORTED)


_WIRE = {name: WireScript(source) for name, source in (("acquire", ACQUIRE), ("settle", SETTLE), ("peek", PEEK))}


def _decision(reply: list) -> Decision:
    admitted, reason, requests, tokens, reset_ms = reply
    reason = reason.decode() if isinstance(reason, bytes) else reason
    return Decision(
        admitted=bool(admitted), reason=reason, window_requests=int(requests), window_tokens=int(tokens),
        reset_ms=int(reset_ms),
    )  # fmt: skip


def _recorded(tenant_id: int) -> tuple[int, int]:
    tokens, price = usage_month_recorded(tenant_id=tenant_id)
    return tokens, spend_to_micros(price)


def _key_recorded(key_prefix: str) -> int:
    return spend_to_picos(key_spend_month_recorded(key_lineage=key_prefix))


class RedisAdmission:
    def __init__(self, *, url: str, prefix: str, hold_ttl_seconds: int | None = None):
        self.url = url
        self.prefix = prefix
        self._hold_ttl = hold_ttl_seconds
        self._async: weakref.WeakKeyDictionary[object, _Scripts] = weakref.WeakKeyDictionary()
        self._sync: _Scripts | None = None
        self._wires: weakref.WeakKeyDictionary[object, RedisWire] = weakref.WeakKeyDictionary()
        self._lean = wire_supports(url)

    def keys(self, tenant_id: int, *, request_id: str = "-") -> list[str]:
        base, month = f"{self.prefix}:{{t{tenant_id}}}", current_month()
        return [
            f"{base}:win", f"{base}:holds", f"{base}:holdinfo", f"{base}:held", f"{base}:month:{month}",
            f"{base}:settled:{request_id}", f"{base}:prov:{month}", f"{base}:keywin", f"{base}:keyheld",
            f"{base}:keymonth:{month}", f"{base}:unreported", f"{base}:unreported_at",
        ]  # fmt: skip

    def _on_loop(self) -> _Scripts:
        loop = asyncio.get_running_loop()
        scripts = self._async.get(loop)
        if scripts is None:
            # Requests wait for one of a bounded set of connections rather than failing when all are busy.
            pool = redis.asyncio.BlockingConnectionPool.from_url(self.url, max_connections=64, timeout=10)
            scripts = self._async[loop] = _Scripts(redis.asyncio.Redis(connection_pool=pool))
        return scripts

    async def _run(self, name: str, keys: list[str], args: list):
        """One of the per-request scripts (acquire, settle, peek) from the event loop."""
        if not self._lean:
            return await getattr(self._on_loop(), name)(keys=keys, args=args)
        loop = asyncio.get_running_loop()
        wire = self._wires.get(loop)
        if wire is None:
            wire = self._wires[loop] = RedisWire(self.url, max_connections=64, wait_seconds=10)
        return await wire.run(_WIRE[name], keys, args)

    def _blocking(self) -> _Scripts:
        if self._sync is None:
            self._sync = _Scripts(redis.Redis.from_url(self.url))
        return self._sync

    def _ttl(self) -> int:
        return self._hold_ttl if self._hold_ttl is not None else settings.QUILT_HOLD_TTL_SECONDS

    async def acquire(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, limits: Limits
    ) -> Decision:
        args = [
            request_id, tokens, spend_micros, limits.requests_per_minute, limits.tokens_per_minute,
            limits.max_concurrent, limits.budget_tokens, limits.budget_spend_micros, self._ttl(), limits.key_prefix,
            limits.key_requests_per_minute, limits.key_tokens_per_minute, limits.key_budget_spend_picos, key_spend_picos,
        ]  # fmt: skip
        keys = self.keys(tenant_id)
        decision = _decision(await self._run("acquire", keys, args))
        if decision.reason == "month_unknown":
            recorded = await sync_to_async(checked_connection(_recorded))(tenant_id)  # rare: once a month
            await self._start_month(self._on_loop().client, keys[4], recorded)
            decision = _decision(await self._run("acquire", keys, args))
        if decision.reason == "key_month_unknown":  # once a month per key with a budget
            spend = await sync_to_async(checked_connection(_key_recorded))(limits.key_prefix)
            client = self._on_loop().client
            async with client.pipeline(transaction=True) as pipe:
                pipe.hsetnx(keys[9], f"{limits.key_prefix}:picos", spend).expire(keys[9], MONTH_SECONDS)
                await pipe.execute()
            decision = _decision(await self._run("acquire", keys, args))
        return decision

    @staticmethod
    async def _start_month(client, key: str, recorded: tuple[int, int]) -> None:
        tokens, spend = recorded
        async with client.pipeline(transaction=True) as pipe:
            pipe.hsetnx(key, "tokens", tokens).hsetnx(key, "spend", spend).expire(key, MONTH_SECONDS)
            await pipe.execute()

    async def peek(self, *, tenant_id: int) -> Decision:
        return _decision(await self._run("peek", self.keys(tenant_id), []))

    async def settle(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "",
    ) -> bool:  # fmt: skip
        keys = self.keys(tenant_id, request_id=request_id)
        args = [request_id, tokens, spend_micros, int(final), key_prefix, key_spend_picos, usage]
        return bool(await self._run("settle", keys, args))

    def settle_sync(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, key_spend_picos: int, final: bool,
        key_prefix: str = "", usage: str = "",
    ) -> bool:  # fmt: skip
        keys = self.keys(tenant_id, request_id=request_id)
        args = [request_id, tokens, spend_micros, int(final), key_prefix, key_spend_picos, usage]
        return bool(self._blocking().settle(keys=keys, args=args))

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

    def _totals(self, tenant_id: int) -> list[int]:
        return [int(value) for value in self._blocking().totals(keys=self.keys(tenant_id))]

    def totals(self, *, tenant_id: int) -> HeldTotals:
        live, held, month_tokens, month_spend, prov_tokens, prov_spend, _, _ = self._totals(tenant_id)
        return HeldTotals(
            live_holds=live, held_tokens=held, month_tokens=month_tokens, month_spend_micros=month_spend,
            provisional_tokens=prov_tokens, provisional_spend_micros=prov_spend,
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
                return Reconciled(True, int(before_t), int(before_s), after.month_tokens, after.month_spend_micros)
        now = self.totals(tenant_id=tenant_id)
        return Reconciled(False, now.month_tokens, now.month_spend_micros, now.month_tokens, now.month_spend_micros)
