"""Admission's Lua scripts and the Redis keys they keep: one script decides (and records) a request; another settles
its hold; the rest read totals, reconcile them with metering's record and list unreported usage.

Keys per tenant share a hash tag, so a tenant's state lives on one shard:
  win       hash  start, requests, tokens of the current one-minute window
  holds     zset  request id -> expiry (unix seconds); its size is the concurrent requests
  holdinfo  hash  request id -> "tokens:spend_micros:window_start:key:key_spend_picos"
  held      hash  tokens, spend: the sum over live holds
  month:M   hash  tokens, picos: settled usage of month M (final + provisional), its spend the sum of the requests'
                  prices in picos (no `picos`: not started, or counted by an older version); seq: final settles so far
  prov:M    hash  request id -> "tokens:picos:key:key_spend_picos" settled provisionally in month M, awaiting the final settle
  settled:R       "f" once request R is settled finally, "p:tokens:picos:key_spend" while provisionally (idempotency)
  unreported      hash  request id -> the usage event the gateway relayed (JSON), from its provisional settle until
                        metering's final one: what `unreported_usage` bills if the engine's own event never comes
  unreported_at   zset  request id -> when the gateway settled it (unix seconds)
Per API key lineage (a key and its rotations: `ApiKey.lineage`), in three hashes of the tenant (so an orphan of any
key is released by the tenant's own scripts), fields prefixed by the lineage's id K:
  keywin     K:start, K:requests, K:tokens of the key's current one-minute window
  keyheld    K:tokens, K:picos: the sum over the key's live holds
  keymonth:M K:tokens, K:picos: the key's settled usage of month M (K:picos missing: not started yet); K:seq: its
             final settles so far (reconcile's guard)
A settled spend, the tenant's and its key's, is counted in picos (1e-12, the unit metering's prices are exact to: never
rounded, so it equals the sum of its requests' billed prices; the settle's ARGV[6] is the request's price so). A hold
is the estimate's price rounded up to a micro-unit (`held`, `holdinfo`, a lease's `~L:s`), released as it was held;
the budget check compares the month's picos with the holds' micro-units times 10^6. A pico amount is handed to
HINCRBY as the digits it came in (ARGV or a stored field), never through Lua's doubles.
A hold's holdinfo carries its key and the key's pico share, so settling or expiring it releases the key's share too.

One key outside the tenants' (no hash tag, written by its own commands):
  unreported_tenants  zset  tenant id -> when a gateway last marked it (unix seconds, only ever raised): a gateway
                      marks a tenant before a provisional settle that keeps a copy (at most every
                      UNREPORTED_MARK_SECONDS per process); the unreported-usage sweep visits these tenants alone and
                      forgets one whose mark is twice that old and whose `unreported_at` is empty (FORGET_UNREPORTED:
                      only if no gateway marked it again since the sweep read its mark).
  unreported_tenants_seeded  string  set once the sweep has marked, in one walk, every tenant that keeps a copy
                      (copies kept before there were marks, or after a Redis lost its keys)

Admission leases (`gateway.admission.leases`; their scripts: `redis_lease_scripts`): a gateway process admitting a
tenant's key often takes a share of its headroom ahead in one hold, and admits requests from it without a round trip. A
lease `~L` is in `holds` as members `~L` (its budget share) and `~L.1`..`~L.<slots-1>` (concurrency slots), and in one
more hash:
  leases    hash  ~L:t, ~L:s, ~L:k, ~L:kp: the tokens, spend (micros), key lineage and key picos the lease holds now
                  (its unused share plus its admitted requests' estimates until each is settled), all added to
                  `held` (and `keyheld`) like a request's hold. Its requests and tokens of the window are in `win` (and
                  `keywin`) from the start; what it did not use is given back at its return, in the same window.
Every change of a lease's amounts is an HINCRBY, so its settles may reach Redis in any order; the one that ends it
(its return with nothing in flight, or its last request's settle after its return) releases whatever is left. An
orphaned lease (its process died) expires with its members, like any hold.
"""

