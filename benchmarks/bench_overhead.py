"""What IdempotencyMiddleware costs on a FastAPI no-op route, as a ratio of the bare app's requests/s.

Server mode (default): uvicorn, 1 worker, pinned to one CPU (`taskset -c 0`); this process is the
load client, pinned to another (cpu 1), using the lean asyncio client in `_client.py`. One bare
server and one server per backend (memory, redis, postgres) run side by side; only one is under
load at a time. For every backend and case, a bare round and a middleware round run back to back,
in alternating order (ABBA), `--rounds` times, so machine noise hits both sides alike. Cases:

- `passthrough`: POST to a route no policy protects (should cost nothing measurable);
- `new-key`: every request a fresh Idempotency-Key (claim + run + complete);
- `replay`: the same key again and again (one claim that finds the completed record).

Then a sequential latency probe (concurrency 1) interleaves bare / first execution / replay
request by request. The printed ratio is the median over rounds of ours/bare requests/s;
targets (new-key): memory >= 0.95, redis >= 0.85 (`from_url`) and >= 0.80 (`redis-client`: the
user's own redis-py client), postgres >= 0.65; replay >= 1.0 on every store.

In-process mode (`--inprocess`): no server, no network: the middleware called directly around a
raw ASGI app, memory backend, bare and ours alternated; `--profile cprofile|pyinstrument` profiles it.

    python -m benchmarks.bench_overhead --quick
    python -m benchmarks.bench_overhead --backends memory,redis --rounds 5 --duration 4 --json
    python -m benchmarks.bench_overhead --inprocess --profile cprofile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks._client import Connection, LoadResult, percentile, run_load
from benchmarks.bench_app import Server, install_signal_handlers, pin_self, stop_all
from benchmarks.figures import append
from idem_asgi._types import Receive, Scope, Send
from tests.support.servers import POSTGRES_DSN, REDIS_URL, reachable

CASES = ("passthrough", "new-key", "replay")
BACKENDS = ("memory", "redis", "redis-client", "postgres", "floor", "forward", "naive")
"""`redis` is `RedisBackend.from_url`; `redis-client` a `RedisBackend` over the user's own redis-py client;
`floor` the minimal capture middleware and `forward` a forwarding one (benchmarks/floors.py), measured
in the same rounds so each report shows the distance to the least such a middleware can cost; `naive`
the naive two-round-trip Redis middleware on redis-py (benchmarks/floors.py), what ours on Redis must beat."""
FLOORS = ("floor", "forward", "naive")
TARGETS: dict[str, float | None] = {  # new-key, ours/bare req/s
    "memory": 0.95,
    "redis": 0.85,
    "redis-client": 0.80,
    "postgres": 0.65,
    "floor": None,
    "forward": None,
    "naive": None,
}
NAIVE_TARGET = 1.30  # Redis from_url's new-key requests/s over the naive Redis middleware's, same run
FLOOR_TARGET = 0.95  # memory's new-key ratio over the capture floor's, same run
INSTRUCTION_TARGETS = {"new-key": 55_000, "replay": 40_000}  # the middleware's own, memory store (callgrind)
REPLAY_TARGET = 1.0  # every store: a replay must be cheaper than running the no-op handler
BODY = b'{"amount": 100}'


def machine() -> dict[str, Any]:
    """nproc and CPU model, for the record."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version()}


def template(path: str) -> bytes:
    """Request bytes with a `%b` where the key goes."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(BODY)}\r\nidempotency-key: %b\r\n\r\n"
    ).encode("latin-1")
    return head + BODY


T_NOOP = template("/noop")
T_OPEN = template("/open")


def request_maker(case: str, tag: str) -> Callable[[int], bytes]:
    """request_for(i) for a case; `tag` makes keys unique to this run, server, round."""
    if case == "passthrough":
        raw = T_OPEN % f"{tag}-open".encode()
        return lambda i: raw
    if case == "replay":
        raw = T_NOOP % f"{tag}-replay".encode()
        return lambda i: raw
    prefix = f"{tag}-new-".encode()
    return lambda i: T_NOOP % (prefix + str(i).encode())


# ------------------------------------------------------------------------------------------
# stores: reachability, setup, cleanup (own prefix / own table only; nothing else is touched)
# ------------------------------------------------------------------------------------------


async def setup_postgres(dsn: str, table: str) -> None:
    from idem_asgi.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_dsn(dsn, table=table, min_size=1, max_size=1)
    try:
        await backend.setup()
    finally:
        await backend.aclose()


async def drop_postgres(dsn: str, *tables: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        for t in tables:
            await conn.execute(f'DROP TABLE IF EXISTS "{t}"')
    finally:
        await conn.close()


async def delete_redis_prefix(url: str, prefix: str, *, max_keys: int = 5_000_000) -> int:
    """Delete the keys under `prefix` (ours alone: a per-run unique prefix). Bounded in count."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    deleted = 0
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                deleted += await client.unlink(*batch)
                batch.clear()
            if deleted >= max_keys:
                break
        if batch:
            deleted += await client.unlink(*batch)
    finally:
        await client.aclose()
    return deleted


