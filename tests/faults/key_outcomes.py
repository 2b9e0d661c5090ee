"""What the HTTP and job runs of the fault matrix share: their keys, their store servers, the settle
loop, and how each key's end is classified (tests/faults/test_matrix_http.py, test_matrix_jobs.py).

A run is one (surface, kind, store): `PER_POINT` keys at each point the table has for that store
(`<run>-<point>-<i>`). After the fault phase the test reads each key's effect and `ran` counts
(tests/support/fault_points.py; an `in_transaction` key's effect is its committed ledger row), then
settles every key (retries it until it is answered for good), reads them again and classifies it:

- `once`: effect 1, made before the settle phase, ran once in all, and the settle phase was
  answered from the stored outcome (an `in_transaction` key whose holder was gone before COMMIT:
  rolled back, run again once in the settle phase, ledger 1);
- `blocked`: the settle phase ended on outcome-unknown and never ran it again; effect 0 at
  `after_claim`, 1 at `mid_effect` and `before_store` (else `blocked(effect=N)`);
- `later`: never ran before the settle phase, ran there once, then answered from its record;
- anything else says what happened instead.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import asyncpg
import pytest

from tests.support import fault_points
from tests.support.fault_matrix import POINTS, Kind, Store, Surface, expected
from tests.support.fault_points import Plan
from tests.support.servers import POSTGRES_DSN, REDIS_URL, PostgresCluster, RedisProcess, require
from tests.support.store_outage import fsynced_redis
from tests.support.stores import TEST_TABLE

PER_POINT: Final = 2
LEASE: Final = 2.0
"""The claims' lease (grace 1 s): short, so a dead holder's key settles within a few seconds."""
TTL: Final = 600.0
DOWN: Final = LEASE + 1.0
"""Seconds a killed store stays down: past a lease, so every lease in it looks expired when it is back."""
STALL: Final = 2 * LEASE
STORE_TIMEOUT: Final = 2.0
"""The processes' store call timeout, shorter than a stall on both stores (Postgres's default is 5 s): a
claim sent into a stall fails on both, the same outcome for the table's one column."""
"""Seconds a store stays stopped (SIGSTOP): two leases."""
SETTLE_WITHIN: Final = LEASE + 1.0 + 6.0
"""How long a key is retried while in progress or the store is unavailable: lease + grace + margin."""
STORE_FAULTS: Final = ("store_outage", "store_stall")
TRANSIENT: Final = frozenset({"in_progress", "unavailable"})
BLOCKED_EFFECT: Final[dict[str, int]] = {"after_claim": 0, "mid_effect": 1, "before_store": 1}


def plan_for(surface: Surface, kind: Kind, store: Store, run: str) -> Plan:
    """`PER_POINT` keys at each point the table has for (surface, kind, store)."""
    points = [p for p in POINTS if expected(surface, p, kind, store) is not None]
    return Plan(run, {f"{run}-{p}-{i}": p for p in points for i in range(PER_POINT)})


# -- the store a run uses: the shared server, or a throwaway one its fault breaks -------------------


@dataclass
class StoreSite:
    """Where a run's records live, and how its fault breaks it (store faults only)."""

    kind: Store
    url: str
    redis: RedisProcess | None = None
    cluster: PostgresCluster | None = None

    def kill(self) -> None:
        """SIGKILL the redis-server (every write was fsynced) / stop the cluster `-m immediate`."""
        if self.redis is not None:
            self.redis.kill()
        else:
            assert self.cluster is not None
            self.cluster.stop()

    def start(self) -> None:
        """Start it again on the same port and data."""
        if self.redis is not None:
            self.redis.start()
        else:
            assert self.cluster is not None
            self.cluster.start()

    def freeze(self) -> None:
        if self.redis is not None:
            self.redis.signal(signal.SIGSTOP)
        else:
            assert self.cluster is not None
            self.cluster.freeze()

    def thaw(self) -> None:
        if self.redis is not None:
            if self.redis.proc is not None and self.redis.proc.poll() is None:
                self.redis.signal(signal.SIGCONT)
        elif self.cluster is not None:
            self.cluster.thaw()

    def heal(self) -> None:
        """Running and answering again, whatever the run left it as (called on the way out)."""
        self.thaw()
        if self.redis is not None and self.redis.proc is None:
            self.redis.start()
        if self.cluster is not None and not (self.cluster.data / "postmaster.pid").exists():
            self.cluster.start()

    async def ledger(self) -> Any:
        """A connection to the database holding `fault_ledger` (Postgres only)."""
        return await asyncpg.connect(self.url)


@contextmanager
def store_site(kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreSite]:
    """The shared server, or for a store fault a throwaway one: an fsynced redis-server of this test,
    or the module's throwaway Postgres cluster (fixture `throwaway_postgres`)."""
    if store == "redis":
        require("redis", REDIS_URL)
        if kind not in STORE_FAULTS:
            yield StoreSite("redis", REDIS_URL)
            return
        with fsynced_redis(tmp_path / "redis") as server:
            site = StoreSite("redis", server.url, redis=server)
            try:
                yield site
            finally:
                site.thaw()
        return
    require("postgres", POSTGRES_DSN)  # (its ledger and counters: the shared Redis too)
    if kind not in STORE_FAULTS:
        yield StoreSite("postgres", POSTGRES_DSN)
        return
    cluster: PostgresCluster = request.getfixturevalue("throwaway_postgres")
    site = StoreSite("postgres", cluster.dsn, cluster=cluster)
    site.heal()
    try:
        yield site
    finally:
        site.heal()