LEASE_FUNCTIONS = """
local function lease_release(id)
  local t = redis.call('HGET', KEYS[13], id .. ':t')
  if not t then return end
  local s = redis.call('HGET', KEYS[13], id .. ':s') or '0'
  local k = redis.call('HGET', KEYS[13], id .. ':k') or ''
  local kp = redis.call('HGET', KEYS[13], id .. ':kp') or '0'
  redis.call('HINCRBY', KEYS[4], 'tokens', 0 - tonumber(t))
  redis.call('HINCRBY', KEYS[4], 'spend', 0 - tonumber(s))
  if k ~= '' then
    redis.call('HINCRBY', KEYS[9], k .. ':tokens', 0 - tonumber(t))
    if tonumber(kp) > 0 then redis.call('HINCRBY', KEYS[9], k .. ':picos', '-' .. kp) end
  end
  redis.call('HDEL', KEYS[13], id .. ':t', id .. ':s', id .. ':k', id .. ':kp')
end
local function lease_take(id, t, s, kp)
  if redis.call('HEXISTS', KEYS[13], id .. ':t') == 0 then return end
  redis.call('HINCRBY', KEYS[13], id .. ':t', 0 - t)
  redis.call('HINCRBY', KEYS[13], id .. ':s', 0 - s)
  redis.call('HINCRBY', KEYS[4], 'tokens', 0 - t)
  redis.call('HINCRBY', KEYS[4], 'spend', 0 - s)
  local k = redis.call('HGET', KEYS[13], id .. ':k') or ''
  if k ~= '' then
    redis.call('HINCRBY', KEYS[9], k .. ':tokens', 0 - t)
    if kp ~= '0' and kp ~= '' then
      redis.call('HINCRBY', KEYS[9], k .. ':picos', '-' .. kp)
      redis.call('HINCRBY', KEYS[13], id .. ':kp', '-' .. kp)
    end
  end
end
local function lease_return(a)
  -- ARGV[a..a+9]: id, window, key, unused requests, unused window tokens, unused tokens, spend and key picos of
  -- the budget share, its slots, and how many of them stay (requests still in flight)
  local id = ARGV[a]
  if id == nil or id == '' then return end
  local w, key = tonumber(ARGV[a + 1]), ARGV[a + 2]
  local r, wt = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == w then
    redis.call('HINCRBY', KEYS[1], 'requests', 0 - r)
    redis.call('HINCRBY', KEYS[1], 'tokens', 0 - wt)
  end
  if key ~= '' and tonumber(redis.call('HGET', KEYS[8], key .. ':start') or -1) == w then
    redis.call('HINCRBY', KEYS[8], key .. ':requests', 0 - r)
    redis.call('HINCRBY', KEYS[8], key .. ':tokens', 0 - wt)
  end
  local slots, keep = tonumber(ARGV[a + 8]), tonumber(ARGV[a + 9])
  if keep == 0 then
    lease_release(id)
    redis.call('ZREM', KEYS[2], id)
  else
    lease_take(id, tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), ARGV[a + 7])
  end
  local gone = {}
  for i = math.max(keep, 1), slots - 1 do gone[#gone + 1] = id .. '.' .. i end
  if #gone > 0 then redis.call('ZREM', KEYS[2], unpack(gone)) end
end
"""

EXPIRE_ORPHANS = """
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
  elseif string.sub(id, 1, 1) == '~' then
    lease_release(id)
  end
  redis.call('ZREM', KEYS[2], id)
end
"""

CLOCK = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local window = math.floor(now / 60) * 60
"""

# What every admission checks, in order (the reasons are `limits.Decision.reason`'s); it ends with the key's own
# window read (`key_reqs`, `key_toks`) and nothing written.
CHECKS = """
local rid, tokens, spend = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local rpm, tpm, maxc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local budget_tokens, budget_spend, ttl = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local reqs, toks = 0, 0
if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == window then
  reqs = tonumber(redis.call('HGET', KEYS[1], 'requests') or 0)
  toks = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
end
local reset_ms = math.ceil((window + 60 - now) * 1000)
if reqs + 1 > rpm then return {0, 'requests', reqs, toks, reset_ms, 0, 0} end
if toks + tokens > tpm then return {0, 'tokens', reqs, toks, reset_ms, 0, 0} end
local live = redis.call('ZCARD', KEYS[2])
if live + 1 > maxc then return {0, 'concurrency', reqs, toks, reset_ms, 0, 0} end
if redis.call('HEXISTS', KEYS[5], 'picos') == 0 then
  return {0, 'month_unknown', reqs, toks, reset_ms, 0, 0}
