"""What each key's history costs a request: the middleware with `history=16` beside `history=0`.

The middleware is called in process (no HTTP server, no client: only what the history adds shows),
with `--inflight` requests at once, each a new key (then a replay of it) on a route that answers at
once, against one store of each kind. Measured in alternating rounds of one run, side by side:
microseconds per new key and per replay (wall time, this process's CPU), and the history's writes
to the store per 100 keys (the trail's batches: one round trip each). The floor is the same
middleware and store with `history=0`.

    python -m benchmarks.bench_history
    python -m benchmarks.bench_history --stores memory,redis,postgres --keys 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.claims.runtime import machinery_for
from tests.support.servers import POSTGRES_DSN, REDIS_URL, reachable

from .bench_roundtrips import app, call
from .figures import append


def make_store(kind: str, history: int, table: str) -> Backend:
    if kind == "memory":
        return MemoryBackend(history=history, max_entries=1_000_000)
    if kind == "redis":
        from idem_asgi.backends.redis import RedisBackend

        return RedisBackend.from_url(REDIS_URL, prefix=f"bench-h:{uuid.uuid4().hex}:", history=history)
    from idem_asgi.backends.postgres import PostgresBackend

    return PostgresBackend.from_dsn(POSTGRES_DSN, table=table, history=history)


async def one_round(kind: str, history: int, keys: int, inflight: int, table: str) -> dict[str, float]:
    """µs per new key and per replay (wall, CPU) and the history's store writes per 100 keys."""
    store = make_store(kind, history, table)
    if kind == "postgres":
        await store.setup()  # type: ignore[attr-defined]
    routes = [RoutePolicy("/pay", methods=["POST"], single_tenant=True, ttl=600)]
    mw = IdempotencyMiddleware(app, backend=store, routes=routes, namespace=f"bench-h-{uuid.uuid4().hex[:8]}")
    names = [f"k-{i}" for i in range(keys)]
    try:
        for _ in range(20):  # warm up: connections, prepared statements, the trail's first batch
            await call(mw, uuid.uuid4().hex)
        await asyncio.sleep(0.1)
        figures: dict[str, float] = {}
        for case, expect in (("new-key", 201), ("replay", 201)):
            queue = iter(names)

            async def worker(queue: Any = queue, expect: int = expect) -> None:
                for name in queue:
                    assert (await call(mw, name))[0] == expect

            cpu0, t0 = time.process_time(), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(inflight)))
            figures[f"{case}-us"] = (time.perf_counter() - t0) / keys * 1e6
            figures[f"{case}-cpu-us"] = (time.process_time() - cpu0) / keys * 1e6
            trail = machinery_for(store).trail
            if case == "new-key" and trail is not None:
                await asyncio.sleep(0.2)  # the last batch
                figures["writes-per-100"] = trail.batches / (keys + 20) * 100
                figures["failed"] = trail.failed + trail.dropped
        return figures
    finally:
        await store.aclose()


async def main(args: argparse.Namespace) -> int:
    table = f"idem_bench_h_{uuid.uuid4().hex[:8]}"
    run = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"{'store':9} {'history':>7} {'new key us':>10} {'cpu us':>7} {'replay us':>9} {'cpu us':>7}  writes/100 keys"
    )
    try:
        for kind in args.stores:
            if (kind == "redis" and not reachable(REDIS_URL)) or (kind == "postgres" and not reachable(POSTGRES_DSN)):
                print(f"{kind}: not reachable, skipped")
                continue
            runs: dict[int, list[dict[str, float]]] = {0: [], 16: []}
            for _ in range(args.rounds):
                for history in (0, 16):
                    runs[history].append(await one_round(kind, history, args.keys, args.inflight, table))
            med = {h: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for h, rs in runs.items()}
            for history, m in med.items():
                writes = f"{m['writes-per-100']:.1f}" if "writes-per-100" in m else "-"
                print(
                    f"{kind:9} {history:7} {m['new-key-us']:10.1f} {m['new-key-cpu-us']:7.1f} "
                    f"{m['replay-us']:9.1f} {m['replay-cpu-us']:7.1f}  {writes}"
                )
            off, on = med[0], med[16]
            row = {
                "kind": "history",
                "store": kind,
                "run": run,
                "inflight": args.inflight,
                "new_key_us_added": round(on["new-key-cpu-us"] - off["new-key-cpu-us"], 1),
                "new_key_cpu_ratio": round(on["new-key-cpu-us"] / off["new-key-cpu-us"], 3),
                "new_key_wall_ratio": round(on["new-key-us"] / off["new-key-us"], 3),
                "replay_us_added": round(on["replay-cpu-us"] - off["replay-cpu-us"], 1),
                "floor_new_key_cpu_us": round(off["new-key-cpu-us"], 1),
                "writes_per_100_keys": round(on.get("writes-per-100", 0.0), 1),
                "lost": int(on.get("failed", 0)),
            }
            print(
                f"{kind}: history=16 over history=0, same run: CPU per new key x{row['new_key_cpu_ratio']:.2f} "
                f"(+{row['new_key_us_added']:.1f} us over a floor of {row['floor_new_key_cpu_us']:.1f} us), "
                f"wall x{row['new_key_wall_ratio']:.2f}, replay +{row['replay_us_added']:.1f} us CPU, "
                f"{row['writes_per_100_keys']:.1f} history writes per 100 new keys"
            )
            if args.summary:
                append(args.summary, row)
    finally:
        if "postgres" in args.stores and reachable(POSTGRES_DSN):
            import asyncpg

            conn = await asyncpg.connect(POSTGRES_DSN)
            try:
                await conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_history"')
            finally:
                await conn.close()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stores", type=lambda s: s.split(","), default=["memory", "redis", "postgres"])
    p.add_argument("--keys", type=int, default=2000, help="new keys per round (then a replay of each)")
    p.add_argument("--inflight", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (history off, on)")
    p.add_argument("--summary", default="", help="also append each store's figures as a JSON line here")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))
