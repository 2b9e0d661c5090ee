"""What durable claims cost: a new key and a replay with `durable_replicas=0` against `=1`.

A throwaway primary and one replica (`redis-server` on free ports, nothing else on them), the
middleware in-process around an app that answers at once (as `bench_roundtrips`), requests one
after another, the two settings in alternating blocks so both see the same machine. A new key
runs claim + complete (two `WAIT`s with durable claims), a replay one claim that finds the record
(its `WAIT` returns at once: nothing new to confirm).

    python -m benchmarks.bench_durable
    python -m benchmarks.bench_durable --n 2000 --blocks 6 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.bench_roundtrips import app, call, policy
from idem_asgi import IdempotencyMiddleware
from idem_asgi.backends.redis import RedisBackend
from tests.support.servers import redis_process, replica_synced


async def block(mw: IdempotencyMiddleware, n: int) -> tuple[list[float], list[float]]:
    """n new keys, then their n replays: per-request seconds of each."""
    keys = [uuid.uuid4().hex for _ in range(n)]
    new, replay = [], []
    for k in keys:
        t0 = time.perf_counter()
        await call(mw, k)
        new.append(time.perf_counter() - t0)
    for k in keys:
        t0 = time.perf_counter()
        await call(mw, k)
        replay.append(time.perf_counter() - t0)
    return new, replay


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1e6


async def run(n: int, blocks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as workdir, redis_process(Path(workdir) / "primary") as primary:
        args = ["--replicaof", "127.0.0.1", str(primary.port)]
        with redis_process(Path(workdir) / "replica", args=args) as replica:
            while not replica_synced(primary, replica):  # noqa: ASYNC110 - bounded poll of a subprocess
                await asyncio.sleep(0.05)
            stores = {r: RedisBackend.from_url(primary.url, durable_replicas=r) for r in (0, 1)}
            mws = {r: IdempotencyMiddleware(app, backend=s, routes=policy()) for r, s in stores.items()}
            samples: dict[int, tuple[list[float], list[float]]] = {0: ([], []), 1: ([], [])}
            try:
                for r in (0, 1):
                    await block(mws[r], 50)  # warm: connections, scripts
                for i in range(blocks):
                    for r in (0, 1) if i % 2 == 0 else (1, 0):
                        new, replay = await block(mws[r], n)
                        samples[r][0].extend(new)
                        samples[r][1].extend(replay)
            finally:
                for s in stores.values():
                    await s.aclose()
    out: dict[str, Any] = {"n_per_block": n, "blocks": blocks}
    for r, (new, replay) in samples.items():
        out[f"durable_{r}"] = {
            "new_p50_us": round(pct(new, 50)),
            "new_p99_us": round(pct(new, 99)),
            "new_mean_us": round(statistics.fmean(new) * 1e6),
            "replay_p50_us": round(pct(replay, 50)),
            "replay_p99_us": round(pct(replay, 99)),
        }
    out["new_p50_added_us"] = out["durable_1"]["new_p50_us"] - out["durable_0"]["new_p50_us"]
    out["replay_p50_added_us"] = out["durable_1"]["replay_p50_us"] - out["durable_0"]["replay_p50_us"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=500, help="new keys (and as many replays) per block")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = asyncio.run(run(args.n, args.blocks))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"# primary + 1 replica on loopback, {args.blocks} alternating blocks of {args.n} new keys + replays")
    print(f"{'durable_replicas':<18}{'new p50':>10}{'new p99':>10}{'replay p50':>12}{'replay p99':>12}  (µs)")
    for r in (0, 1):
        d = result[f"durable_{r}"]
        print(f"{r:<18}{d['new_p50_us']:>10}{d['new_p99_us']:>10}{d['replay_p50_us']:>12}{d['replay_p99_us']:>12}")
    print(
        f"durable claims add {result['new_p50_added_us']} µs to a new key's p50 (two WAITs) and "
        f"{result['replay_p50_added_us']} µs to a replay's (its claim carries a WAIT that returns at once)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