# ------------------------------------------------------------------------------------------
# server mode
# ------------------------------------------------------------------------------------------


@dataclass
class Sample:
    rps: float
    p50: float
    p99: float
    requests: int
    bad: int  # answers other than 200
    errors: int
    statuses: dict[int, int]
    cpu_us: float  # server CPU time per request, microseconds (noise-resistant cost)


@dataclass
class Pair:
    bare: list[Sample] = field(default_factory=list)
    ours: list[Sample] = field(default_factory=list)
    bare_lat: list[float] = field(default_factory=list)
    ours_lat: list[float] = field(default_factory=list)


def to_sample(r: LoadResult, cpu: float) -> Sample:
    return Sample(
        rps=r.rps,
        p50=r.p(50),
        p99=r.p(99),
        requests=r.requests,
        bad=sum(n for s, n in r.statuses.items() if s != 200),
        errors=sum(r.errors.values()),
        statuses=dict(r.statuses),
        cpu_us=cpu / r.requests * 1e6 if r.requests else float("nan"),
    )


async def measure(server: Server, case: str, tag: str, args: argparse.Namespace) -> tuple[LoadResult, float]:
    """One load run; returns it and the server CPU seconds it took."""
    if case == "replay":  # the first request executes; everything measured after it replays
        conn = await Connection.open("127.0.0.1", server.port)
        try:
            await asyncio.wait_for(conn.request(request_maker(case, tag)(0)), 10)
        finally:
            await conn.close()
    cpu0 = server.cpu_seconds()
    result = await run_load(
        "127.0.0.1",
        server.port,
        request_maker(case, tag),
        concurrency=args.concurrency,
        max_requests=args.max_requests,
        duration=args.duration,
    )
    return result, server.cpu_seconds() - cpu0


async def latency_probe(bare: Server, ours: Server, samples: int, tag: str, budget: float) -> dict[str, list[float]]:
    """Sequential requests, interleaved bare / ours-first-execution / ours-replay, one at a time."""
    out: dict[str, list[float]] = {"bare": [], "first": [], "replay": []}
    cb = await Connection.open("127.0.0.1", bare.port)
    co = await Connection.open("127.0.0.1", ours.port)
    replay_raw = T_NOOP % f"{tag}-lat-replay".encode()
    perf = time.perf_counter
    stop_at = perf() + budget
    try:
        await asyncio.wait_for(co.request(replay_raw), 10)  # first execution of the replay key
        for i in range(samples):
            if perf() > stop_at:
                break
            new_raw = T_NOOP % f"{tag}-lat-{i}".encode()
            for name, conn, raw in (("bare", cb, new_raw), ("first", co, new_raw), ("replay", co, replay_raw)):
                t0 = perf()
                r = await asyncio.wait_for(conn.request(raw), 10)
                out[name].append(perf() - t0)
                if r.status != 200:
                    raise RuntimeError(f"latency probe: {name} answered {r.status}: {r.body[:200]!r}")
                if name == "replay" and r.header("idempotent-replayed") != b"true":
                    raise RuntimeError("latency probe: replay not marked Idempotent-Replayed")
    finally:
        await cb.close()
        await co.close()
    return out


def print_round(rnd: int, rounds: int, backend: str, case: str, is_bare: bool, s: Sample) -> None:
    side = "bare" if is_bare else "ours"
    line = (
        f"  round {rnd + 1}/{rounds} {backend:<8} {case:<11} {side:<4} {s.rps:8.0f} req/s  "
        f"p50 {s.p50:6.2f} ms  p99 {s.p99:6.2f} ms  server cpu {s.cpu_us:6.1f} us/req"
    )
    if s.bad:
        line += f"  non-200: {s.bad} {s.statuses}"
    if s.errors:
        line += f"  errors: {s.errors}"
    print(line, flush=True)


