"""Store round trips per request: what a new key and a replay cost in Redis commands and SQL statements.

The middleware runs in-process around a raw ASGI app (no HTTP server, no lease renewal: the app
answers at once). After a short warm-up, N requests with fresh keys run one after another, then
N replays of those keys.

- Redis: `INFO commandstats` deltas (`evalsha`, `eval`, `script|load`, all commands) on the server,
  next to an exact client-side count of the commands this process sent. On the shared Redis other
  processes' commands land in the server delta too; when the two disagree the server figure is
  flagged as polluted (use `--throwaway` for a private redis-server, or rerun).
- Postgres: statements sent by an asyncpg pool whose connections count their `execute`/`fetch*`
  calls (pg_stat_statements needs a server restart, so it is not assumed), and the transactions
  they make: a statement sent outside `BEGIN` is a transaction of its own (committed by the
  server), plus every explicit `COMMIT`. Statement preparation
  happens once per connection during the warm-up and is not counted.

Targets (the contract's costs): 2 per new request (claim + complete), 1 per replay.

    python -m benchmarks.bench_roundtrips
    python -m benchmarks.bench_roundtrips --n 500 --backends redis --throwaway --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Message, Receive, Scope, Send
from tests.support.servers import POSTGRES_DSN, REDIS_URL, redis_process

TARGET = {"new": 2.0, "replay": 1.0}
WARMUP = 20
BODY = b'{"amount": 100, "currency": "EUR"}'


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """A payment endpoint that answers at once."""
    while (await receive()).get("more_body", False):
        pass
    body = b'{"id":"pay_' + uuid.uuid4().hex.encode() + b'"}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 201, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def call(mw: IdempotencyMiddleware, key: str) -> tuple[int, bool]:
    """One POST /pay with `key`; returns (status, replayed)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/pay",
        "raw_path": b"/pay",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"idempotency-key", key.encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    delivered = False
    start: Message = {}

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal start
        if message["type"] == "http.response.start":
            start = message

    await mw(scope, receive, send)
    headers = dict(start.get("headers", ()))
    return int(start["status"]), headers.get(b"idempotent-replayed") == b"true"


async def phases(
    mw: IdempotencyMiddleware, n: int, before: Callable[[], Awaitable[Any]], after: Callable[[Any], Awaitable[Any]]
) -> dict[str, Any]:
    """Warm up, then N new keys and N replays; `before`/`after` snapshot the counters around each phase."""
    run = uuid.uuid4().hex[:10]
    for i in range(WARMUP):
        await call(mw, f"warm-{run}-{i}")
        await call(mw, f"warm-{run}-{i}")
    keys = [f"{run}-{i}" for i in range(n)]
    out: dict[str, Any] = {}
    for phase, want_replay in (("new", False), ("replay", True)):
        snapshot = await before()
        started = time.perf_counter()
        answers = [await call(mw, k) for k in keys]
        elapsed = time.perf_counter() - started
        out[phase] = await after(snapshot)
        out[phase]["seconds"] = round(elapsed, 3)
        bad = [a for a in answers if a != (201, want_replay)]
        if bad:
            raise RuntimeError(f"{phase}: {len(bad)} unexpected answers, e.g. {bad[0]}")
    return out


def policy() -> list[RoutePolicy]:
    return [RoutePolicy("/pay", methods=["POST"], required=True, single_tenant=True, ttl=600)]


# -- Redis ------------------------------------------------------------------------------------


def _stats(info: dict[str, Any]) -> Counter[str]:
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()})


@contextlib.contextmanager
def throwaway_redis() -> Iterator[str]:
    """A private redis-server on a free port (`tests.support.servers.RedisProcess`), killed on exit."""
    if shutil.which("redis-server") is None:
        raise SystemExit("--throwaway needs redis-server on PATH")
    with tempfile.TemporaryDirectory() as workdir, redis_process(Path(workdir)) as server:
        yield server.url


