"""Admission in Redis: one Lua script decides (and records) a request; another settles its hold.

Keys per tenant share a hash tag, so a tenant's state lives on one shard:
  win       hash  start, requests, tokens of the current one-minute window
  holds     zset  request id -> expiry (unix seconds); its size is the concurrent requests
  holdinfo  hash  request id -> "tokens:spend_micros:window_start"
  held      hash  tokens, spend: the sum over live holds
  month:M   hash  tokens, spend: settled usage of month M (final + provisional); seq: final settles so far
  prov:M    hash  request id -> "tokens:spend_micros" settled provisionally in month M, awaiting the final settle
  settled:R       "f" once request R is settled finally, "p:tokens:spend" while provisionally (idempotency)
Per API key, in three hashes of the tenant (so an orphan of any key is released by the tenant's own scripts),
fields prefixed by the key's id K:
  keywin     K:start, K:requests, K:tokens of the key's current one-minute window
  keyheld    K:tokens, K:spend: the sum over the key's live holds
  keymonth:M K:tokens, K:spend: the key's settled usage of month M (K:spend missing: not started yet)
A hold's holdinfo carries its key, so settling or expiring it releases the key's share too.
"""

import asyncio
import weakref

import redis
import redis.asyncio
from asgiref.sync import sync_to_async
from django.conf import settings

from gateway.admission.limits import Decision, HeldTotals, Limits, Reconciled, current_month, spend_to_micros
from gateway.admission.redis_wire import RedisWire, WireScript, wire_supports
from gateway.connections import checked_connection
from metering.selectors import key_spend_month_recorded, usage_month_recorded

MONTH_SECONDS = 5356800  # 62 days: a month's totals outlive it

_EXPIRE_ORPHANS = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(ids) do
  local info = redis.call('HGET', KEYS[3], id)
  if info then
    local t, s, _, k = string.match(info, '^(%d+):(%d+):(%d+):?(%w*)$')
    redis.call('HINCRBY', KEYS[4], 'tokens', 0 - tonumber(t))
    redis.call('HINCRBY', KEYS[4], 'spend', 0 - tonumber(s))
    if k ~= '' then
      redis.call('HINCRBY', KEYS[9], k .. ':tokens', 0 - tonumber(t))
      redis.call('HINCRBY', KEYS[9], k .. ':spend', 0 - tonumber(s))
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
local key, key_rpm, key_tpm, key_spend = ARGV[10], tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local key_reqs, key_toks = 0, 0
if key ~= '' then
  if tonumber(redis.call('HGET', KEYS[8], key .. ':start') or -1) == window then
    key_reqs = tonumber(redis.call('HGET', KEYS[8], key .. ':requests') or 0)
    key_toks = tonumber(redis.call('HGET', KEYS[8], key .. ':tokens') or 0)
  end
  if key_rpm >= 0 and key_reqs + 1 > key_rpm then return {0, 'key_requests', key_reqs, key_toks, reset_ms} end
  if key_tpm >= 0 and key_toks + tokens > key_tpm then return {0, 'key_tokens', key_reqs, key_toks, reset_ms} end
  if key_spend >= 0 then
    local key_used = redis.call('HGET', KEYS[10], key .. ':spend')
    if not key_used then return {0, 'key_month_unknown', reqs, toks, reset_ms} end
    local key_held = tonumber(redis.call('HGET', KEYS[9], key .. ':spend') or 0)
    if tonumber(key_used) + key_held + spend > key_spend then
      if tonumber(key_used) + spend > key_spend then return {0, 'key_budget_spend', reqs, toks, reset_ms} end
      return {0, 'key_budget_held', reqs, toks, reset_ms}
    end
  end
  redis.call('HSET', KEYS[8], key .. ':start', window, key .. ':requests', key_reqs + 1, key .. ':tokens', key_toks + tokens)
  redis.call('EXPIRE', KEYS[8], 120)
  redis.call('HINCRBY', KEYS[9], key .. ':tokens', tokens)
  redis.call('HINCRBY', KEYS[9], key .. ':spend', spend)
  redis.call('EXPIRE', KEYS[9], ttl + 60)
