"""Reliability scorecards, the ground-truth effect ledgers, and the two request drivers they score.

Every storm or fault run prints ONE scorecard line (JSON, prefixed `SCORECARD `) and, when the
environment variable `IDEM_SCORECARD_FILE` is set, appends the same JSON object as one line to that
file, so the reliability table (docs/reliability.md) can be built from a real run.

Fields:
- `test`, `backend`, `seed`, `requests`, `keys`, `dup_per_key`, `faults` ({fault type: count}).
- `executions`: real handler executions, read from the ledger (not from the middleware).
- `double_executions`: executions beyond the first, summed over keys (zero tolerance).
- `replays`: answers marked `Idempotent-Replayed: true`.
- `replay_mismatches`: 2xx answers of a key that differ from that key's first 2xx (status, app
  headers, body bytes); `date`/`server` (added by the server) and the replay marker are ignored
  (zero tolerance).
- `409`, `422`, `503`, `5xx` (every status 500-599, 503 included), `conn_errors` (no HTTP answer:
  the server died or the connection was reset).
- `unaccounted_keys`: keys whose final state is none of the accepted ones (zero tolerance):
  `completed` (a replay or a first 2xx, ledger 1), `outcome_unknown` (409 outcome-unknown, ledger
  0 or 1), `not_run` (refused before running, key free, ledger 0).
- `lost_completions`: keys whose effect happened (ledger 1) but whose answer was never stored, so
  they end `outcome_unknown`; `blocked_without_effect`: `outcome_unknown` keys with ledger 0.
- `final`: how many keys ended in each state; `latency_ms`: p50/p99 per outcome; `wall_s`.

Ledgers count executions outside the middleware: `MemoryLedger` (in-process Counter, for the
memory backend), `RedisLedger` (INCR per key under a unique per-run prefix), `PostgresLedger`
(one row per execution in a table without unique constraints).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from idem_asgi.http.problems import slug_of
from tests.support.asgi import Result, drive, http_scope
from tests.support.servers import POSTGRES_DSN, REDIS_URL

ZERO_TOLERANCE = ("double_executions", "replay_mismatches", "unaccounted_keys")
ACCEPTED = {"completed": (1,), "outcome_unknown": (0, 1), "not_run": (0,)}
_IGNORED_HEADERS = frozenset({b"idempotent-replayed", b"date", b"server"})


# -- answers ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    """One answer as the client saw it; `status` 0 means no HTTP answer at all (`error` says why)."""

    key: str
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    latency: float
    error: str | None = None
    done: float = field(default_factory=time.monotonic)

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def replayed(self) -> bool:
        return self.header(b"idempotent-replayed") == b"true"

    @property
    def problem(self) -> str | None:
        if self.header(b"content-type") != b"application/problem+json":
            return None
        try:
            return slug_of(str(json.loads(self.body)["type"])) or ""
        except (ValueError, KeyError, TypeError):
            return "unparseable"

    @property
    def outcome(self) -> str:
        """first | replay | 409:<problem> | 422 | 503 | 5xx | conn_error | <status>."""
        if self.status == 0:
            return "conn_error"
        if 200 <= self.status < 300:
            return "replay" if self.replayed else "first"
        if self.status == 409:
            return f"409:{self.problem}"
        if self.status in (422, 503):
            return str(self.status)
        if self.status >= 500:
            return "5xx"
        return str(self.status)

    def canonical(self) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
        headers = tuple((k.lower(), v) for k, v in self.headers if k.lower() not in _IGNORED_HEADERS)
        return self.status, headers, self.body


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an unsorted sequence (0 for an empty one)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def final_state(answers: Sequence[Answer]) -> str:
    """The state a key ended in, judged by the answer that finished LAST (the probe after the run)."""
    if not answers:
        return "unknown"
    last = max(answers, key=lambda a: a.done)
    if 200 <= last.status < 300:
        return "completed"
    if last.outcome == "409:outcome-unknown":
        return "outcome_unknown"
    if last.outcome == "409:request-in-progress":
        return "stuck_in_progress"
    if last.status == 503:
        return "not_run"
    return f"other:{last.outcome}"


# -- the scorecard ----------------------------------------------------------------------------


@dataclass
class Scorecard:
    test: str
    backend: str
    seed: int | None = None
    keys: int = 0
    dup_per_key: int = 0
    answers: list[Answer] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)

    def add(self, *answers: Answer) -> None:
        self.answers.extend(answers)

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults[kind] += n

    def by_key(self) -> dict[str, list[Answer]]:
        grouped: dict[str, list[Answer]] = defaultdict(list)
        for a in self.answers:
            grouped[a.key].append(a)
        return grouped

    def finish(
        self,
        executions: Mapping[str, int],
        *,
        final: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Compute, print (one line) and append the scorecard; `final` maps key -> end state."""
        grouped = self.by_key()
        keys = sorted(set(grouped) | set(executions) | set(final or {}))
        mismatches = 0
        for answers in grouped.values():
            ok = [a for a in answers if 200 <= a.status < 300]
            if not ok:
                continue
            reference = next((a for a in ok if not a.replayed), ok[0]).canonical()
            mismatches += sum(a.canonical() != reference for a in ok)
        if final is None:
            final = {k: final_state(grouped.get(k, [])) for k in keys}
        unaccounted = sorted(k for k in keys if executions.get(k, 0) not in ACCEPTED.get(final.get(k, "unknown"), ()))
        statuses = Counter(a.status for a in self.answers)
        outcomes: dict[str, list[float]] = defaultdict(list)
        for a in self.answers:
            outcomes[a.outcome].append(a.latency * 1000)
        card: dict[str, Any] = {
            "test": self.test,
            "backend": self.backend,
            "seed": self.seed,
            "requests": len(self.answers),
            "keys": self.keys or len(keys),
            "dup_per_key": self.dup_per_key,
            "faults": dict(self.faults),
            "executions": sum(executions.values()),
            "double_executions": sum(max(0, n - 1) for n in executions.values()),
            "replays": sum(a.replayed for a in self.answers),
            "replay_mismatches": mismatches,
            "409": statuses[409],
            "422": statuses[422],
            "5xx": sum(n for s, n in statuses.items() if 500 <= s < 600),
            "503": statuses[503],
            "conn_errors": statuses[0],
            "unaccounted_keys": len(unaccounted),
            "lost_completions": sum(1 for k in keys if final.get(k) == "outcome_unknown" and executions.get(k, 0) == 1),
            "blocked_without_effect": sum(
                1 for k in keys if final.get(k) == "outcome_unknown" and executions.get(k, 0) == 0
            ),
            "final": dict(Counter(final.get(k, "unknown") for k in keys)),
            "outcomes": {o: len(v) for o, v in sorted(outcomes.items())},
            "latency_ms": {
                o: {"p50": round(percentile(v, 50), 2), "p99": round(percentile(v, 99), 2)}
                for o, v in sorted(outcomes.items())
            },
            "wall_s": round(time.monotonic() - self.started, 3),
        }
        if unaccounted:
            card["unaccounted"] = unaccounted[:20]
        if extra:
            card.update(extra)
        report(card)
        return card