async def bench_redis(url: str, n: int) -> dict[str, Any]:
    from idem_asgi.backends.redis import RedisBackend

    prefix = f"idem-bench:{uuid.uuid4().hex}:"
    backend = RedisBackend.from_url(url, prefix=prefix)
    sent: Counter[str] = Counter()
    client = backend.client
    original = client.execute_command

    async def counting(*args: Any, **options: Any) -> Any:
        sent[str(args[0]).lower()] += 1
        return await original(*args, **options)

    client.execute_command = counting  # the exact count of what this process sends (redis-py path)
    lean = backend._lean
    if lean is not None:  # from_url's lean pool sends the script calls itself
        lean_execute = lean.execute

        async def counting_lean(*args: Any) -> Any:
            sent[(args[0].decode() if isinstance(args[0], bytes) else str(args[0])).lower()] += 1
            return await lean_execute(*args)

        lean.execute = counting_lean  # type: ignore[method-assign]
    admin = type(client).from_url(url)
    try:
        mw = IdempotencyMiddleware(app, backend=backend, routes=policy())

        async def before() -> tuple[Counter[str], Counter[str]]:
            info = await admin.info("commandstats")  # sent before the phase starts, not counted
            return _stats(info), Counter(sent)

        async def after(snapshot: tuple[Counter[str], Counter[str]]) -> dict[str, Any]:
            server0, client0 = snapshot
            server = _stats(await admin.info("commandstats"))
            server.subtract(server0)
            server["info"] -= 1  # our own INFO for the snapshot
            server = +server  # drop zero and negative counts
            client_delta = Counter(sent)
            client_delta.subtract(client0)
            scripts = server["evalsha"] + server["eval"]
            ours = client_delta["evalsha"] + client_delta["eval"]
            return {
                "server_script_calls_per_request": round(scripts / n, 3),
                # Redis counts the commands scripts run (TIME, HMGET, HSET, ...) too.
                "server_commands_incl_inside_scripts_per_request": round(
                    sum(v for v in server.values() if v > 0) / n, 3
                ),
                "server_script_loads": server["script|load"],
                "client_commands_per_request": round(sum(client_delta.values()) / n, 3),
                "client_script_calls_per_request": round(ours / n, 3),
                "server_polluted": scripts != ours,
            }

        result = await phases(mw, n, before, after)
    finally:
        await admin.aclose()
        names = [k async for k in backend.client.scan_iter(match=f"{prefix}*", count=1000)]
        for i in range(0, len(names), 500):
            await backend.client.delete(*names[i : i + 500])
        await backend.aclose()
    return result


# -- Postgres ---------------------------------------------------------------------------------

STATEMENTS: Counter[str] = Counter()


def _label(query: str) -> str:
    if "RESET ALL" in query or "pg_advisory_unlock_all" in query:
        return "pool reset"  # asyncpg's Pool.release() runs this on every release unless reset= is given
    words = query.split()
    return words[0].upper() if words else "?"


def counting_connection_class() -> type:
    import asyncpg

    class CountingConnection(asyncpg.Connection):  # type: ignore[misc]
        """Counts every statement sent on this connection, by kind (prepared statements are cached)."""

        async def execute(self, query: str, *args: Any, **kwargs: Any) -> Any:
            self._count(query)
            return await super().execute(query, *args, **kwargs)

        async def fetch(self, query: str, *args: Any, **kwargs: Any) -> Any:
            self._count(query)
            return await super().fetch(query, *args, **kwargs)

        async def fetchrow(self, query: str, *args: Any, **kwargs: Any) -> Any:
            self._count(query)
            return await super().fetchrow(query, *args, **kwargs)

        async def fetchval(self, query: str, *args: Any, **kwargs: Any) -> Any:
            self._count(query)
            return await super().fetchval(query, *args, **kwargs)

        def _count(self, query: str) -> None:
            label = _label(query)
            STATEMENTS[label] += 1
            if label == "COMMIT" or not self.is_in_transaction():
                STATEMENTS["(transactions)"] += 1  # not a statement: the commits those statements made

        async def executemany(self, command: str, args: Any, **kwargs: Any) -> Any:
            self._count(command)
            return await super().executemany(command, args, **kwargs)

    return CountingConnection