end
redis.call('HSET', KEYS[1], 'start', window, 'requests', reqs + 1, 'tokens', toks + tokens)
redis.call('EXPIRE', KEYS[1], 120)
redis.call('ZADD', KEYS[2], now + ttl, rid)
redis.call('HSET', KEYS[3], rid, string.format('%d:%d:%d:%s', tokens, spend, window, key))
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
local prior = redis.call('GET', KEYS[6])
if prior == 'f' or (prior and not final) then return 0 end
local live = 0
local key = ARGV[5] or ''
local info = redis.call('HGET', KEYS[3], rid)
if info then
  local t, s, w, k = string.match(info, '^(%d+):(%d+):(%d+):?(%w*)$')
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
    redis.call('HINCRBY', KEYS[9], k .. ':spend', 0 - tonumber(s))
    if tonumber(redis.call('HGET', KEYS[8], k .. ':start') or -1) == tonumber(w) then
      redis.call('HINCRBY', KEYS[8], k .. ':tokens', tokens - tonumber(t))
    end
  end
end
local add_t, add_s = tokens, spend
if prior then  -- the final settle replaces what the provisional one counted
  local pt, ps = string.match(prior, '^p:(%d+):(%d+)$')
  add_t, add_s = tokens - tonumber(pt), spend - tonumber(ps)
  redis.call('HDEL', KEYS[7], rid)
end
-- A month total that is missing starts, at the next admission, from metering's record, which holds this usage
-- once ingested: creating it here would start it from this request alone and forget the month before.
local counted = redis.call('EXISTS', KEYS[5]) == 1
if counted then
  redis.call('HINCRBY', KEYS[5], 'tokens', add_t)
  redis.call('HINCRBY', KEYS[5], 'spend', add_s)
  if final then redis.call('HINCRBY', KEYS[5], 'seq', 1) end
end
if key ~= '' and redis.call('HEXISTS', KEYS[10], key .. ':spend') == 1 then  -- same rule for the key's month
  redis.call('HINCRBY', KEYS[10], key .. ':tokens', add_t)
  redis.call('HINCRBY', KEYS[10], key .. ':spend', add_s)
end
if final then
  redis.call('SET', KEYS[6], 'f', 'EX', 5356800)
elseif counted then
  redis.call('SET', KEYS[6], string.format('p:%d:%d', tokens, spend), 'EX', 5356800)
  redis.call('HSET', KEYS[7], rid, string.format('%d:%d', tokens, spend))
  redis.call('EXPIRE', KEYS[7], 5356800)
else
  redis.call('SET', KEYS[6], 'p:0:0', 'EX', 5356800)
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
  local t, s = string.match(v, '^(%d+):(%d+)$')
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


class _Scripts:
    """A client and the scripts registered on it (run by SHA, loaded on first use)."""

    def __init__(self, client):
        self.client = client
        self.acquire = client.register_script(ACQUIRE)
        self.settle = client.register_script(SETTLE)
        self.totals = client.register_script(TOTALS)
        self.peek = client.register_script(PEEK)
        self.reconcile = client.register_script(RECONCILE)


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
    return spend_to_micros(key_spend_month_recorded(key_prefix=key_prefix))


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
            f"{base}:keymonth:{month}",
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

    async def acquire(self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits) -> Decision:
        args = [
            request_id, tokens, spend_micros, limits.requests_per_minute, limits.tokens_per_minute,
            limits.max_concurrent, limits.budget_tokens, limits.budget_spend_micros, self._ttl(), limits.key_prefix,
            limits.key_requests_per_minute, limits.key_tokens_per_minute, limits.key_budget_spend_micros,
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
                pipe.hsetnx(keys[9], f"{limits.key_prefix}:spend", spend).expire(keys[9], MONTH_SECONDS)
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
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, final: bool, key_prefix: str = ""
    ) -> bool:
        keys = self.keys(tenant_id, request_id=request_id)
        return bool(await self._run("settle", keys, [request_id, tokens, spend_micros, int(final), key_prefix]))

    def settle_sync(
        self, *, tenant_id: int, request_id: str, tokens: int, spend_micros: int, final: bool, key_prefix: str = ""
    ) -> bool:
        keys = self.keys(tenant_id, request_id=request_id)
        return bool(self._blocking().settle(keys=keys, args=[request_id, tokens, spend_micros, int(final), key_prefix]))

    def key_totals(self, *, tenant_id: int, key_prefix: str) -> tuple[int, int]:
        """The key's held and settled spend this month (micro-units), as admission sees them."""
        keys, client = self.keys(tenant_id), self._blocking().client
        held, used = client.hget(keys[8], f"{key_prefix}:spend"), client.hget(keys[9], f"{key_prefix}:spend")
        return int(held or 0), int(used or 0)

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
