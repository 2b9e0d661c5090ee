"""What a 30-day TTL costs on Postgres: claim latency on a table of a million records vs an empty one.

Two tables with the backend's own DDL: one empty, one filled with `--rows` completed records
(by one `INSERT ... SELECT generate_series`, then `VACUUM ANALYZE`, the state autovacuum keeps a
steady table in). Expiry times are spread over days 1 to 30, with 1 % already past their TTL so the
purge can be timed too. Then, alternating between the two tables in blocks so both see the same
background load, one request at a time:

- new: a claim on a fresh key (the INSERT arm), followed by its completion (timed apart);
- replay: a claim on a key that exists and is completed (a plain read), random over the table.

Printed: p50/p99/mean per operation and table, the large/empty ratio, the fill time, the
table's size on disk, and the time to purge the expired 1 %, with new keys and replays measured
on the large table *while* that purge runs (does it hold claims up?). Both tables are dropped at
the end. `--summary FILE` appends the figures the docs quote (benchmarks/figures.py).

    python -m benchmarks.bench_postgres_table
    python -m benchmarks.bench_postgres_table --rows 200000 --samples 1000 --json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import sys
import time
import uuid
from typing import Any

import asyncpg

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.postgres._store import _headers_encode
from idem_asgi.records import Claimed, Existing, RecordKey, StoredResponse
from tests.support.servers import POSTGRES_DSN

DAY = 86_400
TTL = 30 * DAY
BLOCK = 100
HEADERS = [(b"content-type", b"application/json")]

FILL = """
INSERT INTO {table} (namespace, scope, key, state, fingerprint, token, lease_until, expires_at, created_at,
                     status, headers, body, replayable)
SELECT 'bench', '', E'\\x1f' || encode(sha256(  -- the key as the store keeps it: its digest (RecordKey.build)
         int4send(5) || convert_to('bench', 'UTF8')
         || int4send(octet_length('tenant-' || (i % 1000))) || convert_to('tenant-' || (i % 1000), 'UTF8')
         || int4send(32) || convert_to(md5(i::text), 'UTF8')), 'hex'),
       'c', sha256(int8send(i)), i,
       e - interval '30 days', e, e - interval '30 days',
       201, $2::bytea,
       convert_to('{{"id":"pay_' || md5(i::text) || '","status":"succeeded","amount":' || i || ',"currency":"EUR"}}',
                  'UTF8'),
       true
FROM generate_series(1, $1::int) AS i,
     LATERAL (SELECT CASE WHEN i % 100 = 0 THEN now() - interval '1 hour'
                          ELSE now() + (86400 + i % ({ttl} - 86400)) * interval '1 second' END AS e) AS x