async def bench_postgres(dsn: str, n: int) -> dict[str, Any]:
    from idem_asgi.backends.postgres import PostgresBackend

    table = "idem_bench_records"
    namespace = f"bench-{uuid.uuid4().hex[:10]}"
    options: dict[str, Any] = {"min_size": 1, "max_size": 2, "connection_class": counting_connection_class()}
    backend = PostgresBackend.from_dsn(dsn, table=table, **options)  # the pool users of from_dsn get
    try:
        await backend.setup()
        mw = IdempotencyMiddleware(app, backend=backend, routes=policy(), namespace=namespace)

        async def before() -> Counter[str]:
            return Counter(STATEMENTS)

        async def after(snapshot: Counter[str]) -> dict[str, Any]:
            delta = Counter(STATEMENTS)
            delta.subtract(snapshot)
            transactions = delta.pop("(transactions)", 0)
            return {
                "transactions_per_request": round(transactions / n, 3),
                "statements_per_request": round(sum(delta.values()) / n, 3),
                "backend_statements_per_request": round((sum(delta.values()) - delta["pool reset"]) / n, 3),
                "by_kind": {k: v for k, v in delta.items() if v},
            }

        result = await phases(mw, n, before, after)
    finally:
        pool = backend._pool
        if pool is not None:
            async with pool.acquire() as conn:
                await conn.execute(f"DELETE FROM {table} WHERE namespace = $1", namespace)
        await backend.aclose()
    result["pool_reset"] = "none (from_dsn's default)"
    return result


# -- main -------------------------------------------------------------------------------------


def verdict(value: float, target: float) -> str:
    return "ok" if value <= target + 1e-9 else f"OVER TARGET ({target:g})"


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"n": args.n, "targets": TARGET}
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if "redis" in backends:
        if args.throwaway:
            with throwaway_redis() as url:
                results["redis"] = await bench_redis(url, args.n)
                results["redis"]["server"] = "throwaway"
        else:
            results["redis"] = await bench_redis(args.redis_url, args.n)
            results["redis"]["server"] = args.redis_url
    if "postgres" in backends:
        results["postgres"] = await bench_postgres(args.postgres_dsn, args.n)
    return results


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"store round trips per request, n={results['n']} (targets: new 2, replay 1)"]
    failures = []
    targets: list[tuple[str, str, float]] = []
    if "redis" in results:
        r = results["redis"]
        lines.append(f"redis ({r['server']}):")
        for phase in ("new", "replay"):
            p = r[phase]
            ours = p["client_script_calls_per_request"]
            note = "  [server delta includes other clients' traffic]" if p["server_polluted"] else ""
            lines.append(
                f"  {phase:<6} evalsha+eval per request: {p['server_script_calls_per_request']:.3f} (server), "
                f"{ours:.3f} (sent by us); all commands {p['client_commands_per_request']:.3f}; "
                f"script loads {p['server_script_loads']}; {p['seconds']:.2f}s  {verdict(ours, TARGET[phase])}{note}"
            )
            if ours > TARGET[phase] + 1e-9:
                failures.append(f"redis {phase}")
            targets.append(("redis", phase, ours))
    if "postgres" in results:
        r = results["postgres"]
        lines.append(f"postgres (pool reset: {r['pool_reset']}):")
        for phase in ("new", "replay"):
            p = r[phase]
            value = p["statements_per_request"]
            lines.append(
                f"  {phase:<6} statements per request: {value:.3f} "
                f"(backend's own {p['backend_statements_per_request']:.3f}) {p['by_kind']}, "
                f"transactions {p['transactions_per_request']:.3f}; "
                f"{p['seconds']:.2f}s  {verdict(value, TARGET[phase])}"
            )
            if value > TARGET[phase] + 1e-9:
                failures.append(f"postgres {phase}")
            targets.append(("postgres", phase, value))
    results["over_target"] = failures
    lines.append("")
    for store, phase, value in targets:
        met = "met" if value <= TARGET[phase] + 1e-9 else "MISSED"
        lines.append(f"target {store} {phase} round trips per request: {value:.3f} (goal <= {TARGET[phase]}) {met}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--n", type=int, default=200, help="new keys, then as many replays (default 200)")
    parser.add_argument("--backends", default="redis,postgres", help="comma-separated: redis, postgres")
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--postgres-dsn", default=POSTGRES_DSN)
    parser.add_argument("--throwaway", action="store_true", help="measure Redis on a private redis-server")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a figure is over its target")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error("--n must be at least 1")
    results = asyncio.run(run(args))
    lines = report(results)
    print(json.dumps(results, indent=2) if args.json else "\n".join(lines))
    return 1 if args.check and results["over_target"] else 0


if __name__ == "__main__":
    sys.exit(main())