async def prepare(site: StoreSite) -> None:
    """Postgres: the records table and the ledger exist on the run's server."""
    if site.kind != "postgres":
        return
    from idem_asgi.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_dsn(site.url, table=TEST_TABLE, min_size=1, max_size=2)
    try:
        await backend.setup()
    finally:
        await backend.aclose()
    conn = await site.ledger()
    try:
        await fault_points.ensure_ledger(conn)
    finally:
        await conn.close()


async def cleanup(site: StoreSite, plan: Plan, *, prefix: str, namespace: str) -> None:
    """Remove the run's records (on a shared server), ledger rows and counters."""
    await fault_points.cleanup(plan)
    if site.kind == "redis":
        if site.url == REDIS_URL:
            found = [k async for k in plan.redis.scan_iter(match=f"{prefix}*")]
            if found:
                await plan.redis.delete(*found)
        return
    conn = await site.ledger()
    try:
        await conn.execute(f"DELETE FROM {TEST_TABLE} WHERE namespace = $1", namespace)
        await conn.execute(f"DELETE FROM {fault_points.LEDGER} WHERE run = $1", plan.run)
    finally:
        await conn.close()


async def effects(site: StoreSite, plan: Plan) -> dict[str, tuple[int, int]]:
    """(effect, ran) per key: the Redis INCR, or an `in_transaction` key's committed ledger rows."""
    keys = list(plan.points)
    effect = await fault_points.counts(plan, keys)
    ran = await fault_points.counts(plan, keys, "ran")
    ledgered = [k for k in keys if plan.points[k] == "in_transaction"]
    if ledgered:
        conn = await site.ledger()
        try:
            effect.update(await fault_points.ledger_rows(conn, plan, ledgered))
        finally:
            await conn.close()
    return {k: (effect[k], ran[k]) for k in keys}


# -- the settle phase --------------------------------------------------------------------------------

Call = Callable[[], Awaitable[tuple[str, float]]]
"""One retry of a key: what it got (`stored`, `ran`, `in_progress`, `unknown`, `unavailable`,
`error:...`) and how long to wait before the next one when it is transient."""


async def settle(call: Call, within: float = SETTLE_WITHIN) -> list[str]:
    """Retry a key until it is answered for good (bounded by `within` while in progress or the store
    is unavailable); a key that runs now is retried once more, to be answered from its record."""
    trace: list[str] = []
    deadline = time.monotonic() + within
    while True:
        got, pause = await call()
        trace.append(got)
        if got == "ran":
            trace.append((await call())[0])
            return trace
        if got not in TRANSIENT or time.monotonic() + pause > deadline:
            return trace
        await asyncio.sleep(pause)


# -- classifying -------------------------------------------------------------------------------------


@dataclass
class KeyEnd:
    """One key of a run: its point, (effect, ran) when the settle phase began and after it, and what
    each settle retry got."""

    key: str
    point: str
    before: tuple[int, int]
    after: tuple[int, int]
    settled: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """once / blocked / later, or what happened instead."""
        (effect0, ran0), (effect, ran) = self.before, self.after
        again = ran - ran0
        last = self.settled[-1] if self.settled else "nothing"
        if last == "unknown":
            if again:
                return f"blocked, yet ran again {again}x"
            want = BLOCKED_EFFECT.get(self.point)
            return "blocked" if want is None or effect == want else f"blocked(effect={effect})"
        if last != "stored":
            return f"settle ended {last} (effect {effect0}->{effect}, ran {ran0}->{ran})"
        if effect == 1 and ran == 1 and effect0 == 1 and again == 0:
            return "once"
        if self.point == "in_transaction" and (effect0, ran0, effect, ran) == (0, 1, 1, 2):
            return "once"  # rolled back with its holder, run again once
        if (effect, ran, effect0, ran0) == (1, 1, 0, 0):
            return "later"
        return f"stored (effect {effect0}->{effect}, ran {ran0}->{ran})"


def judge(
    surface: Surface, kind: Kind, store: Store, ends: list[KeyEnd], extra: dict[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """Compare every key with the table; (the scorecard line, the mismatches)."""
    by_point: dict[str, Counter[str]] = {}
    failures: list[str] = []
    for end in ends:
        want = expected(surface, end.point, kind, store)  # type: ignore[arg-type]
        got = end.outcome
        by_point.setdefault(end.point, Counter())[got] += 1
        if got != want:
            failures.append(
                f"{surface}/{end.point}/{kind}/{store}: {end.key} expected {want}, got {got} "
                f"(effect, ran: {end.before} -> {end.after}; settle {end.settled})"
            )
    line: dict[str, Any] = {
        "test": f"fault_matrix_{surface}",
        "surface": surface,
        "kind": kind,
        "backend": store,
        "keys": len(ends),
        "points": {
            p: {"expected": expected(surface, p, kind, store), "got": dict(c)}  # type: ignore[arg-type]
            for p, c in by_point.items()
        },
        "mismatches": len(failures),
        **extra,
    }
    return line, failures
