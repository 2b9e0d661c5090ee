"""The Lua scripts of `RedisBackend`, one per operation, each atomic and judged by the Redis clock.

Record hash fields: `s` state (`p` in progress, `u` holder failed mid-answer, `c` completed), `f`
fingerprint, `t` fencing token, `l` lease deadline and `e` expiry (ms), `r` response blob, `x`
TTL (ms), `n`/`o`/`k` namespace, scope, key, `w` set when a repeat in another process waits on
the claim (its end is then published on the backend's channel). Replies with a record are
`{flag, now, s, f, t, l, e, r, x}`, where `r` is the blob itself only up to `APART` bytes and
otherwise its size (an integer): a big answer is then read alone, on a connection of its own (see
`RedisBackend._whole`), so it never holds the small replies behind it on the shared connection.

A completed answer kept for less than its record (`StoredResponse.replay_for`) is written to the
record, which then expires with it, and as a tombstone, `{prefix}t{<digest>}` (KEYS[2], one string:
`f t l e r x` packed with cmsgpack, `r` the tombstone's blob), which expires with the key: a claim or read that finds no
record answers the tombstone, so the key refuses a second run until its TTL ends.

A stored token equal to the caller's is the caller's own claim only while that record is in
progress (`p`) with the caller's fingerprint: the same command run again after its reply was lost.
Tokens are drawn from the OS's randomness, so nothing else carries it; a completed or failed record
is never taken for ours.
"""

from __future__ import annotations

from typing import Final

APART: Final = 256 * 1024
"""Answers above this many bytes are not in a script's reply: the caller reads them alone."""

# No record: its tombstone, if its answer expired before it (KEYS[2]), as a completed record.
_TOMBSTONE: Final = """
if not cur[1] and KEYS[2] then
  local packed = redis.call('GET', KEYS[2])
  if packed then
    local f, t, l, e, blob, x = cmsgpack.unpack(packed)
    return {TOMB, now, 'c', f, t, l, e, blob, x}
  end
end
"""

# The record's fields as replies carry them: `cur` as HMGET of s, f, t, l, e, x; then `r`, the
# blob or, above APART bytes, its size.
_CURRENT: Final = f"""
local cur = redis.call('HMGET', KEYS[1], 's', 'f', 't', 'l', 'e', 'x')
local r = redis.call('HSTRLEN', KEYS[1], 'r')
if r <= {APART} then r = redis.call('HGET', KEYS[1], 'r') end
"""