def report(line: Mapping[str, Any], tag: str = "SCORECARD") -> None:
    """Print one result line and append it to `IDEM_SCORECARD_FILE` (suites without a Scorecard:
    the model, the bad-input properties, the bounds), so the reliability table covers them too."""
    text = json.dumps(line)
    print(f"\n{tag} {text}")
    path = os.environ.get("IDEM_SCORECARD_FILE")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(text + "\n")


def assert_zero_tolerance(card: Mapping[str, Any]) -> None:
    bad = {f: card[f] for f in ZERO_TOLERANCE if card[f]}
    assert not bad, f"{card['test']} [{card['backend']}]: {bad}; scorecard: {json.dumps(card)}"


# -- ledgers: the ground truth of executions ----------------------------------------------------


class MemoryLedger:
    """Counts executions in this process (for the memory backend, which is per process anyway)."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()

    async def setup(self) -> None:
        pass

    async def incr(self, key: str) -> None:
        self.runs[key] += 1

    async def counts(self, keys: Iterable[str]) -> dict[str, int]:
        return {k: self.runs[k] for k in keys}

    async def cleanup(self) -> None:
        self.runs.clear()

    async def aclose(self) -> None:
        pass


class RedisLedger:
    """`INCR <prefix><key>` per execution, on a prefix unique to the run."""

    def __init__(self, url: str, run: str, *, max_connections: int = 32) -> None:
        import redis.asyncio as aioredis

        self.prefix = f"idem-rel-ledger:{run}:"
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=10)
        self.client = aioredis.Redis.from_pool(pool)

    async def setup(self) -> None:
        await self.client.ping()

    async def incr(self, key: str) -> None:
        await self.client.incr(self.prefix + key)

    async def counts(self, keys: Iterable[str]) -> dict[str, int]:
        keys = list(keys)
        out: dict[str, int] = {}
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            values = await self.client.mget([self.prefix + k for k in chunk])
            out.update({k: int(v or 0) for k, v in zip(chunk, values, strict=True)})
        return out

    async def cleanup(self) -> None:
        names = [k async for k in self.client.scan_iter(match=f"{self.prefix}*", count=1000)]
        for i in range(0, len(names), 500):
            await self.client.delete(*names[i : i + 500])

    async def aclose(self) -> None:
        await self.client.aclose()


LEDGER_TABLE = "idem_reliability_ledger"


class PostgresLedger:
    """One row per execution in a table with no unique constraint, tagged with the run."""

    def __init__(self, dsn: str, run: str, *, max_size: int = 4) -> None:
        self.dsn = dsn
        self.run = run
        self.max_size = max_size
        self.pool: Any = None
        self._creating: asyncio.Lock | None = None

    async def _pool(self) -> Any:
        if self.pool is None:
            import asyncpg

            # One pool, however many first incr() calls race here (each would create its own).
            self._creating = self._creating or asyncio.Lock()
            async with self._creating:
                if self.pool is None:
                    self.pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=self.max_size)
        return self.pool

    async def setup(self) -> None:
        """Create the table (call from one process before the workers start)."""
        import asyncpg

        pool = await self._pool()
        with contextlib.suppress(asyncpg.UniqueViolationError, asyncpg.DuplicateTableError):
            await pool.execute(
                f"CREATE TABLE IF NOT EXISTS {LEDGER_TABLE} "
                "(run text NOT NULL, key text NOT NULL, pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now())"
            )

    async def incr(self, key: str) -> None:
        pool = await self._pool()
        sql = f"INSERT INTO {LEDGER_TABLE} (run, key, pid) VALUES ($1, $2, $3)"
        await pool.execute(sql, self.run, key, os.getpid())

    async def counts(self, keys: Iterable[str]) -> dict[str, int]:
        pool = await self._pool()
        rows = await pool.fetch(f"SELECT key, count(*) FROM {LEDGER_TABLE} WHERE run = $1 GROUP BY key", self.run)
        found = {r[0]: int(r[1]) for r in rows}
        return {k: found.get(k, 0) for k in keys}

    async def cleanup(self) -> None:
        pool = await self._pool()
        await pool.execute(f"DELETE FROM {LEDGER_TABLE} WHERE run = $1", self.run)

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.close()
            self.pool = None


Ledger = MemoryLedger | RedisLedger | PostgresLedger


async def cleanup_store(kind: str, namespace: str, table: str) -> None:
    """Remove one run's records (`namespace`) from the shared Redis or Postgres, never anything else.

    Redis keys are `idem-rel:<namespace>:...` (the prefix `tests/crash_app.make_store` gives them).
    """

    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            names = [k async for k in client.scan_iter(match=f"idem-rel:{namespace}:*", count=1000)]
            for i in range(0, len(names), 500):
                await client.delete(*names[i : i + 500])
        finally:
            await client.aclose()
    elif kind == "postgres":
        import asyncpg

        conn = await asyncpg.connect(POSTGRES_DSN)
        try:
            await conn.execute(f"DELETE FROM {table} WHERE namespace = $1", namespace)
            if await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{table}_history"):
                await conn.execute(f"DELETE FROM {table}_history WHERE namespace = $1", namespace)
        finally:
            await conn.close()


def ledger_from_url(url: str, run: str, *, pool: int = 4) -> Ledger:
    if url.startswith("memory://"):
        return MemoryLedger()
    if url.startswith(("postgres://", "postgresql://")):
        return PostgresLedger(url, run, max_size=pool)
    return RedisLedger(url, run, max_connections=max(pool, 8))


# -- driver 1: raw ASGI, in process -------------------------------------------------------------


async def asgi_post(
    app: Any, key: str, body: bytes = b'{"amount":1999,"currency":"EUR"}', *, path: str = "/pay", timeout: float = 30
) -> Answer:
    """One POST through an ASGI app, like a server would drive it (the client never hangs up
    before the answer's end)."""
    headers = [
        (b"host", b"test"),
        (b"idempotency-key", key.encode()),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    scope = http_scope("POST", path, raw_headers=headers, state={})
    result = Result()
    began = time.monotonic()
    try:
        await asyncio.wait_for(drive(app, scope, [body], disconnect_when_done=True, result=result), timeout)
    except TimeoutError:
        return Answer(key, 0, [], b"", time.monotonic() - began, error="timeout")
    except Exception as exc:  # an exception escaping the app is what a server turns into a 500
        if result.started is None:
            return Answer(key, 500, [], b"", time.monotonic() - began, error=repr(exc))
    latency = time.monotonic() - began
    start = result.started
    if start is None:
        return Answer(key, 0, [], b"", latency, error="no response started")
    sent = [(bytes(k), bytes(v)) for k, v in start.get("headers", ())]
    return Answer(key, int(start["status"]), sent, result.body, latency)


# -- driver 2: a lean HTTP/1.1 client over loopback ---------------------------------------------


class TruncatedBody(Exception):
    """The status line and headers arrived, the body did not (all of it)."""


def build_post(key: str, body: bytes, *, path: str = "/pay") -> bytes:
    head = [
        f"POST {path} HTTP/1.1".encode(),
        b"host: 127.0.0.1",
        b"content-type: application/json",
        b"idempotency-key: " + key.encode(),
        b"content-length: %d" % len(body),
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One Content-Length or chunked HTTP/1.1 response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = []
    length = 0
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip()
        headers.append((name, value))
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if not chunked:
        try:
            return status, headers, await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise TruncatedBody(f"truncated: {status} + {len(exc.partial)} of {length} body bytes") from exc
    parts: list[bytes] = []
    for _ in range(100_000):
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return status, headers, b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])
    raise ValueError("too many chunks")


class HttpConnection:
    """A kept-alive connection to 127.0.0.1:port that reconnects after any failure."""

    def __init__(self, port: int, *, timeout: float = 15) -> None:
        self.port = port
        self.timeout = timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, key: str, body: bytes = b'{"amount":1999,"currency":"EUR"}') -> Answer:
        began = time.monotonic()
        try:
            if self.writer is None:
                self.reader, self.writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.port), self.timeout
                )
            reader, writer = self.reader, self.writer
            assert reader is not None and writer is not None
            writer.write(build_post(key, body))
            await writer.drain()
            status, headers, data = await asyncio.wait_for(read_response(reader), self.timeout)
        except TruncatedBody as exc:
            await self.close()
            return Answer(key, 0, [], b"", time.monotonic() - began, error=str(exc))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, TimeoutError) as exc:
            await self.close()
            return Answer(key, 0, [], b"", time.monotonic() - began, error=f"no response: {type(exc).__name__}")
        if dict(headers).get(b"connection") == b"close":
            await self.close()
        return Answer(key, status, headers, data, time.monotonic() - began)

    async def close(self) -> None:
        writer, self.writer, self.reader = self.writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2)


async def http_post(port: int, key: str, *, timeout: float = 15) -> Answer:
    """One POST on a fresh connection."""
    conn = HttpConnection(port, timeout=timeout)
    try:
        return await conn.post(key)
    finally:
        await conn.close()
