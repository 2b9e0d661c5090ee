"""What a key costs each store before and after its answer's horizon (`replay_ttl`), and so what a
30-day key window costs at a million new keys a day.

For each store, `--keys` records are completed with a typical payment answer (a JSON body of
`--body` bytes, `Content-Type`, `Location` and a request id) under a 30-day `ttl`, and measured;
then as many again with a `replay_for` of one second, measured once they shrank to their
tombstones (the store's own way: memory at `purge()`, Redis by expiry, Postgres by `purge()`):

- memory: the process's traced allocations (tracemalloc) per key;
- Redis: `MEMORY USAGE` of each key (the record hash; then its tombstone string), the mean;
- Postgres: the table's row size, `pg_column_size` of the whole row (the heap tuple's data; add
  ~28 bytes of tuple header and line pointer, and ~60 bytes of index entries per row).

    python -m benchmarks.bench_horizons
    python -m benchmarks.bench_horizons --stores memory,redis,postgres --keys 2000 --summary out.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tracemalloc
import uuid
from datetime import UTC, datetime
from typing import Any

from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.records import Claimed, RecordKey, StoredResponse
from tests.support.servers import POSTGRES_DSN, REDIS_URL, reachable

from .figures import append

KEEP = 1.0  # seconds: the answers' replay_for in this run (shrunk after it)
TTL = 30 * 86_400.0  # the key window: 30 days


def answer(size: int, n: int, keep: float) -> StoredResponse:
    pid = f"pay_{uuid.uuid4().hex[:24]}"
    text = json.dumps({"id": pid, "object": "payment", "amount": 1000 + n, "currency": "eur", "status": "succeeded"})
    body = (text[:-1] + ', "metadata": {"note": "' + "x" * max(0, size - len(text) - 25) + '"}}').encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"location", f"/v1/payments/{pid}".encode()),
        (b"x-request-id", uuid.uuid4().hex.encode()),
    ]
    return StoredResponse(201, headers, body, replay_for=keep)


async def fill(store: Backend, namespace: str, keys: int, size: int, keep: float = TTL) -> list[RecordKey]:
    made = []
    for n in range(keys):
        key = RecordKey.build(namespace, None, f"key-{n}")
        claimed = await store.claim(key, b"f" * 32, lease=30, ttl=TTL)
        assert isinstance(claimed, Claimed)
        assert await store.complete(key, claimed.token, answer(size, n, keep), ttl=TTL)
        made.append(key)
    return made


async def memory(keys: int, size: int) -> tuple[float, float]:
    sizes = []
    for keep in (TTL, KEEP):
        tracemalloc.start()
        store = MemoryBackend(max_entries=keys + 10, max_bytes=1 << 30)
        base = tracemalloc.get_traced_memory()[0]
        await fill(store, "bench", keys, size, keep)
        await asyncio.sleep(keep + 0.1 if keep == KEEP else 0)
        await store.purge()
        sizes.append((tracemalloc.get_traced_memory()[0] - base) / keys)
        tracemalloc.stop()
        del store
    return sizes[0], sizes[1]


async def redis(keys: int, size: int) -> tuple[float, float]:
    from idem_asgi.backends.redis import RedisBackend

    prefix = f"bench-horizon:{uuid.uuid4().hex[:8]}:"
    store = RedisBackend.from_url(REDIS_URL, prefix=prefix)
    client = store.client
    try:
        kept = [store._keys(k)[0] for k in await fill(store, "kept", keys, size)]
        full = statistics.mean([await client.memory_usage(name) for name in kept])
        await client.delete(*kept)
        names = [store._keys(k) for k in await fill(store, "shrunk", keys, size, KEEP)]
        await asyncio.sleep(KEEP + 0.2)
        after = []
        for record, tombstone in names:
            assert not await client.exists(record)
            after.append(await client.memory_usage(tombstone))
        await client.delete(*(t for _, t in names))
        return full, statistics.mean(after)
    finally:
        await store.aclose()


async def postgres(keys: int, size: int) -> tuple[float, float]:
    import asyncpg

    from idem_asgi.backends.postgres import PostgresBackend

    table = f"bench_horizon_{uuid.uuid4().hex[:8]}"
    store = PostgresBackend.from_dsn(POSTGRES_DSN, table=table)
    await store.setup()
    conn = await asyncpg.connect(POSTGRES_DSN)
    size_sql = f"SELECT avg(pg_column_size(t.*))::float8 FROM {table} AS t WHERE namespace = $1"
    try:
        await fill(store, "kept", keys, size)
        await fill(store, "shrunk", keys, size, KEEP)
        await asyncio.sleep(KEEP + 0.1)
        await store.purge()
        return await conn.fetchval(size_sql, "kept"), await conn.fetchval(size_sql, "shrunk")
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.close()
        await store.aclose()


async def main_async(args: argparse.Namespace) -> None:
    run = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    per_day = 1_000_000
    print(f"{args.keys} keys per store, a {args.body}-byte JSON body; 30-day window, {per_day:,} new keys a day")
    print(
        f"{'store':<9} {'bytes/key before':>17} {'after':>7} {'30 days, one horizon':>21} {'with replay_ttl=24h':>20}"
    )
    for kind in args.stores.split(","):
        if kind != "memory" and not reachable(REDIS_URL if kind == "redis" else POSTGRES_DSN):
            print(f"{kind:<9} (not reachable: skipped)")
            continue
        measure = {"memory": memory, "redis": redis, "postgres": postgres}[kind]
        full, tomb = await measure(args.keys, args.body)
        one = 30 * per_day * full
        two = per_day * full + 29 * per_day * tomb
        print(f"{kind:<9} {full:>17.0f} {tomb:>7.0f} {one / 1e9:>18.1f} GB {two / 1e9:>17.1f} GB")
        if args.summary:
            row: dict[str, Any] = {"kind": "horizon", "run": run, "store": kind, "keys": args.keys}
            row |= {"body": args.body, "full_bytes": round(full), "tombstone_bytes": round(tomb)}
            row |= {"gb_one_horizon": round(one / 1e9, 1), "gb_two_horizons": round(two / 1e9, 1)}
            append(args.summary, row)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", default="memory,redis,postgres")
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--body", type=int, default=400, help="bytes of each answer's JSON body")
    p.add_argument("--summary", default="", help="also append each store's figures as a JSON line here")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
