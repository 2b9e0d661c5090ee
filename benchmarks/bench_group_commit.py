"""Postgres group commit: keys/s, batch sizes and the Postgres server's CPU per key.

Each task claims a new key and completes it, in a loop, with `--inflight` tasks at once on one
event loop, against one `PostgresBackend`. Measured in alternating rounds of one run, side by side:
- `one-row`: every call sends its own statement (the store's one-row path, as before group commit);
- `grouped`: the store as shipped (what arrives while a statement is on the wire goes as one batch).
Printed per mode and in-flight count: keys/s, this process's CPU per key, the Postgres server's CPU
per key (every `postgres` process's user+system time from /proc, so run it on a quiet server),
and for `grouped` the batch sizes seen (rows per statement: median and largest), then the ratio:

    python -m benchmarks.bench_group_commit
    python -m benchmarks.bench_group_commit --inflight 1,8,32,128 --seconds 3 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.postgres._group import Args, Group
from idem_asgi.records import Claimed, RecordKey, StoredResponse
from tests.support.servers import POSTGRES_DSN, reachable

from .figures import append

ANSWER = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id":"ch_1","status":"succeeded"}')
TICKS = os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> float:
    """Seconds of CPU every `postgres` process on this machine has used (user + system)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)
            if not fields[0].endswith(("(postgres", "(postmaster")):
                continue
            parts = fields[1].split()
            total += int(parts[11]) + int(parts[12])
        except (OSError, IndexError, ValueError):
            continue
    return total / TICKS


async def _one_row(self: Group[Any], args: Args) -> Any:
    """`Group.run` without the group: each call its own statement (the path before group commit)."""
    self._count(1)
    return await self._one(args)


async def one_round(store: PostgresBackend, inflight: int, seconds: float) -> tuple[float, float, float]:
    """(keys/s, client CPU us/key, server CPU us/key) of one round."""
    ns = f"bench-gc-{uuid.uuid4().hex}"
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while time.perf_counter() < stop:
            key = RecordKey.build(ns, None, f"{w}-{i}")
            i += 1
            claimed = await store.claim(key, b"fp", lease=30, ttl=600)
            assert isinstance(claimed, Claimed)
            assert await store.complete(key, claimed.token, ANSWER, ttl=600)
            done += 1

    server0, client0, t0 = postgres_cpu(), time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(inflight)))
    elapsed = time.perf_counter() - t0
    client, server = time.process_time() - client0, postgres_cpu() - server0
    return done / elapsed, client / done * 1e6, server / done * 1e6


async def main(args: argparse.Namespace) -> int:
    if not reachable(args.postgres_dsn):
        print(f"postgres not reachable at {args.postgres_dsn}: skipped")
        return 0
    table = f"idem_bench_gc_{uuid.uuid4().hex[:8]}"
    grouped_run = Group.run
    print(
        f"{'mode':9} {'in flight':>9} {'keys/s':>8} {'client us/key':>14} {'pg us/key':>10}  batch rows (median / max)"
    )
    ratios = []
    try:
        for inflight in args.inflight:
            figures: dict[str, list[tuple[float, float, float]]] = {"one-row": [], "grouped": []}
            sizes: dict[int, int] = {}
            for _ in range(args.rounds):
                for mode in ("one-row", "grouped"):
                    Group.run = grouped_run if mode == "grouped" else _one_row  # type: ignore[method-assign]
                    store = PostgresBackend.from_dsn(args.postgres_dsn, table=table, max_size=20)
                    await store.setup()
                    try:
                        figures[mode].append(await one_round(store, inflight, args.seconds))
                        if mode == "grouped":
                            for kind in ("claim", "complete"):
                                for size, count in store.batch_sizes[kind].items():
                                    sizes[size] = sizes.get(size, 0) + count
                    finally:
                        await store.aclose()
            Group.run = grouped_run  # type: ignore[method-assign]
            rows = sorted(s for s, c in sizes.items() for _ in range(c))
            for mode, runs in figures.items():
                rate, client, server = (statistics.median(r[i] for r in runs) for i in range(3))
                batch = f"{statistics.median(rows):.0f} / {rows[-1]}" if mode == "grouped" and rows else "1 / 1"
                print(f"{mode:9} {inflight:9} {rate:8.0f} {client:14.0f} {server:10.0f}  {batch}")
            one = statistics.median(r[0] for r in figures["one-row"])
            grouped = statistics.median(r[0] for r in figures["grouped"])
            one_pg = statistics.median(r[2] for r in figures["one-row"])
            grouped_pg = statistics.median(r[2] for r in figures["grouped"])
            ratios.append((inflight, grouped / one, grouped_pg / one_pg))
            if args.summary:
                row = {
                    "kind": "group-commit",
                    "inflight": inflight,
                    "keys_ratio": round(grouped / one, 3),
                    "pg_cpu_ratio": round(grouped_pg / one_pg, 3),
                    "pg_us_per_key": round(grouped_pg, 1),
                    "batch_median": statistics.median(rows) if rows else 1,
                    "batch_max": rows[-1] if rows else 1,
                }
                append(args.summary, row)
    finally:
        Group.run = grouped_run  # type: ignore[method-assign]
        cleanup = PostgresBackend.from_dsn(args.postgres_dsn, table=table)
        pool = await cleanup._get_pool()
        async with pool.acquire() as conn:
            await conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        await cleanup.aclose()
    print("\nratios of grouped to one-row, same run:")
    for inflight, keys, server in ratios:
        print(
            f"group commit at {inflight} in flight: keys/s x{keys:.2f}, postgres CPU per key x{server:.2f} (same run)"
        )
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inflight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per round and mode")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per in-flight count")
    p.add_argument("--postgres-dsn", default=POSTGRES_DSN)
    p.add_argument("--summary", default="", help="also append each in-flight count's figures as a JSON line here")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))