def backend_url(name: str, args: argparse.Namespace) -> str:
    urls = {
        "memory": "memory://",
        "redis": args.redis_url,
        "redis-client": args.redis_url,
        "postgres": args.postgres_dsn,
        "floor": "floor:capture",
        "forward": "floor:forward",
        "naive": "floor:naive",
    }
    url: str = urls[name]
    return url


def emit(args: argparse.Namespace, record: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(record), flush=True)
    if args.summary:  # every record of the run, for benchmarks/figures.py (run_all passes it)
        append(args.summary, record)


async def server_mode(args: argparse.Namespace) -> int:
    run = uuid.uuid4().hex[:10]
    prefix = f"idem-bench:{run}:"
    table = f"idem_bench_{run}"
    backends = [b for b in args.backends.split(",") if b]
    cases = [c for c in args.cases.split(",") if c]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}; pick from {','.join(BACKENDS)}")
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; pick from {','.join(CASES)}")
    skipped = []
    if not reachable(args.redis_url):
        skipped += [b for b in backends if b.startswith("redis") or b == "naive"]
    if "postgres" in backends and not reachable(args.postgres_dsn):
        skipped.append("postgres")
    backends = [b for b in backends if b not in skipped]
    pinning = pin_self(args.client_cpus)
    info = {**machine(), "run": run, "pinning": pinning, "server_cpus": args.server_cpus}
    if not args.json:
        print(
            f"# {info['cpu']}, nproc {info['nproc']}, python {info['python']}; {pinning}, server cpu {args.server_cpus}"
        )
        print(
            f"# rounds {args.rounds} x {args.duration:.1f} s per side, concurrency {args.concurrency}, "
            f"loop={args.loop} http={args.http}"
        )
        if args.route_io != "none":
            print(f"# the benchmarked route does one {args.route_io} GET itself (bare and ours alike)")
        if skipped:
            print(f"# skipped (not reachable): {', '.join(skipped)}")
        if args.pythonpath:
            print(f"# middleware servers import idem_asgi from {args.pythonpath} first")
    emit(args, {"kind": "machine", **info, "skipped": skipped})

    common = {
        "IDEM_BENCH_PREFIX": prefix,
        "IDEM_BENCH_TABLE": table,
        "IDEM_BENCH_TTL": str(args.ttl),
        "IDEM_BENCH_REDIS_URL": args.redis_url,
    }
    if args.route_io == "redis":  # bare and ours alike: the route does one Redis GET itself
        common["IDEM_BENCH_ROUTE_REDIS"] = args.redis_url
    servers: dict[str, Server] = {}
    results: dict[tuple[str, str], Pair] = {}
    latency: dict[str, dict[str, list[float]]] = {}
    try:
        if "postgres" in backends:
            await setup_postgres(args.postgres_dsn, table)
        kw = {"cpus": args.server_cpus, "loop": args.loop, "http": args.http}
        servers["bare"] = Server({**common, "IDEM_BENCH_BACKEND": "none"}, label=f"bare-{run}", **kw).start()
        for b in backends:
            env = {**common, "IDEM_BENCH_BACKEND": backend_url(b, args)}
            if b == "redis-client":
                env["IDEM_BENCH_REDIS_CLIENT"] = "1"
            if args.pythonpath:  # another idem_asgi checkout for the middleware servers (A/B a patch)
                env["PYTHONPATH"] = args.pythonpath
            servers[b] = Server(env, label=f"{b}-{run}", **kw).start()
            if not args.json:
                print(f"# {b} server: idem_asgi from {servers[b].package}")
        # warm-up: import paths, pools, JIT-less caches; not recorded
        for name, server in servers.items():
            for case in cases:
                await run_load(
                    "127.0.0.1",
                    server.port,
                    request_maker(case, f"{run}-warm-{name}"),
                    concurrency=args.concurrency,
                    max_requests=args.max_requests,
                    duration=args.warmup,
                )
        for rnd in range(args.rounds):
            for bi, b in enumerate(backends):
                for ci, case in enumerate(cases):
                    pair = results.setdefault((b, case), Pair())
                    order = ("bare", b) if (rnd + bi + ci) % 2 == 0 else (b, "bare")
                    for side in order:
                        tag = f"{run}-{side}-{b}-{rnd}"
                        r, cpu = await measure(servers[side], case, tag, args)
                        s = to_sample(r, cpu)
                        is_bare = side == "bare"
                        (pair.bare if is_bare else pair.ours).append(s)
                        (pair.bare_lat if is_bare else pair.ours_lat).extend(r.latencies)
                        emit(args, {"kind": "round", "backend": b, "case": case, "side": "bare" if is_bare else "ours",
                                    "round": rnd, **s.__dict__})  # fmt: skip
                        if not args.json:
                            print_round(rnd, args.rounds, b, case, is_bare, s)
        for b in [b for b in backends if b not in FLOORS] if args.latency_samples > 0 else ():
            latency[b] = await latency_probe(
                servers["bare"], servers[b], args.latency_samples, f"{run}-{b}", budget=max(10.0, args.duration * 5)
            )
    finally:
        for server in servers.values():
            server.stop()
        stop_all()
        try:
            if "postgres" in backends:
                await drop_postgres(args.postgres_dsn, table)
            if any(b.startswith("redis") or b == "naive" for b in backends):
                await delete_redis_prefix(args.redis_url, prefix)
        except Exception as exc:  # cleanup must not hide the real error
            print(f"# cleanup failed: {exc!r}", file=sys.stderr)
    report(args, backends, cases, results, latency)
    return 0


