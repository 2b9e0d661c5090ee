"""How requests/s and p99 change with concurrency and body size, and memory per in-flight request.

Server part: uvicorn (1 worker, pinned to cpu 0; the client on cpu 1) serving the FastAPI app's
`/read` route (it reads the whole body, as real endpoints do) bare and behind the middleware;
every request a new key. For each concurrency (1, 8, 32, 128) and each body size (1 KiB, 64 KiB,
1 MiB at concurrency 8), `--rounds` bare/ours pairs run back to back in alternating order, so
machine noise hits both alike; the ratio is the median of the pairs'. Targets: at concurrency 128
the ratio holds >= 0.9 of its concurrency-1 value, at 1 MiB it stays >= 0.8. In-process part: N requests held
in flight inside the handler; tracemalloc gives the middleware's memory per in-flight request.

    python -m benchmarks.bench_scale                     # memory backend
    python -m benchmarks.bench_scale --backends memory,redis --duration 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import tracemalloc
import uuid
from typing import Any

from benchmarks import figures
from benchmarks._client import build_request, run_load
from benchmarks.bench_app import Server, install_signal_handlers, pin_self, stop_all
from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import MemoryBackend
from tests.support.servers import POSTGRES_DSN, REDIS_URL

URLS = {
    "memory": "memory://",
    "redis": REDIS_URL,
    "postgres": POSTGRES_DSN,
}
CONCURRENCY = (1, 8, 32, 128)
BODIES = (1 << 10, 64 << 10, 1 << 20)


def new_key_request(body: bytes) -> Any:
    def request_for(i: int) -> bytes:
        headers = [("idempotency-key", uuid.uuid4().hex), ("content-type", "application/octet-stream")]
        return build_request("POST", "/read", headers=headers, body=body)

    return request_for


async def measure(server: Server, body: bytes, concurrency: int, duration: float) -> dict[str, float]:
    result = await run_load(
        "127.0.0.1",
        server.port,
        new_key_request(body),
        concurrency=concurrency,
        max_requests=200_000,
        duration=duration,
    )
    ok = sum(n for status, n in result.statuses.items() if status < 500)
    return {
        "rps": round(result.rps, 1),
        "p50_ms": round(result.p(50), 2),
        "p99_ms": round(result.p(99), 2),
        "ok": ok,
        "requests": result.requests,
    }


async def scale(backend: str, duration: float, rounds: int) -> list[dict[str, Any]]:
    """Each point: `rounds` bare/ours pairs in alternating order; the median of the pairs' ratios."""
    rows: list[dict[str, Any]] = []
    bare = Server({"IDEM_BENCH_BACKEND": "none"}, label=f"scale-bare-{uuid.uuid4().hex[:6]}").start()
    ours = Server({"IDEM_BENCH_BACKEND": URLS[backend]}, label=f"scale-{backend}-{uuid.uuid4().hex[:6]}").start()
    try:
        for server in (bare, ours):  # warm-up, not recorded
            await measure(server, b"x" * 1024, 8, 0.5)
        points = [(c, BODIES[0]) for c in CONCURRENCY] + [(8, size) for size in BODIES[1:]]
        for i, (concurrency, size) in enumerate(points):
            body = b"x" * size
            pairs = []
            for r in range(rounds):
                first, second = (bare, ours) if (i + r) % 2 == 0 else (ours, bare)
                one = await measure(first, body, concurrency, duration)
                two = await measure(second, body, concurrency, duration)
                pairs.append((one, two) if first is bare else (two, one))
            ratios = sorted(o["rps"] / a["rps"] for a, o in pairs if a["rps"])
            a, b = pairs[len(pairs) // 2]
            rows.append(
                {
                    "backend": backend,
                    "concurrency": concurrency,
                    "body_bytes": size,
                    "bare_rps": statistics.median(p[0]["rps"] for p in pairs),
                    "ours_rps": statistics.median(p[1]["rps"] for p in pairs),
                    "ratio": round(statistics.median(ratios), 3) if ratios else 0,
                    "bare_p99_ms": a["p99_ms"],
                    "ours_p99_ms": b["p99_ms"],
                    "ours_p50_ms": b["p50_ms"],
                }
            )
    finally:
        bare.stop()
        ours.stop()
    return rows


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat as the work grows: at concurrency 128 the ratio holds >= 0.9 of its concurrency-1 value,
    and at 1 MiB bodies (the bare route reading them too) it stays >= 0.8."""
    out = []
    for backend in sorted({r["backend"] for r in rows}):
        mine = {(r["concurrency"], r["body_bytes"]): r["ratio"] for r in rows if r["backend"] == backend}
        c1, c128, mib = mine.get((1, BODIES[0])), mine.get((128, BODIES[0])), mine.get((8, BODIES[-1]))
        if c1 and c128 is not None:
            out.append(
                {"target": f"{backend} ratio at concurrency 128 / at 1", "value": round(c128 / c1, 3), "goal": 0.9}
            )
        if mib is not None:
            out.append({"target": f"{backend} ratio at 1 MiB bodies", "value": mib, "goal": 0.8})
    for t in out:
        t["met"] = t["value"] >= t["goal"]
    return out


async def memory_per_in_flight(n: int, size: int) -> float:
    """Bytes the middleware holds per request waiting inside the handler (buffered body included)."""
    release = asyncio.Event()
    entered = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        nonlocal entered
        await receive()
        entered += 1
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = IdempotencyMiddleware(app, backend=MemoryBackend(), routes=[RoutePolicy("/pay", single_tenant=True)])
    body = b"x" * size

    async def one(i: int) -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await release.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            pass

        headers = [(b"idempotency-key", f"k-{i}".encode()), (b"content-length", str(size).encode())]
        scope = {"type": "http", "method": "POST", "path": "/pay", "query_string": b"", "headers": headers}
        await mw(scope, receive, send)

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    for _ in range(1000):
        if entered == n:
            break
        await asyncio.sleep(0.001)
    during = tracemalloc.get_traced_memory()[0]
    release.set()
    await asyncio.gather(*tasks)
    tracemalloc.stop()
    return (during - before) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="memory", help="comma-separated: memory, redis, postgres")
    parser.add_argument("--duration", type=float, default=1.5, help="seconds per round (default 1.5)")
    parser.add_argument("--rounds", type=int, default=3, help="bare/ours pairs per point (default 3; median)")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of tables")
    parser.add_argument("--summary", default="", help="also append the points, targets and memory as JSON lines here")
    args = parser.parse_args(argv)
    install_signal_handlers()
    pinned = pin_self("1")
    try:
        rows: list[dict[str, Any]] = []
        for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
            rows += asyncio.run(scale(backend, args.duration, args.rounds))
        memory = [(size, asyncio.run(memory_per_in_flight(200, size))) for size in (1 << 10, 64 << 10)]
    finally:
        stop_all()
    goals = targets(rows)
    if args.summary:
        run = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        figures.append(args.summary, {"kind": "run", "run": run, "rounds": args.rounds, "duration": args.duration})
        for row in rows:
            figures.append(args.summary, {"kind": "point", **row})
        for goal in goals:
            figures.append(args.summary, {"kind": "target", **goal})
        for size, per in memory:
            figures.append(
                args.summary, {"kind": "memory", "in_flight_body_bytes": size, "bytes_per_request": round(per)}
            )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        for goal in goals:
            print(json.dumps(goal))
        for size, per in memory:
            print(json.dumps({"in_flight_body_bytes": size, "bytes_per_in_flight_request": round(per)}))
        return 0
    print(f"# scale curve, new key every request ({platform.node()}, nproc {os.cpu_count()}, {pinned})")
    print("| backend | concurrency | body | bare req/s | ours req/s | ratio | bare p99 ms | ours p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['concurrency']} | {r['body_bytes'] // 1024} KiB | {r['bare_rps']:.0f} | "
            f"{r['ours_rps']:.0f} | {r['ratio']:.2f} | {r['bare_p99_ms']:.1f} | {r['ours_p99_ms']:.1f} |"
        )
    print()
    for t in goals:
        print(f"target {t['target']}: {t['value']:.2f} (goal >= {t['goal']:.2f}) {'met' if t['met'] else 'MISSED'}")
    print("\n| body of each in-flight request | middleware memory per in-flight request (besides its body) |")
    print("|---:|---:|")
    for size, per in memory:
        print(f"| {size // 1024} KiB | {per / 1024:.1f} KiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
