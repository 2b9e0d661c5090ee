"""Retry storms against a payments endpoint over uvicorn: is every payment executed exactly once?

For each store (memory: 1 worker only, its records are per process; redis and postgres: 1 and 2
workers) and each middleware (ours, and a STRAWMAN written here: the naive check-then-set
pattern, GET "seen this key?", run, then SET), K keys x D duplicates are sent at once with random
jitter. Clients retry a 409/503 after its Retry-After (bounded retries), each attempt on a fresh
connection. `POST /pay` (benchmarks/bench_app.py) sleeps ~10 ms and counts its executions per key
in Redis (INCR: right across workers). After the storm every key is sent once more (late retry),
which must be a byte-identical replay.

Printed per run: executions, extra executions (a payment charged twice), keys whose 2xx bodies
differ, late replays that match, status histogram, p50/p99 latency per attempt, attempts/s.
Ours must show 0 extra executions and 0 differing keys; the strawman shows the race.

Middleware `ours-wait` is ours with `wait=2` on `/pay`: repeats of a running payment are held and
replayed instead of answered 409. Its rows show what that buys: attempts per request, the time from
a request's first attempt to its final answer, and the store calls per request (Redis script calls
from `INFO commandstats`, Postgres transactions from `pg_stat_database`; run the benchmark alone).

    python -m benchmarks.bench_storm --quick
    python -m benchmarks.bench_storm --keys 200 --duplicates 8 --json
    python -m benchmarks.bench_storm --backends redis --workers 2 --middlewares ours,strawman
    python -m benchmarks.bench_storm --backends redis,postgres --workers 2 --middlewares ours,ours-wait
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from benchmarks._client import Response, fetch, percentile
from benchmarks.bench_app import Server, build_bare, install_signal_handlers, pin_self, protect, stop_all
from benchmarks.bench_overhead import delete_redis_prefix, drop_postgres, machine, setup_postgres
from tests.support.servers import POSTGRES_DSN, REDIS_URL, reachable

# ------------------------------------------------------------------------------------------
# The strawman: what the contract calls check-then-act (TOCTOU). Never use this.
# ------------------------------------------------------------------------------------------

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.Decoder(tuple[int, list[tuple[bytes, bytes]], bytes]).decode


class NaiveStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...
    async def set(self, key: str, value: bytes) -> None: ...


class MemoryNaive:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}

    async def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    async def set(self, key: str, value: bytes) -> None:
        self._data[key] = value


class RedisNaive:
    def __init__(self, url: str, prefix: str, ttl: int) -> None:
        import redis.asyncio as aioredis

        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=10)
        self._client = aioredis.Redis(connection_pool=pool)
        self._prefix = prefix
        self._ttl = ttl

    async def get(self, key: str) -> bytes | None:
        value = await self._client.get(self._prefix + key)
        assert value is None or isinstance(value, bytes)  # a client without decode_responses
        return value

    async def set(self, key: str, value: bytes) -> None:
        await self._client.set(self._prefix + key, value, ex=self._ttl)


class PostgresNaive:
    def __init__(self, dsn: str, table: str) -> None:
        self._dsn = dsn
        self._table = table
        self._pool: Any = None
        self._lock = asyncio.Lock()

    async def _get_pool(self) -> Any:
        if self._pool is None:
            async with self._lock:
                if self._pool is None:
                    import asyncpg

                    self._pool = await asyncpg.create_pool(self._dsn, min_size=2, max_size=20)
        return self._pool

    async def get(self, key: str) -> bytes | None:
        pool = await self._get_pool()
        value: bytes | None = await pool.fetchval(f'SELECT value FROM "{self._table}" WHERE key = $1', key)
        return value

    async def set(self, key: str, value: bytes) -> None:
        pool = await self._get_pool()
        await pool.execute(
            f'INSERT INTO "{self._table}" (key, value) VALUES ($1, $2) '
            "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value",
            key,
            value,
        )


def strawman_table_ddl(table: str) -> str:
    return f'CREATE TABLE IF NOT EXISTS "{table}" (key text PRIMARY KEY, value bytea NOT NULL)'


class StrawmanMiddleware:
    """GET "seen this key?"; if not, run the app, then SET its answer. Two concurrent retries both run."""

    def __init__(self, app: Any, *, store: NaiveStore, path: str = "/pay") -> None:
        self.app = app
        self.store = store
        self.path = path

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        key = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"idempotency-key"), None)
        if key is None:
            await self.app(scope, receive, send)
            return
        cached = await self.store.get(key)  # check ...
        if cached is not None:
            status, headers, body = _decode(cached)
            await send({"type": "http.response.start", "status": status,
                        "headers": [*headers, (b"idempotent-replayed", b"true")]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, capture)  # ... then act ...
        status = start.get("status", 500)
        if status < 500:
            headers = [(bytes(k), bytes(v)) for k, v in start.get("headers", [])]
            await self.store.set(key, _encode((status, headers, b"".join(chunks))))  # ... then set


def create_app() -> Any:
    """uvicorn factory: bench_app behind `IDEM_BENCH_MW` = ours | strawman | none."""
    url = os.environ.get("IDEM_BENCH_BACKEND", "memory://")
    kind = os.environ.get("IDEM_BENCH_MW", "ours")
    app = build_bare()
    if kind == "ours":
        return protect(app, url)
    if kind != "strawman":
        return app
    scheme = url.partition("://")[0].lower()
    store: NaiveStore
    if scheme == "memory":
        store = MemoryNaive()
    elif scheme in ("redis", "rediss", "unix"):
        ttl = int(float(os.environ.get("IDEM_BENCH_TTL", "600")))
        store = RedisNaive(url, os.environ.get("IDEM_BENCH_PREFIX", "idem-bench-straw:"), ttl)
    else:
        store = PostgresNaive(url, os.environ.get("IDEM_BENCH_STRAW_TABLE", "idem_bench_straw"))
    app.add_middleware(StrawmanMiddleware, store=store)
    return app


# ------------------------------------------------------------------------------------------
# The storm
# ------------------------------------------------------------------------------------------


@dataclass
class StormResult:
    attempts: int = 0
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    final: Counter[str] = field(default_factory=Counter)
    bodies: dict[str, set[bytes]] = field(default_factory=dict)
    first_body: dict[str, bytes] = field(default_factory=dict)
    replays: int = 0
    replays_without_length: int = 0
    gave_up: int = 0
    answered: list[float] = field(default_factory=list)  # per request: first attempt to final answer


def request_bytes(key: str, amount: int) -> bytes:
    body = json.dumps({"amount": amount, "currency": "EUR"}).encode()
    return (
        f"POST /pay HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nidempotency-key: {key}\r\nconnection: close\r\n\r\n"
    ).encode("latin-1") + body


async def storm(port: int, keys: list[str], args: argparse.Namespace, rng: random.Random) -> StormResult:
    res = StormResult()
    jobs = [(k, i) for i, k in enumerate(keys) for _ in range(args.duplicates)]
    rng.shuffle(jobs)
    gate = asyncio.Semaphore(args.max_inflight)
    perf = time.perf_counter
    deadline = perf() + args.time_limit

    def record(key: str, r: Response) -> None:
        if 200 <= r.status < 300:
            res.bodies.setdefault(key, set()).add(r.body)
            res.first_body.setdefault(key, r.body)
            if r.header("idempotent-replayed") == b"true":
                res.replays += 1
                if r.header("content-length") is None:
                    res.replays_without_length += 1

    async def one(key: str, amount: int, delay: float) -> None:
        raw = request_bytes(key, amount)
        await asyncio.sleep(delay)
        began = perf()
        for attempt in range(args.max_retries + 1):
            if perf() > deadline:
                res.final["time-limit"] += 1
                return
            t0 = perf()
            try:
                async with gate:
                    r = await fetch("127.0.0.1", port, raw, timeout=args.request_timeout)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
                res.attempts += 1
                res.statuses[type(exc).__name__] += 1
                await asyncio.sleep(0.05 * (attempt + 1))
                continue
            res.attempts += 1
            res.latencies.append(perf() - t0)
            res.statuses[str(r.status)] += 1
            if r.status in (409, 503) and attempt < args.max_retries:
                retry_after = r.header("retry-after")
                wait = float(retry_after) if retry_after and retry_after.isdigit() else args.default_backoff
                await asyncio.sleep(min(wait, args.max_retry_after) + rng.uniform(0, args.jitter))
                continue
            record(key, r)
            res.final[str(r.status)] += 1
            res.answered.append(perf() - began)
            return
        res.gave_up += 1
        res.final["gave-up"] += 1

    t0 = perf()
    tasks = [asyncio.ensure_future(one(k, a, rng.uniform(0, args.jitter))) for k, a in jobs]
    done, pending = await asyncio.wait(tasks, timeout=args.time_limit + args.request_timeout + 5)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    res.wall = perf() - t0
    for t in done:
        if t.exception() is not None:
            res.final[f"crash:{type(t.exception()).__name__}"] += 1
    return res


async def late_retries(port: int, keys: list[str], res: StormResult, args: argparse.Namespace) -> tuple[int, int]:
    """Every key once more, after the storm: (byte-identical replays, keys checked)."""
    gate = asyncio.Semaphore(min(64, args.max_inflight))

    async def one(i: int, key: str) -> bool:
        async with gate:
            try:
                r = await fetch("127.0.0.1", port, request_bytes(key, i), timeout=args.request_timeout)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError):
                return False
        first = res.first_body.get(key)
        return r.header("idempotent-replayed") == b"true" and first is not None and r.body == first

    checks = await asyncio.wait_for(
        asyncio.gather(*(one(i, k) for i, k in enumerate(keys))), args.time_limit + args.request_timeout
    )
    return sum(checks), len(keys)


async def executions(url: str, prefix: str, keys: list[str]) -> list[int]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        counts: list[int] = []
        for i in range(0, len(keys), 500):
            values = await client.mget([prefix + k for k in keys[i : i + 500]])
            counts += [int(v) if v is not None else 0 for v in values]
        return counts
    finally:
        await client.aclose()


# ------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------


def matrix(args: argparse.Namespace, skipped: list[str]) -> list[tuple[str, int, str]]:
    runs = []
    for b in [b for b in args.backends.split(",") if b and b not in skipped]:
        for w in [int(w) for w in args.workers.split(",") if w]:
            if b == "memory" and w > 1:
                continue  # per-process store: two workers double-execute by construction (see README)
            for mw in [m for m in args.middlewares.split(",") if m]:
                runs.append((b, w, mw))
    return runs


async def main_async(args: argparse.Namespace) -> int:
    run = uuid.uuid4().hex[:10]
    urls = {"memory": "memory://", "redis": args.redis_url, "postgres": args.postgres_dsn}
    if not reachable(args.redis_url):
        print(f"bench_storm needs Redis at {args.redis_url} to count executions", file=sys.stderr)
        return 2
    skipped = [] if reachable(args.postgres_dsn) else ["postgres"]
    pinning = pin_self(args.client_cpus)
    info = {**machine(), "run": run, "pinning": pinning}
    if args.json:
        print(json.dumps({"kind": "machine", **info, "skipped": skipped}), flush=True)
    else:
        print(f"# {info['cpu']}, nproc {info['nproc']}, python {info['python']}; {pinning}")
        print(
            f"# {args.keys} keys x {args.duplicates} duplicates, jitter {args.jitter * 1000:.0f} ms, "
            f"max {args.max_retries} retries honouring Retry-After (capped {args.max_retry_after} s), seed {args.seed}"
        )
        if skipped:
            print(f"# skipped (not reachable): {', '.join(skipped)}")
    table = f"idem_bench_storm_{run}"
    straw_table = f"idem_bench_straw_{run}"
    record_prefix = f"idem-bench:{run}:"
    straw_prefix = f"idem-bench-straw:{run}:"
    rows: list[dict[str, Any]] = []
    try:
        if "postgres" in args.backends and "postgres" not in skipped:
            await setup_postgres(args.postgres_dsn, table)
            import asyncpg

            conn = await asyncpg.connect(args.postgres_dsn, timeout=5)
            try:
                await conn.execute(strawman_table_ddl(straw_table))
            finally:
                await conn.close()
        for n, (backend, workers, mw) in enumerate(matrix(args, skipped)):
            rng = random.Random(args.seed + n)
            counter_prefix = f"idem-bench-count:{run}:{n}:"
            env = {
                "IDEM_BENCH_BACKEND": urls[backend],
                "IDEM_BENCH_MW": "ours" if mw == "ours-wait" else mw,
                "IDEM_BENCH_WAIT": "2" if mw == "ours-wait" else "",
                "IDEM_BENCH_PREFIX": straw_prefix if mw == "strawman" else record_prefix,
                "IDEM_BENCH_TABLE": table,
                "IDEM_BENCH_STRAW_TABLE": straw_table,
                "IDEM_BENCH_TTL": str(args.ttl),
                "IDEM_BENCH_COUNTER_URL": args.redis_url,
                "IDEM_BENCH_COUNTER_PREFIX": counter_prefix,
                "IDEM_BENCH_PAY_SLEEP": str(args.pay_sleep),
            }
            cpus = args.server_cpus if workers == 1 else None  # 2 workers: both CPUs (see README)
            label = f"storm-{backend}-{workers}w-{mw}-{run}"
            keys = [f"pay-{run}-{n}-{i}" for i in range(args.keys)]
            with Server(env, label=label, workers=workers, cpus=cpus, factory="benchmarks.bench_storm:create_app") as s:
                calls_before = await store_calls(backend, args)
                res = await storm(s.port, keys, args, rng)
                late_ok, late_n = await late_retries(s.port, keys, res, args)
            await asyncio.sleep(0.5)  # the server's connections closed: Postgres has flushed their counts
            calls = await store_calls(backend, args) - calls_before
            counts = await executions(args.redis_url, counter_prefix, keys)
            row = summarize(backend, workers, mw, args, res, counts, late_ok, late_n)
            # per request, the late retries (one replay each) included
            per = calls / (row["requests"] + late_n) if calls_before >= 0 else None
            row["store_calls_per_request"] = None if per is None else round(per, 2)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"  {backend:<8} {workers}w {mw:<8} executions {row['executions']:>5}  extra {row['extra']:>4}  "
                    f"differing {row['keys_bodies_differ']:>4}  late {late_ok}/{late_n}  {row['attempts_per_s']:.0f}/s",
                    flush=True,
                )
    finally:
        stop_all()
        try:
            if "postgres" in args.backends and "postgres" not in skipped:
                await drop_postgres(args.postgres_dsn, table, straw_table)
            for prefix in (record_prefix, straw_prefix, f"idem-bench-count:{run}:"):
                await delete_redis_prefix(args.redis_url, prefix)
        except Exception as exc:  # cleanup must not hide the real error
            print(f"# cleanup failed: {exc!r}", file=sys.stderr)
    if not args.json:
        print_table(rows)
    ours = [r for r in rows if r["middleware"].startswith("ours")]
    bad = [r for r in ours if r["extra"] or r["keys_bodies_differ"] or r["server_5xx"]]
    return 1 if bad else 0


async def store_calls(backend: str, args: argparse.Namespace) -> int:
    """Store calls made so far by the server under test: Redis script calls, Postgres transactions
    (-1 where not counted: the memory store)."""
    if backend == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(args.redis_url)
        try:
            stats = await client.info("commandstats")
        finally:
            await client.aclose()
        return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval", "fcall"))
    if backend == "postgres":
        import asyncpg

        conn = await asyncpg.connect(args.postgres_dsn, timeout=5)
        try:
            await conn.execute("SELECT pg_stat_clear_snapshot()")
            value = await conn.fetchval(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
            )
        finally:
            await conn.close()
        return int(value) - 2  # this function's own two statements
    return -1


def summarize(
    backend: str,
    workers: int,
    mw: str,
    args: argparse.Namespace,
    res: StormResult,
    counts: list[int],
    late_ok: int,
    late_n: int,
) -> dict[str, Any]:
    ms = 1000.0
    return {
        "kind": "storm",
        "backend": backend,
        "workers": workers,
        "middleware": mw,
        "keys": args.keys,
        "duplicates": args.duplicates,
        "requests": args.keys * args.duplicates,
        "attempts": res.attempts,
        "executions": sum(counts),
        "extra": sum(c - 1 for c in counts if c > 1),
        "keys_executed_twice_or_more": sum(1 for c in counts if c > 1),
        "keys_not_executed": sum(1 for c in counts if c == 0),
        "keys_bodies_differ": sum(1 for b in res.bodies.values() if len(b) > 1),
        "replays": res.replays,
        "replays_without_content_length": res.replays_without_length,
        "late_identical": late_ok,
        "late_checked": late_n,
        "statuses": dict(sorted(res.statuses.items())),
        "final": dict(sorted(res.final.items())),
        "server_5xx": sum(n for s, n in res.statuses.items() if s.isdigit() and s.startswith("5") and s != "503"),
        "gave_up": res.gave_up,
        "attempts_per_request": round(res.attempts / (args.keys * args.duplicates), 2),
        "answered_p50_ms": round(percentile(res.answered, 50) * ms, 1) if res.answered else None,
        "answered_p99_ms": round(percentile(res.answered, 99) * ms, 1) if res.answered else None,
        "p50_ms": round(percentile(res.latencies, 50) * ms, 2),
        "p99_ms": round(percentile(res.latencies, 99) * ms, 2),
        "wall_s": round(res.wall, 2),
        "attempts_per_s": round(res.attempts / res.wall, 1) if res.wall else 0.0,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    head = (
        f"{'backend':<9}{'wk':>3} {'middleware':<11}{'execs':>6}{'extra':>6}{'2x keys':>8}{'differ':>7}"
        f"{'late ok':>10}{'p50 ms':>8}{'p99 ms':>8}{'att/s':>7}  statuses (all attempts)"
    )
    print(head)
    print("-" * (len(head) + 20))
    for r in rows:
        statuses = " ".join(f"{k}:{v}" for k, v in r["statuses"].items())
        late = f"{r['late_identical']}/{r['late_checked']}"
        print(
            f"{r['backend']:<9}{r['workers']:>3} {r['middleware']:<11}{r['executions']:>6}{r['extra']:>6}"
            f"{r['keys_executed_twice_or_more']:>8}{r['keys_bodies_differ']:>7}{late:>10}"
            f"{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['attempts_per_s']:>7.0f}  {statuses}"
        )
    print()
    by = {(r["backend"], r["workers"], r["middleware"]): r for r in rows}
    pairs = sorted({(b, w) for b, w, _ in by})
    if any((b, w, "strawman") in by and (b, w, "ours") in by for b, w in pairs):
        print("Extra executions, ours vs strawman (ours must be 0):")
        for b, w in pairs:
            ours, straw = by.get((b, w, "ours")), by.get((b, w, "strawman"))
            if ours and straw:
                verdict = "ok" if ours["extra"] == 0 and ours["keys_bodies_differ"] == 0 else "FAIL"
                print(
                    f"  {b:<8} {w}w   ours {ours['extra']:>4}   strawman {straw['extra']:>4} "
                    f"({straw['keys_executed_twice_or_more']} of {straw['keys']} keys ran twice or more)   {verdict}"
                )
        print()
    if any((b, w, "ours-wait") in by for b, w in pairs):
        print("Held repeats (wait=2) vs 409 + Retry-After, per request:")
        for b, w in pairs:
            for mw in ("ours", "ours-wait"):
                if (row := by.get((b, w, mw))) is not None:
                    calls = "-" if row["store_calls_per_request"] is None else f"{row['store_calls_per_request']:.2f}"
                    print(
                        f"  {b:<8} {w}w {mw:<9}  attempts {row['attempts_per_request']:.2f}  store calls {calls:>5}"
                        f"  answered p50 {row['answered_p50_ms']} ms  p99 {row['answered_p99_ms']} ms"
                    )
        print()
    for b, w in pairs:
        for mw in ("ours", "ours-wait"):
            if (ours := by.get((b, w, mw))) is not None:
                met = "met" if ours["extra"] == 0 and ours["keys_bodies_differ"] == 0 else "MISSED"
                name = "" if mw == "ours" else " (wait)"
                print(f"target {b} {w} worker(s){name} extra executions: {ours['extra']} (goal 0) {met}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="memory,redis,postgres")
    p.add_argument("--workers", default="1,2,4", help="uvicorn worker counts (memory runs 1 only)")
    p.add_argument("--middlewares", default="ours,strawman")
    p.add_argument("--keys", type=int, default=200)
    p.add_argument("--duplicates", type=int, default=8)
    p.add_argument("--jitter", type=float, default=0.05, help="max random delay (s) before each first attempt")
    p.add_argument("--max-retries", type=int, default=5, help="retries per request after 409/503/errors")
    p.add_argument("--max-retry-after", type=float, default=2.0, help="cap (s) on a honoured Retry-After")
    p.add_argument("--default-backoff", type=float, default=0.2, help="wait (s) after a 409 without Retry-After")
    p.add_argument("--max-inflight", type=int, default=512, help="cap on open client connections")
    p.add_argument("--pay-sleep", type=float, default=0.01, help="seconds the handler takes")
    p.add_argument("--request-timeout", type=float, default=10.0)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per storm, all retries included")
    p.add_argument("--ttl", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--server-cpus", default="0", help="taskset -c list for 1-worker servers ('' to not pin)")
    p.add_argument("--client-cpus", default="1")
    p.add_argument("--redis-url", default=REDIS_URL)
    p.add_argument("--postgres-dsn", default=POSTGRES_DSN)
    p.add_argument("--quick", action="store_true", help="50 keys x 8 duplicates")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.keys = min(args.keys, 50)
        args.time_limit = min(args.time_limit, 30.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_handlers()
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        print("# interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        stop_all()


if __name__ == "__main__":
    raise SystemExit(main())
