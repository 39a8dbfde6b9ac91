"""Admission in Redis: one Lua script decides (and records) a request; another settles its hold.

Keys per tenant share a hash tag, so a tenant's state lives on one shard:
  win       hash  start, requests, tokens of the current one-minute window
  holds     zset  request id -> expiry (unix seconds); its size is the concurrent requests
  holdinfo  hash  request id -> "tokens:spend_micros:window_start"
  held      hash  tokens, spend: the sum over live holds
  month:M   hash  tokens, spend: settled usage of month M
  settled:R        marker that request R has been settled (idempotency)
"""

import asyncio
import weakref

import redis
import redis.asyncio
from asgiref.sync import sync_to_async
from django.conf import settings

from gateway.admission import Decision, HeldTotals, Limits, current_month, month_usage_recorded

MONTH_SECONDS = 5356800  # 62 days: a month's totals outlive it

_EXPIRE_ORPHANS = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, id in ipairs(ids) do
  local info = redis.call('HGET', KEYS[3], id)
  if info then
    local t, s = string.match(info, '^(%d+):(%d+):')
    redis.call('HINCRBY', KEYS[4], 'tokens', 0 - tonumber(t))
    redis.call('HINCRBY', KEYS[4], 'spend', 0 - tonumber(s))
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
redis.call('HSET', KEYS[1], 'start', window, 'requests', reqs + 1, 'tokens', toks + tokens)
redis.call('EXPIRE', KEYS[1], 120)
redis.call('ZADD', KEYS[2], now + ttl, rid)
redis.call('HSET', KEYS[3], rid, string.format('%d:%d:%d', tokens, spend, window))
redis.call('HINCRBY', KEYS[4], 'tokens', tokens)
redis.call('HINCRBY', KEYS[4], 'spend', spend)
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ttl + 60) end
return {1, 'ok', reqs + 1, toks + tokens, reset_ms}
"""
)

SETTLE = (
    _CLOCK
    + """
local rid, tokens, spend = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if not redis.call('SET', KEYS[6], '1', 'NX', 'EX', 5356800) then return 0 end
local live = 0
local info = redis.call('HGET', KEYS[3], rid)
if info then
  local t, s, w = string.match(info, '^(%d+):(%d+):(%d+)$')
  redis.call('HINCRBY', KEYS[4], 'tokens', 0 - tonumber(t))
  redis.call('HINCRBY', KEYS[4], 'spend', 0 - tonumber(s))
  redis.call('HDEL', KEYS[3], rid)
  redis.call('ZREM', KEYS[2], rid)
  live = 1
  if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == tonumber(w) then
    redis.call('HINCRBY', KEYS[1], 'tokens', tokens - tonumber(t))
  end
end
-- A month total that is missing starts, at the next admission, from metering's record, which holds this usage
-- once ingested: creating it here would start it from this request alone and forget the month before.
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('HINCRBY', KEYS[5], 'tokens', tokens)
  redis.call('HINCRBY', KEYS[5], 'spend', spend)
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

TOTALS = (
    _CLOCK
    + _EXPIRE_ORPHANS
    + """
return {redis.call('ZCARD', KEYS[2]), tonumber(redis.call('HGET', KEYS[4], 'tokens') or 0),
        tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0), tonumber(redis.call('HGET', KEYS[5], 'spend') or 0)}
"""
)


def tenant_keys(tenant_id: int, *, request_id: str = "-") -> list[str]:
    base = f"{settings.QUILT_REDIS_KEY_PREFIX}:{{t{tenant_id}}}"
    return [
        f"{base}:win",
        f"{base}:holds",
        f"{base}:holdinfo",
        f"{base}:held",
        f"{base}:month:{current_month()}",
        f"{base}:settled:{request_id}",
    ]


class _Scripts:
    """A client and the three scripts registered on it (run by SHA, loaded on first use)."""

    def __init__(self, client):
        self.client = client
        self.acquire = client.register_script(ACQUIRE)
        self.settle = client.register_script(SETTLE)
        self.totals = client.register_script(TOTALS)
        self.peek = client.register_script(PEEK)


_async_scripts: "weakref.WeakKeyDictionary[object, _Scripts]" = weakref.WeakKeyDictionary()
_sync_scripts: _Scripts | None = None


def _on_loop() -> _Scripts:
    loop = asyncio.get_running_loop()
    scripts = _async_scripts.get(loop)
    if scripts is None:
        # Requests wait for one of a bounded set of connections rather than failing when all are busy.
        pool = redis.asyncio.BlockingConnectionPool.from_url(settings.REDIS_URL, max_connections=64, timeout=10)
        scripts = _async_scripts[loop] = _Scripts(redis.asyncio.Redis(connection_pool=pool))
    return scripts


def _blocking() -> _Scripts:
    global _sync_scripts
    if _sync_scripts is None:
        _sync_scripts = _Scripts(redis.Redis.from_url(settings.REDIS_URL))
    return _sync_scripts


def _acquire_args(request_id: str, tokens: int, spend_micros: int, limits: Limits) -> list:
    return [
        request_id, tokens, spend_micros, limits.requests_per_minute, limits.tokens_per_minute,
        limits.max_concurrent, limits.budget_tokens, limits.budget_spend_micros, settings.QUILT_HOLD_TTL_SECONDS,
    ]  # fmt: skip


def _decision(reply: list) -> Decision:
    admitted, reason, requests, tokens, reset_ms = reply
    reason = reason.decode() if isinstance(reason, bytes) else reason
    return Decision(
        admitted=bool(admitted), reason=reason, window_requests=int(requests), window_tokens=int(tokens),
        reset_ms=int(reset_ms),
    )  # fmt: skip


async def acquire(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int, limits: Limits) -> Decision:
    args = _acquire_args(request_id, tokens, spend_micros, limits)
    scripts, keys = _on_loop(), tenant_keys(tenant_id)
    decision = _decision(await scripts.acquire(keys=keys, args=args))
    if decision.reason == "month_unknown":
        recorded = await sync_to_async(month_usage_recorded)(tenant_id=tenant_id)  # rare: once a month
        await _start_month(scripts.client, keys[4], recorded)
        decision = _decision(await scripts.acquire(keys=keys, args=args))
    return decision


async def _start_month(client, key: str, recorded: tuple[int, int]) -> None:
    tokens, spend = recorded
    async with client.pipeline(transaction=True) as pipe:
        pipe.hsetnx(key, "tokens", tokens).hsetnx(key, "spend", spend).expire(key, MONTH_SECONDS)
        await pipe.execute()


async def peek(*, tenant_id: int) -> Decision:
    return _decision(await _on_loop().peek(keys=tenant_keys(tenant_id)))


async def settle(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int) -> bool:
    keys = tenant_keys(tenant_id, request_id=request_id)
    return bool(await _on_loop().settle(keys=keys, args=[request_id, tokens, spend_micros]))


def settle_sync(*, tenant_id: int, request_id: str, tokens: int, spend_micros: int) -> bool:
    keys = tenant_keys(tenant_id, request_id=request_id)
    return bool(_blocking().settle(keys=keys, args=[request_id, tokens, spend_micros]))


def totals(*, tenant_id: int) -> HeldTotals:
    live, held, month_tokens, month_spend = _blocking().totals(keys=tenant_keys(tenant_id))
    return HeldTotals(
        live_holds=int(live), held_tokens=int(held), month_tokens=int(month_tokens), month_spend_micros=int(month_spend)
    )