def print_floor_distance(rows: list[dict[str, Any]], tag: str = "") -> None:
    """Each store's new-key ratio beside the floors', and memory's against the capture floor."""
    by = {(r["backend"], r["case"]): r["ratio"] for r in rows}
    floor, forward = by.get(("floor", "new-key")), by.get(("forward", "new-key"))
    if floor is None:
        return
    shown = f"capture floor {floor:.2f}" + (f", forward {forward:.2f}" if forward is not None else "")
    print(f"floors (new-key, ratio to bare, same run): {shown}")
    for b in ("memory", "redis", "redis-client", "postgres"):
        if (b, "new-key") in by:
            print(f"  {b}: {by[(b, 'new-key')]:.2f} = {by[(b, 'new-key')] / floor:.2f} of the capture floor")
    if ("memory", "new-key") in by:
        over = by[("memory", "new-key")] / floor
        met = "met" if over >= FLOOR_TARGET else "MISSED"
        print(f"target{tag} memory new-key ours/floor: {over:.2f} (goal >= {FLOOR_TARGET:.2f}) {met}")
    naive = by.get(("naive", "new-key"))
    if naive is not None and ("redis", "new-key") in by:
        ahead = by[("redis", "new-key")] / naive
        print(f"  naive two-round-trip Redis middleware (redis-py): {naive:.2f}")
        met = "met" if ahead >= NAIVE_TARGET else "MISSED"
        print(f"target{tag} redis new-key ours/naive: {ahead:.2f} (goal >= {NAIVE_TARGET:.2f}) {met}")


def ratio_stats(pair: Pair) -> tuple[float, float, float]:
    ratios = [o.rps / b.rps for b, o in zip(pair.bare, pair.ours, strict=True) if b.rps > 0]
    if not ratios:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(ratios), min(ratios), max(ratios)