end
local used_t = tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0)
local used_p = tonumber(redis.call('HGET', KEYS[5], 'picos'))
local used_s = used_p / 1000000  -- in the holds' micro-units (a lease's room)
local held_t = tonumber(redis.call('HGET', KEYS[4], 'tokens') or 0)
local held_s = tonumber(redis.call('HGET', KEYS[4], 'spend') or 0)
if budget_tokens >= 0 and used_t + held_t + tokens > budget_tokens then
  if used_t + tokens > budget_tokens then return {0, 'budget_tokens', reqs, toks, reset_ms, 0, 0} end
  return {0, 'budget_held', reqs, toks, reset_ms, 0, 0}
end
if budget_spend >= 0 and used_p + (held_s + spend) * 1000000 > budget_spend * 1000000 then
  if used_p + spend * 1000000 > budget_spend * 1000000 then return {0, 'budget_spend', reqs, toks, reset_ms, 0, 0} end
  return {0, 'budget_held', reqs, toks, reset_ms, 0, 0}
end
local key, key_rpm, key_tpm, key_budget = ARGV[10], tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local key_spend = ARGV[14]  -- picos, as digits
local key_reqs, key_toks, key_used, key_held = 0, 0, 0, 0
if key ~= '' then
  if tonumber(redis.call('HGET', KEYS[8], key .. ':start') or -1) == window then
    key_reqs = tonumber(redis.call('HGET', KEYS[8], key .. ':requests') or 0)
    key_toks = tonumber(redis.call('HGET', KEYS[8], key .. ':tokens') or 0)
  end
  if key_rpm >= 0 and key_reqs + 1 > key_rpm then return {0, 'key_requests', key_reqs, key_toks, reset_ms, key_reqs, key_toks} end
  if key_tpm >= 0 and key_toks + tokens > key_tpm then return {0, 'key_tokens', key_reqs, key_toks, reset_ms, key_reqs, key_toks} end
  if key_budget >= 0 then
    local recorded = redis.call('HGET', KEYS[10], key .. ':picos')
    if not recorded then return {0, 'key_month_unknown', reqs, toks, reset_ms, key_reqs, key_toks} end
    key_used = tonumber(recorded)
    key_held = tonumber(redis.call('HGET', KEYS[9], key .. ':picos') or 0)
    if key_used + key_held + tonumber(key_spend) > key_budget then
      if key_used + tonumber(key_spend) > key_budget then return {0, 'key_budget_spend', reqs, toks, reset_ms, key_reqs, key_toks} end
      return {0, 'key_budget_held', reqs, toks, reset_ms, key_reqs, key_toks}
    end
  end
end
"""

# The window's requests and tokens counted for `n` requests of this one's estimate (one, or a lease's).
COUNT = """
if key ~= '' then
  redis.call('HSET', KEYS[8], key .. ':start', window, key .. ':requests', key_reqs + n, key .. ':tokens', key_toks + n * tokens)
  redis.call('EXPIRE', KEYS[8], 120)
end
redis.call('HSET', KEYS[1], 'start', window, 'requests', reqs + n, 'tokens', toks + n * tokens)
redis.call('EXPIRE', KEYS[1], 120)
"""

# One request's own hold.
HOLD = """
if key ~= '' then
  redis.call('HINCRBY', KEYS[9], key .. ':tokens', tokens)
  redis.call('HINCRBY', KEYS[9], key .. ':picos', key_spend)
  redis.call('EXPIRE', KEYS[9], ttl + 60)
end
redis.call('ZADD', KEYS[2], now + ttl, rid)
redis.call('HSET', KEYS[3], rid, string.format('%d:%d:%d:%s:', tokens, spend, window, key) .. (key ~= '' and key_spend or '0'))
redis.call('HINCRBY', KEYS[4], 'tokens', tokens)
redis.call('HINCRBY', KEYS[4], 'spend', spend)
for i = 2, 4 do redis.call('EXPIRE', KEYS[i], ttl + 60) end
"""

ACQUIRE = (
    LEASE_FUNCTIONS
    + CLOCK
    + EXPIRE_ORPHANS
    + CHECKS
    + "local n = 1\n"
    + COUNT
    + HOLD
    + """
if key == '' then return {1, 'ok', reqs + 1, toks + tokens, reset_ms, 0, 0} end
return {1, 'ok', reqs + 1, toks + tokens, reset_ms, key_reqs + 1, key_toks + tokens}
"""
)

SETTLE = (
    LEASE_FUNCTIONS
    + CLOCK
    + """