_NOW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1], its tombstone; ARGV: fingerprint, token, lease_ms, ttl_ms, namespace, scope, key (the last
# three optional: only `stale()` reads them)
CLAIM: Final = (
    _NOW
    + _CURRENT
    + _TOMBSTONE.replace("TOMB", "0")
    + """
if cur[1] then
  -- Our own claim only as it was made: this command run again after its reply was lost.
  if cur[1] == 'p' and cur[3] == ARGV[2] and cur[2] == ARGV[1] then return {1, now} end
  return {0, now, cur[1], cur[2], cur[3], cur[4], cur[5], r, cur[6]}
end
redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[1], 't', ARGV[2], 'l', now + ARGV[3], 'e', now + ARGV[4],
  'x', ARGV[4])
if ARGV[7] then redis.call('HSET', KEYS[1], 'n', ARGV[5], 'o', ARGV[6], 'k', ARGV[7]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, now}
"""
)

# KEYS[1]; ARGV: stale token, fingerprint, new token, lease_ms, ttl_ms, namespace, scope, key
TAKEOVER: Final = (
    _NOW
    + _CURRENT
    + """
if cur[1] == 'p' and cur[3] == ARGV[3] and cur[2] == ARGV[2] then return {1, now} end  -- ours, run again
if not cur[1] then return {2, now} end
if not ((cur[1] == 'p' or cur[1] == 'u') and cur[3] == ARGV[1] and tonumber(cur[4]) <= now) then
  return {0, now, cur[1], cur[2], cur[3], cur[4], cur[5], r, cur[6]}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[2], 't', ARGV[3], 'l', now + ARGV[4], 'e', now + ARGV[5], 'x', ARGV[5])
if ARGV[8] then redis.call('HSET', KEYS[1], 'n', ARGV[6], 'o', ARGV[7], 'k', ARGV[8]) end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {1, now}
"""
)

# Tell held repeats in other processes that the record changed, when one asked (`WATCH` set `w`);
# pcall: a role without the channel right still stores its answer.
_TELL: Final = """
if ARGV[CH] and redis.call('HEXISTS', KEYS[1], 'w') == 1 then pcall(redis.call, 'PUBLISH', ARGV[CH], KEYS[1]) end
"""


def _telling(at: int) -> str:
    return _TELL.replace("CH", str(at))


# KEYS[1], its tombstone; ARGV: token, response blob, ttl_ms, tombstone blob ('' for none: the
# answer lives as long as the record), the answer's own ms (replay_for), channel (optional)
COMPLETE: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 't', 'f', 'x')
if cur[2] ~= ARGV[1] then return 0 end
-- Completed already (a retried write): write the state again, so a WAIT behind this call
-- covers the record (durable claims).
if cur[1] == 'c' then redis.call('HSET', KEYS[1], 's', 'c') return 1 end
redis.call('HSET', KEYS[1], 's', 'c', 'r', ARGV[2], 'l', now, 'e', now + ARGV[3])
if KEYS[2] and ARGV[4] and ARGV[4] ~= '' then
  local packed = cmsgpack.pack(cur[3], ARGV[1], tostring(now), tostring(now + ARGV[3]), ARGV[4], cur[4] or ARGV[3])
  redis.call('SET', KEYS[2], packed, 'PX', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
"""
    + _telling(6)
    + """
return 1
"""
)

# KEYS[1]; ARGV: token, channel (optional)
RELEASE: Final = (
    """
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return 0 end
"""
    + _telling(2)
    + """
redis.call('DEL', KEYS[1])
return 1
"""
)

# KEYS[1]; ARGV: token. Deletes a claim whose caller never learned it won (so never ran the app).
# 1 deleted, 0 absent (not landed, or gone), -1 held by another token or completed.
ABANDON: Final = """
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if not cur[1] then return 0 end
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return -1 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1]; ARGV: token, lease_ms. The record outlives its TTL while its holder still runs.
EXTEND: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 't', 'l', 'e')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return 0 end
local deadline = now + ARGV[2]
if tonumber(cur[3]) < deadline then redis.call('HSET', KEYS[1], 'l', deadline) end
if tonumber(cur[4]) < deadline then
  redis.call('HSET', KEYS[1], 'e', deadline)
  redis.call('PEXPIREAT', KEYS[1], deadline)
end
return 1
"""
)

# KEYS[1]; ARGV: token, channel (optional). The holder failed mid-answer: lease over now, state 'u'.
FAIL: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 's', 'u', 'l', now)
"""
    + _telling(2)
    + """
return 1
"""
)

# KEYS[1]; ARGV: token. A repeat held in another process asks to be told when the claim ends:
# 1 (still held by `token`; `w` set), 0 (it changed already: read it again).
WATCH: Final = """
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'w', '1')
return 1
"""

# KEYS[1], its tombstone
READ: Final = (
    _NOW
    + _CURRENT
    + _TOMBSTONE.replace("TOMB", "1")
    + """
if not cur[1] then return {0, now} end
return {1, now, cur[1], cur[2], cur[3], cur[4], cur[5], r, cur[6]}
"""
)

# KEYS[1]. `idem-asgi migrate`: blank the raw scope and key of a record written with them, where the
# record still exists (never recreate an expired key). 1 rewritten, 0 gone.
BLANK_NAMES: Final = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'o', '', 'k', '')
return 1
"""
