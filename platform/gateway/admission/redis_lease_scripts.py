"""Admission leases' own scripts (`leases`; the keys and how a lease is held: `redis_scripts`): LEASE admits a
request, from a new lease where every limit has room for one, and LEASE_RETURN gives a lease back."""

from gateway.admission.redis_scripts import CHECKS, CLOCK, COUNT, EXPIRE_ORPHANS, HOLD, LEASE_FUNCTIONS

# Admits one request as ACQUIRE does, first giving back the process's previous lease of this tenant's key
# (ARGV[19..28], `lease_return`). Where every limit has room for it, the request is admitted from a new lease: `n`
# requests of its estimate (at most ARGV[16], and at most 1/ARGV[18] of each limit's room) and `c` concurrency slots
# (at most ARGV[17], and 1/ARGV[18] of the room), held as `~<ARGV[15]>` and its slots. Where a lease would be fewer
# than four requests (or two slots), the request gets its own hold, as ACQUIRE gives it (n = 0 in the reply). Its reply:
# ACQUIRE's seven fields (a refusal's are all), then the window's start, n, c and the window's counts before them.
LEASE = (
    LEASE_FUNCTIONS
    + CLOCK
    + "lease_return(19)\n"
    + EXPIRE_ORPHANS
    + CHECKS
    + """
local share = tonumber(ARGV[18])
local n, c = tonumber(ARGV[16]), math.min(tonumber(ARGV[17]), math.floor((maxc - live) / share))
local function room(free, each)
  if each > 0 then n = math.min(n, math.floor(free / each / share)) end
end
room(rpm - reqs, 1)
room(tpm - toks, tokens)
if budget_tokens >= 0 then room(budget_tokens - used_t - held_t, tokens) end
if budget_spend >= 0 then room(budget_spend - used_s - held_s, spend) end
if key ~= '' then
  if key_rpm >= 0 then room(key_rpm - key_reqs, 1) end
  if key_tpm >= 0 then room(key_tpm - key_toks, tokens) end
  if key_budget >= 0 then room(key_budget - key_used - key_held, tonumber(key_spend)) end
  if tonumber(key_spend) > 0 then n = math.min(n, math.floor(2 ^ 52 / tonumber(key_spend))) end
end
local kr, kt = 0, 0
if n < 4 or c < 2 then
  n = 1
  if key ~= '' then kr, kt = key_reqs + 1, key_toks + tokens end
"""
    + COUNT
    + HOLD
    + """
  return {1, 'ok', reqs + 1, toks + tokens, reset_ms, kr, kt, window, 0, 0, reqs, toks, key_reqs, key_toks}
end
"""
    + COUNT
    + """
local id, picos = '~' .. ARGV[15], '0'
if key ~= '' then
  kr, kt = key_reqs + 1, key_toks + tokens
  picos = string.format('%d', n * tonumber(key_spend))
  redis.call('HINCRBY', KEYS[9], key .. ':tokens', n * tokens)
  if picos ~= '0' then redis.call('HINCRBY', KEYS[9], key .. ':picos', picos) end
  redis.call('EXPIRE', KEYS[9], ttl + 60)
end
redis.call('HSET', KEYS[13], id .. ':t', n * tokens, id .. ':s', n * spend, id .. ':k', key, id .. ':kp', picos)
local members = {now + ttl, id}
for i = 1, c - 1 do
  members[#members + 1] = now + ttl
  members[#members + 1] = id .. '.' .. i
end
redis.call('ZADD', KEYS[2], unpack(members))
redis.call('HINCRBY', KEYS[4], 'tokens', n * tokens)
redis.call('HINCRBY', KEYS[4], 'spend', n * spend)
for _, i in ipairs({2, 4, 13}) do redis.call('EXPIRE', KEYS[i], ttl + 60) end
return {1, 'ok', reqs + 1, toks + tokens, reset_ms, kr, kt, window, n, c, reqs, toks, key_reqs, key_toks}
"""
)

# Gives a lease back (ARGV[1..10], `lease_return`) outside any admission: when idle, or at its window's end.
LEASE_RETURN = LEASE_FUNCTIONS + "lease_return(1)\nreturn 1\n"