"""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50_us": round(percentile(samples, 0.50) * 1e6, 1),
        "p99_us": round(percentile(samples, 0.99) * 1e6, 1),
        "mean_us": round(statistics.fmean(samples) * 1e6, 1),
    }


class Side:
    """One table under test, and the latencies measured on it."""

    def __init__(self, name: str, backend: PostgresBackend, replay_keys: list[RecordKey]) -> None:
        self.name = name
        self.backend = backend
        self.replay_keys = replay_keys
        self.times: dict[str, list[float]] = {"new": [], "complete": [], "replay": []}

    async def new_keys(self, n: int) -> None:
        for _ in range(n):
            key = RecordKey.build("bench", f"tenant-{random.randrange(1000)}", uuid.uuid4().hex)
            started = time.perf_counter()
            claimed = await self.backend.claim(key, b"fp" * 16, lease=30, ttl=TTL)
            self.times["new"].append(time.perf_counter() - started)
            assert isinstance(claimed, Claimed)
            response = StoredResponse(201, HEADERS, b'{"id":"pay_' + uuid.uuid4().hex.encode() + b'"}')
            started = time.perf_counter()
            assert await self.backend.complete(key, claimed.token, response, ttl=TTL)
            self.times["complete"].append(time.perf_counter() - started)
            self.replay_keys.append(key)

    async def replays(self, n: int) -> None:
        for _ in range(n):
            key = random.choice(self.replay_keys)
            started = time.perf_counter()
            found = await self.backend.claim(key, b"other", lease=30, ttl=TTL)
            self.times["replay"].append(time.perf_counter() - started)
            assert isinstance(found, Existing) and found.record.response is not None


async def run(dsn: str, rows: int, samples: int, log: Any) -> dict[str, Any]:
    suffix = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
    empty = PostgresBackend.from_dsn(dsn, table=f"idem_bench_empty_{suffix}", min_size=1, max_size=2)
    large = PostgresBackend.from_dsn(dsn, table=f"idem_bench_large_{suffix}", min_size=1, max_size=2)
    admin = await asyncpg.connect(dsn)
    result: dict[str, Any] = {"rows": rows, "samples": samples, "ttl_days": TTL // DAY}
    try:
        await empty.setup()
        await large.setup()
        print(f"filling {large.table} with {rows:,} rows ...", file=log, flush=True)
        started = time.perf_counter()
        await admin.execute(FILL.format(table=large.table, ttl=TTL), rows, _headers_encode(HEADERS), timeout=1800)
        result["fill_s"] = round(time.perf_counter() - started, 1)
        started = time.perf_counter()
        await admin.execute(f"VACUUM (ANALYZE) {large.table}", timeout=1800)
        result["vacuum_analyze_s"] = round(time.perf_counter() - started, 1)
        sizes = await admin.fetchrow("SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass)", large.table)
        result["table_mb"], result["indexes_mb"] = (round(size / 2**20, 1) for size in sizes)
        print(
            f"  {result['fill_s']} s + vacuum {result['vacuum_analyze_s']} s, "
            f"{result['table_mb']} MB + {result['indexes_mb']} MB indexes",
            file=log,
            flush=True,
        )

        # Replays on the large table hit random existing rows (not the 1 % already expired).
        existing = [i for i in random.sample(range(1, rows + 1), min(rows, 20_000)) if i % 100]
        large_keys = [RecordKey.build("bench", f"tenant-{i % 1000}", _md5(i)) for i in existing]
        sides = [Side("empty", empty, []), Side("large", large, large_keys)]
        for side in sides:  # warm-up: prepared statements, pool connections
            await side.new_keys(20)
            await side.replays(20)
            for times in side.times.values():
                times.clear()
        print(f"measuring {samples} new keys and {samples} replays per table ...", file=log, flush=True)
        for phase in ("new_keys", "replays"):
            done = 0
            while done < samples:
                n = min(BLOCK, samples - done)
                for side in sides if (done // BLOCK) % 2 == 0 else reversed(sides):
                    await getattr(side, phase)(n)
                done += n
        result["latency"] = {side.name: {op: summary(t) for op, t in side.times.items()} for side in sides}
        result["ratio_large_to_empty"] = {
            op: {
                q: round(result["latency"]["large"][op][q] / result["latency"]["empty"][op][q], 2)
                for q in ("p50_us", "p99_us", "mean_us")
            }
            for op in ("new", "complete", "replay")
        }
        plan = await admin.fetch("EXPLAIN " + large.sql.purge, 1000)
        result["purge_plan"] = [r[0].strip() for r in plan]
        during = Side("during purge", large, large_keys)
        started = time.perf_counter()
        purging = asyncio.ensure_future(large.purge(batch_size=1000))
        while not purging.done():  # claims on the same table, one at a time, while it purges
            await during.new_keys(10)
            await during.replays(10)
        purged = await purging
        result["purge"] = {"rows": purged, "seconds": round(time.perf_counter() - started, 2), "batch_size": 1000}
        result["latency"]["during_purge"] = {op: summary(t) for op, t in during.times.items() if t}
    finally:
        try:
            for backend in (empty, large):
                await admin.execute(f"DROP TABLE IF EXISTS {backend.table}")
        finally:
            await admin.close()
            await empty.aclose()
            await large.aclose()
    return result


def _md5(i: int) -> str:
    return hashlib.md5(str(i).encode()).hexdigest()


def report(result: dict[str, Any]) -> str:
    lines = [
        f"30-day TTL table: {result['rows']:,} rows ({result['table_mb']} MB + {result['indexes_mb']} MB indexes), "
        f"filled in {result['fill_s']} s",
        f"{'operation':<10}{'empty p50':>11}{'p99':>9}{'large p50':>11}{'p99':>9}{'ratio p50':>11}{'p99':>7}",
    ]
    for op in ("new", "complete", "replay"):
        e, g, r = result["latency"]["empty"][op], result["latency"]["large"][op], result["ratio_large_to_empty"][op]
        lines.append(
            f"{op:<10}{e['p50_us']:>9.0f}us{e['p99_us']:>7.0f}us{g['p50_us']:>9.0f}us{g['p99_us']:>7.0f}us"
            f"{r['p50_us']:>11.2f}{r['p99_us']:>7.2f}"
        )
    p = result["purge"]
    lines.append(f"purge of the {p['rows']:,} expired rows (batches of {p['batch_size']}): {p['seconds']} s")
    for op, s in result["latency"]["during_purge"].items():
        lines.append(f"  meanwhile, {s['n']} {op}: p50 {s['p50_us']:.0f}us, p99 {s['p99_us']:.0f}us")
    lines.append("purge plan: " + " / ".join(line for line in result["purge_plan"] if "Scan" in line))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dsn", default=POSTGRES_DSN, help="PostgreSQL DSN (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows in the large table (default: %(default)s)")
    parser.add_argument("--samples", type=int, default=2_000, help="new-key claims and replays per table")
    parser.add_argument("--seed", type=int, default=1953)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--summary", default="", help="also append the result as a JSON line here")
    args = parser.parse_args(argv)
    if args.rows < 100 or args.samples < 1:
        parser.error("--rows must be at least 100 and --samples at least 1")
    random.seed(args.seed)
    result = asyncio.run(run(args.dsn, args.rows, args.samples, sys.stderr))
    print(json.dumps(result, indent=2) if args.json else report(result))
    if args.summary:
        from benchmarks.figures import append

        run_at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        append(args.summary, {"kind": "table", "run": run_at, **{k: v for k, v in result.items() if k != "purge_plan"}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
