"""Each key's history on Redis: a list beside the record, `{prefix}h{<digest>}`.

The same hash tag as the record, so both sit in one Cluster slot; outside `{prefix}{*}`, so no scan
of records meets it. One script appends each key's steps (a repeat counted into the last step when it repeats it:
`history.COUNTED`), keeps the last N (`LTRIM`) and makes the list live as long as its record (or
the claim's TTL, once the record is gone: released, say): one call per batch of up to `PER_CALL`
keys (per key on a cluster), on the same connections as the claims, never on a request's path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from ...history import COUNTED, KEEP, Step, decode_step, encode_step

if TYPE_CHECKING:
    from ...records import RecordKey
    from ._stale import Scanned

APPEND: Final = """
local keep = tonumber(ARGV[1])
local a = 2
for i = 1, #KEYS, 2 do
  local list, record = KEYS[i], KEYS[i + 1]
  local ttl, n = tonumber(ARGV[a]), tonumber(ARGV[a + 2])
  local first = a + 3
  local start = first
  if ARGV[a + 1] == '1' then
    local last = redis.call('LINDEX', list, -1)
    if last then
      local x, y = cjson.decode(last), cjson.decode(ARGV[first])
      if x.what == y.what and (x.token or '') == (y.token or '') then
        x.n = (x.n or 1) + (y.n or 1)
        redis.call('LSET', list, -1, cjson.encode(x))
        start = first + 1
      end
    end
  end
  if start < first + n then redis.call('RPUSH', list, unpack(ARGV, start, first + n - 1)) end
  redis.call('LTRIM', list, -keep, -1)
  local left = redis.call('PTTL', record)
  if left > ttl then ttl = left end
  local mine = redis.call('PTTL', list)
  if mine > ttl then ttl = mine end
  redis.call('PEXPIRE', list, ttl)
  a = first + n
end
return 1
"""
PER_CALL: Final = 256
"""Keys per script call: a batch of thousands runs as several short scripts, never one long one."""


def list_name(prefix: str, key: RecordKey) -> str:
    return f"{prefix}h{{{key.digest}}}"


def calls(
    prefix: str, keep: int, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]], *, per_key: bool
) -> Iterator[tuple[list[str], list[Any]]]:
    """The script calls (keys, args) that write `batch`: `PER_CALL` keys each, or one key each on a
    cluster (a script's keys must share a slot; a key's list and record do, by their hash tag)."""
    size = 1 if per_key else PER_CALL
    rows = [row for row in batch if row[2]]
    for at in range(0, len(rows), size):
        keys: list[str] = []
        args: list[Any] = [keep or KEEP]
        for key, ttl, steps in rows[at : at + size]:
            keys += [list_name(prefix, key), f"{prefix}{{{key.digest}}}"]
            args += [max(1, round(ttl * 1000)), "1" if steps[0].what in COUNTED else "0", len(steps)]
            args += map(encode_step, steps)
        yield keys, args


async def read(store: Scanned, key: RecordKey) -> list[Step]:
    async with store._tool_call():
        items: list[Any] = await store.client.lrange(list_name(store.prefix, key), 0, -1)
    return [decode_step(item) for item in items]
