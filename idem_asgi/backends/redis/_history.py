"""Each key's history on Redis: a list beside the record, `{prefix}h{<digest>}`.

The same hash tag as the record, so both sit in one Cluster slot; outside `{prefix}{*}`, so no scan
of records meets it. One script per key appends the steps (a repeat counted into the last step when it repeats it:
`history.COUNTED`), keeps the last N (`LTRIM`) and makes the
list live as long as its record (or the claim's TTL, once the record is gone: released, say). A
batch of keys is one pipelined round trip on the tools' client, never on a request's path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ...history import COUNTED, KEEP, Step, decode_step, encode_step

if TYPE_CHECKING:
    from ...records import RecordKey
    from ._stale import Scanned

APPEND: Final = """
local start = 4
if ARGV[3] == '1' then
  local last = redis.call('LINDEX', KEYS[1], -1)
  if last then
    local a, b = cjson.decode(last), cjson.decode(ARGV[4])
    if a.what == b.what and (a.token or '') == (b.token or '') then
      a.n = (a.n or 1) + (b.n or 1)
      redis.call('LSET', KEYS[1], -1, cjson.encode(a))
      start = 5
    end
  end
end
if #ARGV >= start then redis.call('RPUSH', KEYS[1], unpack(ARGV, start)) end
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[1]), -1)
local ttl = tonumber(ARGV[2])
local left = redis.call('PTTL', KEYS[2])
if left > ttl then ttl = left end
local mine = redis.call('PTTL', KEYS[1])
if mine > ttl then ttl = mine end
redis.call('PEXPIRE', KEYS[1], ttl)
return 1
"""


def list_name(prefix: str, key: RecordKey) -> str:
    return f"{prefix}h{{{key.digest}}}"


async def write(store: Scanned, keep: int, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
    keep = keep or KEEP
    async with store._tool_call():
        pipe = store.client.pipeline(transaction=False) if not store._cluster else store.client.pipeline()
        for key, ttl, steps in batch:
            if steps:
                record = f"{store.prefix}{{{key.digest}}}"
                ms = max(1, round(ttl * 1000))
                counted = "1" if steps[0].what in COUNTED else "0"
                pipe.eval(APPEND, 2, list_name(store.prefix, key), record, keep, ms, counted, *map(encode_step, steps))
        await pipe.execute()


async def read(store: Scanned, key: RecordKey) -> list[Step]:
    async with store._tool_call():
        items: list[Any] = await store.client.lrange(list_name(store.prefix, key), 0, -1)
    return [decode_step(item) for item in items]