local rid, tokens, final = ARGV[1], tonumber(ARGV[2]), ARGV[4] == '1'  -- ARGV[3] (micro-units) is not counted
local key, key_spend, usage = ARGV[5] or '', ARGV[6] or '0', ARGV[7] or ''
local lease = ARGV[8] or ''
if lease ~= '' then  -- admitted from a lease: its estimate leaves the lease's hold, whatever came before
  if ARGV[13] == '1' then  -- the lease's last request, after its return: the lease ends
    lease_release(lease)
    redis.call('ZREM', KEYS[2], lease)
  else
    lease_take(lease, tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11])
  end
  if ARGV[12] ~= '' then redis.call('ZREM', KEYS[2], ARGV[12]) end
  if ARGV[14] ~= '' then  -- the lease was given back: the window's tokens corrected here, not in the lease
    if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == tonumber(ARGV[14]) then
      redis.call('HINCRBY', KEYS[1], 'tokens', tonumber(ARGV[15]))
    end
    if key ~= '' and tonumber(redis.call('HGET', KEYS[8], key .. ':start') or -1) == tonumber(ARGV[14]) then
      redis.call('HINCRBY', KEYS[8], key .. ':tokens', tonumber(ARGV[15]))
    end
  end
end
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
local counted = redis.call('HEXISTS', KEYS[5], 'picos') == 1
if counted then
  redis.call('HINCRBY', KEYS[5], 'tokens', tokens - tonumber(pt))
  redis.call('HINCRBY', KEYS[5], 'picos', key_spend)
  if ps ~= '0' then redis.call('HINCRBY', KEYS[5], 'picos', '-' .. ps) end
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
local counted_t, counted_p = 0, '0'
if counted then counted_t, counted_p = tokens, key_spend end
redis.call('SET', KEYS[6], string.format('p:%d:%s:', counted_t, counted_p) .. kp, 'EX', 5356800)
if counted or kp ~= '0' then
  redis.call('HSET', KEYS[7], rid, string.format('%d:%s:%s:', counted_t, counted_p, key) .. kp)
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
    CLOCK
    + """
local reqs, toks, key, key_reqs, key_toks = 0, 0, ARGV[1], 0, 0
if tonumber(redis.call('HGET', KEYS[1], 'start') or -1) == window then
  reqs = tonumber(redis.call('HGET', KEYS[1], 'requests') or 0)
  toks = tonumber(redis.call('HGET', KEYS[1], 'tokens') or 0)
end
if key ~= '' and tonumber(redis.call('HGET', KEYS[8], key .. ':start') or -1) == window then
  key_reqs = tonumber(redis.call('HGET', KEYS[8], key .. ':requests') or 0)
  key_toks = tonumber(redis.call('HGET', KEYS[8], key .. ':tokens') or 0)
end
return {1, 'ok', reqs, toks, math.ceil((window + 60 - now) * 1000), key_reqs, key_toks}
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
    LEASE_FUNCTIONS
    + CLOCK
    + EXPIRE_ORPHANS
    + _PROVISIONAL_SUMS
    + """
return {redis.call('ZCARD', KEYS[2]), tonumber(redis.call('HGET', KEYS[4], 'tokens') or 0),
        tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0), redis.call('HGET', KEYS[5], 'picos') or '0',
        pt, string.format('%d', ps), redis.call('HEXISTS', KEYS[5], 'picos'),
        tonumber(redis.call('HGET', KEYS[5], 'seq') or 0)}
"""
)

RECONCILE = (
    _PROVISIONAL_SUMS
    + """
if redis.call('HEXISTS', KEYS[5], 'picos') == 0 then return {-1, 0, 0} end
if tonumber(redis.call('HGET', KEYS[5], 'seq') or 0) ~= tonumber(ARGV[3]) then return {0, 0, 0} end
local before_t = tonumber(redis.call('HGET', KEYS[5], 'tokens') or 0)
local before_p = redis.call('HGET', KEYS[5], 'picos')
redis.call('HSET', KEYS[5], 'tokens', tonumber(ARGV[1]) + pt, 'picos', ARGV[2])
if ps > 0 then redis.call('HINCRBY', KEYS[5], 'picos', string.format('%d', ps)) end
return {1, before_t, before_p}
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

MARK_UNREPORTED = """
redis.call('ZADD', KEYS[1], 'GT', ARGV[2], ARGV[1])
return 0
"""

FORGET_UNREPORTED = """
if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or -1) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
"""
