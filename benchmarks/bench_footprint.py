"""Bytes per request and per record at rest: the figures behind `docs/scaling.md`.

The middleware runs in-process (as in `bench_roundtrips`: a 201 answer with a ~45-byte JSON body
and a 34-byte request body), N new keys then N replays, against a private redis-server on a free
port (nothing else talks to it, so its counters are ours) and the local Postgres.

- Redis: bytes received and sent by the server per request (`INFO stats`
  `total_net_input_bytes` / `total_net_output_bytes`), `MEMORY USAGE` of a completed record and
  `used_memory` growth per record.
- Postgres: bytes per row and per index entry of the backend's own table (`pg_table_size`,
  `pg_indexes_size` after `VACUUM`), WAL bytes written per request (`pg_current_wal_lsn`) and the
  CPU of every local `postgres` process per request (from `/proc`: run it on a quiet machine).

    python -m benchmarks.bench_footprint
    python -m benchmarks.bench_footprint --n 5000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from benchmarks.bench_roundtrips import phases, policy, throwaway_redis
from idem_asgi import IdempotencyMiddleware
from tests.support.servers import POSTGRES_DSN, reachable


async def redis_footprint(url: str, n: int) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from benchmarks.bench_roundtrips import app
    from idem_asgi.backends.redis import RedisBackend

    backend = RedisBackend.from_url(url, prefix="idem:")
    admin = aioredis.Redis.from_url(url)
    try:
        mw = IdempotencyMiddleware(app, backend=backend, routes=policy())

        async def before() -> tuple[int, int, int, int]:
            stats, memory = await admin.info("stats"), await admin.info("memory")
            cpu = (await admin.info("commandstats")).get("cmdstat_evalsha", {}).get("usec", 0)
            return (
                int(stats["total_net_input_bytes"]),
                int(stats["total_net_output_bytes"]),
                int(memory["used_memory"]),
                int(cpu),
            )

        async def after(snapshot: tuple[int, int, int, int]) -> dict[str, Any]:
            now = await before()
            return {
                "bytes_to_redis_per_request": round((now[0] - snapshot[0]) / n),
                "bytes_from_redis_per_request": round((now[1] - snapshot[1]) / n),
                "used_memory_growth_per_request": round((now[2] - snapshot[2]) / n),
                "redis_script_cpu_us_per_request": round((now[3] - snapshot[3]) / n, 1),
            }

        result = await phases(mw, n, before, after)
        names = [k async for k in admin.scan_iter(match="idem:*", count=1000)][:200]
        usage = [int(await admin.memory_usage(k) or 0) for k in names]
        result["memory_usage_per_record"] = round(sum(usage) / len(usage))
        return result
    finally:
        await admin.aclose()
        await backend.aclose()


async def postgres_footprint(dsn: str, n: int) -> dict[str, Any]:
    import asyncpg

    from benchmarks.bench_roundtrips import app
    from idem_asgi.backends.postgres import PostgresBackend

    table = f"idem_bench_fp_{uuid.uuid4().hex[:8]}"
    backend = PostgresBackend.from_dsn(dsn, table=table)
    admin = await asyncpg.connect(dsn)
    try:
        mw = IdempotencyMiddleware(app, backend=backend, routes=policy())

        async def before() -> tuple[int, float]:
            return int(await admin.fetchval("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")), postgres_cpu()

        async def after(snapshot: tuple[int, float]) -> dict[str, Any]:
            wal, cpu = await before()
            return {
                "wal_bytes_per_request": round((wal - snapshot[0]) / n),
                "postgres_cpu_us_per_request": round((cpu - snapshot[1]) / n * 1e6, 1),
            }

        result = await phases(mw, n, before, after)
        await admin.execute(f'VACUUM "{table}"')
        rows, size, indexes = await admin.fetchrow(
            f'SELECT count(*), pg_table_size($1::regclass), pg_indexes_size($1::regclass) FROM "{table}"', table
        )
        result["rows"] = rows
        result["table_bytes_per_row"] = round(size / rows)
        result["index_bytes_per_row"] = round(indexes / rows)
        return result
    finally:
        await backend.aclose()
        await admin.execute(f'DROP TABLE IF EXISTS "{table}"')
        await admin.close()


def postgres_cpu() -> float:
    """CPU seconds used so far by every local `postgres` process (backends, WAL writer,
    checkpointer): the server's whole cost, on a machine where nothing else uses that Postgres."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
        except OSError:
            continue  # the process ended
        if fields[0].endswith("(postgres"):
            rest = fields[1].split()
            total += int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"n": args.n}
    if shutil.which("redis-server"):
        with throwaway_redis() as url:
            out["redis"] = await redis_footprint(url, args.n)
    if reachable(args.postgres_dsn):
        out["postgres"] = await postgres_footprint(args.postgres_dsn, args.n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="new keys, then as many replays")
    p.add_argument("--postgres-dsn", default=POSTGRES_DSN)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
        return 0
    for store in ("redis", "postgres"):
        if store not in result:
            print(f"{store}: not reachable, skipped", file=sys.stderr)
            continue
        r = result[store]
        for phase in ("new", "replay"):
            figures = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r[phase].items() if k != "seconds")
            print(f"{store:<9}{phase:<8}{figures}")
        rest = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r.items() if k not in ("new", "replay"))
        print(f"{store:<9}{'at rest':<8}{rest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