def report(
    args: argparse.Namespace,
    backends: list[str],
    cases: list[str],
    results: dict[tuple[str, str], Pair],
    latency: dict[str, dict[str, list[float]]],
) -> None:
    ms = 1000.0
    tag = "" if args.route_io == "none" else f" [route does one {args.route_io} GET]"
    rows: list[dict[str, Any]] = []
    for b in backends:
        for case in cases:
            pair = results.get((b, case))
            if pair is None or not pair.ours:
                continue
            med, lo, hi = ratio_stats(pair)
            bare_cpu = statistics.median(s.cpu_us for s in pair.bare)
            ours_cpu = statistics.median(s.cpu_us for s in pair.ours)
            bare_rps = statistics.median(s.rps for s in pair.bare)
            ours_rps = statistics.median(s.rps for s in pair.ours)
            target = {"new-key": TARGETS[b], "replay": REPLAY_TARGET, "passthrough": 1.0}[case]
            if b in FLOORS:
                target = None
            row: dict[str, Any] = {
                "kind": "summary",
                "backend": b,
                "case": case,
                "bare_rps": round(bare_rps, 1),
                "ours_rps": round(ours_rps, 1),
                "ratio": round(med, 3),
                "ratio_min": round(lo, 3),
                "ratio_max": round(hi, 3),
                "ratio_best": round(max(s.rps for s in pair.ours) / max(s.rps for s in pair.bare), 3),
                "target": target,
                "overhead_us": round(1e6 / ours_rps - 1e6 / bare_rps, 1) if ours_rps and bare_rps else None,
                "bare_cpu_us": round(bare_cpu, 1),
                "ours_cpu_us": round(ours_cpu, 1),
                "cpu_ratio": round(bare_cpu / ours_cpu, 3) if ours_cpu > 0 else None,
                "bare_p50_ms": round(percentile(pair.bare_lat, 50) * ms, 2),
                "bare_p99_ms": round(percentile(pair.bare_lat, 99) * ms, 2),
                "ours_p50_ms": round(percentile(pair.ours_lat, 50) * ms, 2),
                "ours_p99_ms": round(percentile(pair.ours_lat, 99) * ms, 2),
                "ours_non200": sum(s.bad for s in pair.ours),
                "errors": sum(s.errors for s in pair.ours) + sum(s.errors for s in pair.bare),
                "rounds": len(pair.ours),
            }
            rows.append(row)
            emit(args, row)
    lat_rows = []
    for b, lat in latency.items():
        row = {"kind": "latency", "backend": b, "samples": len(lat["replay"])}
        for name in ("bare", "first", "replay"):
            row[f"{name}_p50_ms"] = round(percentile(lat[name], 50) * ms, 3)
            row[f"{name}_p99_ms"] = round(percentile(lat[name], 99) * ms, 3)
        row["replay_over_first"] = round(row["replay_p50_ms"] / row["first_p50_ms"], 3) if row["first_p50_ms"] else None
        lat_rows.append(row)
        emit(args, row)
    if args.json:
        return
    print()
    print(
        f"Throughput, concurrency {args.concurrency}: ratio = median over {args.rounds} rounds of ours/bare req/s; "
        "best = best ours round / best bare round; cpu ratio = bare/ours server CPU per request"
    )
    head = (
        f"{'backend':<13}{'case':<12}{'bare req/s':>11}{'ours req/s':>11}{'ratio':>7}{'min-max':>11}{'best':>6}"
        f"{'target':>12}{'cpu us/req':>14}{'cpu ratio':>10}{'bare p50/p99 ms':>17}{'ours p50/p99 ms':>17}{'non-200':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["target"] is None:
            shown = "-"
        elif r["case"] == "passthrough":
            shown = "~1.00"
        else:
            mark = "ok" if r["ratio"] >= r["target"] else "MISS"
            shown = f">={r['target']:.2f} {mark}"
        cpu = f"{r['bare_cpu_us']:.0f}/{r['ours_cpu_us']:.0f}"
        print(
            f"{r['backend']:<13}{r['case']:<12}{r['bare_rps']:>11.0f}{r['ours_rps']:>11.0f}{r['ratio']:>7.2f}"
            f"{r['ratio_min']:>6.2f}-{r['ratio_max']:<4.2f}{r['ratio_best']:>6.2f}{shown:>12}{cpu:>14}"
            f"{r['cpu_ratio'] or 0:>10.2f}"
            f"{r['bare_p50_ms']:>8.2f}/{r['bare_p99_ms']:<8.2f}{r['ours_p50_ms']:>8.2f}/{r['ours_p99_ms']:<8.2f}"
            f"{r['ours_non200']:>8}"
        )
    print()
    for r in rows:
        if r["case"] != "passthrough" and r["target"] is not None:
            met = "met" if r["ratio"] >= r["target"] else "MISSED"
            what = f"target{tag} {r['backend']} {r['case']} ours/bare req/s"
            print(f"{what}: {r['ratio']:.2f} (goal >= {r['target']:.2f}) {met}")
    print_floor_distance(rows, tag)
    if lat_rows and any(r["samples"] for r in lat_rows):
        print()
        print("Sequential latency (concurrency 1, interleaved request by request), ms")
        head = (
            f"{'backend':<9}{'samples':>8}{'bare p50/p99':>16}{'first exec p50/p99':>20}"
            f"{'replay p50/p99':>18}{'replay/first':>14}"
        )
        print(head)
        print("-" * len(head))
        for r in lat_rows:
            print(
                f"{r['backend']:<9}{r['samples']:>8}"
                f"{r['bare_p50_ms']:>8.3f}/{r['bare_p99_ms']:<7.3f}"
                f"{r['first_p50_ms']:>12.3f}/{r['first_p99_ms']:<7.3f}"
                f"{r['replay_p50_ms']:>10.3f}/{r['replay_p99_ms']:<7.3f}"
                f"{r['replay_over_first']:>14.2f}"
            )


# ------------------------------------------------------------------------------------------
# valgrind mode: instructions per request of the real server, deterministic on a noisy machine
# ------------------------------------------------------------------------------------------


def _callgrind_total(pattern: str) -> int:
    """Total instructions (Ir) in the newest callgrind dump matching `pattern`."""
    import glob

    files = sorted(glob.glob(pattern), key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"no callgrind dump matches {pattern}")
    with open(files[-1]) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no totals in {files[-1]}")


async def valgrind_count(server: Server, case: str, tag: str, n: int) -> tuple[float, dict[int, int]]:
    """Instructions per request the server executes for `n` requests of `case` (after a warm-up)."""
    assert server.proc is not None
    pid = str(server.proc.pid)

    async def control(flag: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            "callgrind_control", flag, pid, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            if await asyncio.wait_for(proc.wait(), 60) != 0:
                raise RuntimeError(f"callgrind_control {flag} {pid} failed")
        finally:
            if proc.returncode is None:
                proc.kill()

    maker = request_maker(case, tag)
    warm = maker if case == "replay" else request_maker(case, tag + "-warm")  # new keys stay new
    await run_load("127.0.0.1", server.port, warm, concurrency=8, max_requests=max(100, n // 5), duration=600)
    await control("-z")
    r = await run_load("127.0.0.1", server.port, maker, concurrency=8, max_requests=n, duration=600)
    await control("-d")
    await asyncio.sleep(1.0)
    total = _callgrind_total(str(server.log_path.parent / f"cg-{server.label}.*"))
    return total / max(1, r.requests), dict(r.statuses)


async def valgrind_mode(args: argparse.Namespace) -> int:
    """Each server under callgrind; counts are deterministic, so one round is enough."""
    import shutil

    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        raise SystemExit("--valgrind needs valgrind (apt-get install valgrind)")
    run = uuid.uuid4().hex[:10]
    prefix = f"idem-bench:{run}:"
    table = f"idem_bench_{run}"
    backends = [b for b in args.backends.split(",") if b]
    backends = [b for b in backends if b in ("memory", *FLOORS) or reachable(backend_url(b, args))]
    cases = [c for c in args.cases.split(",") if c]
    n = args.valgrind_requests
    common = {"IDEM_BENCH_PREFIX": prefix, "IDEM_BENCH_TABLE": table, "IDEM_BENCH_TTL": str(args.ttl),
              "PYTHONHASHSEED": "0"}  # fmt: skip
    counts: dict[tuple[str, str], float] = {}
    try:
        if "postgres" in backends:
            await setup_postgres(args.postgres_dsn, table)
        for name in ["bare", *backends]:
            env = {**common, "IDEM_BENCH_BACKEND": "none" if name == "bare" else backend_url(name, args)}
            if name == "redis-client":
                env["IDEM_BENCH_REDIS_CLIENT"] = "1"
            if args.pythonpath and name != "bare":
                env["PYTHONPATH"] = args.pythonpath
            label = f"vg-{name}-{run}"
            out = str(Server(env, label=label).log_path.parent / f"cg-{label}.%p")
            wrapper = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}")
            server = Server(env, label=label, cpus=args.server_cpus, wrapper=wrapper, loop=args.loop, http=args.http)
            server.start(timeout=300)
            try:
                for case in cases:  # bare too: /open is routed after /noop, so each case has its own bare
                    per_request, statuses = await valgrind_count(server, case, f"{run}-{name}-{case}", n)
                    counts[(name, case)] = per_request
                    emit(args, {"kind": "valgrind", "server": name, "case": case, "instructions": round(per_request),
                                "requests": n, "statuses": statuses})  # fmt: skip
                    if not args.json:
                        print(
                            f"  {name:<13}{case:<12}{per_request:>12,.0f} instructions/request  {statuses}", flush=True
                        )
            finally:
                server.stop()
                for dump in server.log_path.parent.glob(f"cg-{label}.*"):
                    dump.unlink(missing_ok=True)  # megabytes each; the counts are printed
    finally:
        stop_all()
        try:
            if "postgres" in backends:
                await drop_postgres(args.postgres_dsn, table)
            if any(b.startswith("redis") for b in backends):
                await delete_redis_prefix(args.redis_url, prefix)
        except Exception as exc:
            print(f"# cleanup failed: {exc!r}", file=sys.stderr)
    if not args.json:
        print()
        print("Instructions per request (callgrind, server side only); ratio = bare / ours, the req/s ratio")
        print("a CPU-bound server would reach if every instruction cost the same (memory stalls ignored)")
        print(f"{'backend':<13}{'case':<12}{'bare':>12}{'ours':>12}{'+instr':>10}{'ratio':>7}{'target':>8}")
        for (name, case), per_request in counts.items():
            bare = counts.get(("bare", case))
            if name == "bare" or not bare:
                continue
            goal = TARGETS[name]
            target = f"{goal:.2f}" if case == "new-key" and goal is not None else "-"
            print(f"{name:<13}{case:<12}{bare:>12,.0f}{per_request:>12,.0f}{per_request - bare:>10,.0f}"
                  f"{bare / per_request:>7.2f}{target:>8}")  # fmt: skip
        print()
        for case, goal in INSTRUCTION_TARGETS.items():
            ours, bare, floor = counts.get(("memory", case)), counts.get(("bare", case)), counts.get(("floor", case))
            if ours is None or bare is None:
                continue
            # A new key's own cost is ours over the bare app; a replay runs no app, so its own cost
            # is read over the capture floor's replay (which runs none either).
            base, over = (bare, "the bare app") if case == "new-key" or floor is None else (floor, "the capture floor")
            beside = f"; the capture floor adds {floor - bare:,.0f} over the bare app" if floor is not None else ""
            met = "met" if ours - base <= goal else "MISSED"
            print(f"target memory {case} middleware instructions/request (over {over}): {ours - base:,.0f} "
                  f"(goal <= {goal:,}{beside}) {met}")  # fmt: skip
    return 0


# ------------------------------------------------------------------------------------------
# in-process mode: the middleware called directly, no server, no network
# ------------------------------------------------------------------------------------------

_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/json"), (b"content-length", b"20")],
}
_BODY = {"type": "http.response.body", "body": b'{"ok":true,"id":42}\n', "more_body": False}


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The cheapest possible ASGI app: read the body, answer a fixed JSON."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    await send(_START)
    await send(_BODY)


def scopes(case: str, n: int, tag: str) -> Iterator[dict[str, Any]]:
    path = "/open" if case == "passthrough" else "/noop"
    base = [
        (b"host", b"127.0.0.1"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(BODY)).encode()),
    ]
    for i in range(n):
        key = f"{tag}-replay" if case == "replay" else f"{tag}-{i}"
        yield {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [*base, (b"idempotency-key", key.encode())],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }


async def drive(app: Any, case: str, n: int, tag: str) -> tuple[float, Counter[int]]:
    """Call `app` n times; returns (CPU seconds, statuses). Scopes are built before the clock starts.

    The clock is this process's CPU time, so time other programs take from the machine is not counted.

    Each request is followed by one pass of the event loop (`sleep(0)`), as in a server, so timers
    and callbacks the middleware schedules are processed inside the measurement, not piled up.
    """
    request = {"type": "http.request", "body": BODY, "more_body": False}
    statuses: Counter[int] = Counter()
    all_scopes = list(scopes(case, n, tag))

    async def receive() -> dict[str, Any]:
        return request

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses[message["status"]] += 1

    if case == "replay":
        await app(next(scopes(case, 1, tag)), receive, send)
        statuses.clear()
    pause = asyncio.sleep
    clock = time.process_time
    t0 = clock()
    for scope in all_scopes:
        await app(scope, receive, send)
        await pause(0)
    return clock() - t0, statuses


def build_inprocess_middleware() -> Any:
    from idem_asgi import IdempotencyMiddleware, RoutePolicy
    from idem_asgi.backends import MemoryBackend

    return IdempotencyMiddleware(
        raw_app,
        backend=MemoryBackend(max_entries=10_000_000),
        routes=[RoutePolicy("/noop", methods=["POST"], single_tenant=True)],
    )


async def inprocess_mode(args: argparse.Namespace) -> int:
    """Bare raw app vs the middleware around it, in alternating batches; median of batch means."""
    cases = [c for c in args.cases.split(",") if c]
    info = machine()
    if args.profile:
        return await profile_mode(args, cases)
    mw = build_inprocess_middleware()
    batch = max(50, args.n // args.batches)
    rows: dict[str, dict[str, list[float]]] = {c: {"bare": [], "ours": []} for c in cases}
    for case in cases:
        await drive(mw, case, batch, f"ip-warm-{case}")
        for i in range(args.batches):
            order = (("bare", raw_app), ("ours", mw)) if i % 2 == 0 else (("ours", mw), ("bare", raw_app))
            for side, app in order:
                seconds, statuses = await drive(app, case, batch, f"ip-{i}-{case}-{side}")
                if set(statuses) != {200}:
                    raise RuntimeError(f"in-process {case} {side}: statuses {dict(statuses)}")
                rows[case][side].append(seconds / batch * 1e6)
    if not args.json:
        print(
            f"# in-process (no server), memory backend, {args.batches} x {batch} requests per side and case, "
            f"bare/ours alternated; {info['cpu']}, nproc {info['nproc']}"
        )
        print(f"{'case':<12}{'bare us/req':>12}{'ours us/req':>12}{'middleware us/req':>19}")
    for case in cases:
        bare = statistics.median(rows[case]["bare"])
        ours = statistics.median(rows[case]["ours"])
        record = {
            "kind": "inprocess",
            "case": case,
            "bare_us": round(bare, 2),
            "ours_us": round(ours, 2),
            "middleware_us": round(ours - bare, 2),
            "batch": batch,
            "batches": args.batches,
        }
        if args.json:
            print(json.dumps(record))
        else:
            print(f"{case:<12}{bare:>12.2f}{ours:>12.2f}{ours - bare:>19.2f}")
    return 0


async def profile_mode(args: argparse.Namespace, cases: list[str]) -> int:
    mw = build_inprocess_middleware()
    for case in cases:
        await drive(mw, case, min(args.n, 2000), f"warm-{case}")  # warm caches outside the profile
        print(f"\n===== profile: {case}, {args.n} requests, memory backend =====", flush=True)
        if args.profile == "pyinstrument":
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0002, async_mode="disabled")
            profiler.start()
            await drive(mw, case, args.n, f"prof-{case}")
            profiler.stop()
            print(profiler.output_text(unicode=False, color=False, show_all=False))
        else:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            await drive(mw, case, args.n, f"prof-{case}")
            prof.disable()
            stats = pstats.Stats(prof).strip_dirs().sort_stats("tottime")
            stats.print_stats(int(os.environ.get("IDEM_PROFILE_ROWS", "25")))
    return 0


# ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list of " + ",".join(BACKENDS))
    p.add_argument("--cases", default=",".join(CASES), help="comma list of passthrough,new-key,replay")
    p.add_argument("--rounds", type=int, default=3, help="bare/ours round pairs per backend and case")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per round and side")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds of warm-up per server and case")
    p.add_argument("--concurrency", type=int, default=32, help="keep-alive connections")
    p.add_argument("--max-requests", type=int, default=500_000, help="cap on requests per round and side")
    p.add_argument("--latency-samples", type=int, default=300, help="sequential samples per backend (0: skip)")
    p.add_argument("--ttl", type=int, default=600, help="route TTL (s) so records in shared stores expire soon")
    p.add_argument("--server-cpus", default="0", help="taskset -c list for uvicorn ('' to not pin)")
    p.add_argument("--client-cpus", default="1", help="CPU list for this load client ('' to not pin)")
    p.add_argument("--loop", default="auto", help="uvicorn --loop (auto picks uvloop when installed)")
    p.add_argument("--http", default="auto", help="uvicorn --http (auto picks httptools when installed)")
    p.add_argument("--pythonpath", default="", help="put this first on the middleware servers' PYTHONPATH")
    p.add_argument(
        "--route-io",
        choices=("none", "redis"),
        default="none",
        help="what the benchmarked route does: nothing (the harshest ratio), or one Redis GET of its own",
    )
    p.add_argument("--redis-url", default=REDIS_URL)
    p.add_argument("--postgres-dsn", default=POSTGRES_DSN)
    p.add_argument("--quick", action="store_true", help="short run: 2 rounds x 1.5 s, 100 latency samples")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of tables")
    p.add_argument("--summary", default="", help="also append every result as a JSON line to this file")
    p.add_argument("--inprocess", action="store_true", help="no server: call the middleware directly")
    p.add_argument("-n", type=int, default=40_000, help="requests per side and case in --inprocess mode")
    p.add_argument("--batches", type=int, default=40, help="alternating batches in --inprocess mode")
    p.add_argument("--profile", choices=("cprofile", "pyinstrument"), help="profile the --inprocess loop")
    p.add_argument("--valgrind", action="store_true", help="count server instructions per request (callgrind)")
    p.add_argument("--valgrind-requests", type=int, default=1000, help="requests counted per case in --valgrind")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.duration = min(args.duration, 1.5)
        args.warmup = min(args.warmup, 0.3)
        args.latency_samples = min(args.latency_samples, 100)
        args.n = min(args.n, 10_000)
        args.batches = min(args.batches, 20)
        args.valgrind_requests = min(args.valgrind_requests, 300)
    if args.profile:
        args.inprocess = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_handlers()
    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        mode = inprocess_mode if args.inprocess else valgrind_mode if args.valgrind else server_mode
        return int(runner(mode(args)))
    except KeyboardInterrupt:
        print("# interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        stop_all()


if __name__ == "__main__":
    raise SystemExit(main())
