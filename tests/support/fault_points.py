"""Where each key's work stops in a fault-matrix run, and how the test meets it there.

A process under test (a uvicorn worker, a job process, a consumer process) reads its plan from the
environment: `IDEM_FAULT_RUN` (the run's id) and `IDEM_FAULT_POINTS` (JSON: key -> point, the
points of tests/support/fault_matrix.py). Its store is wrapped in `PointStore` and its handler is
`work(key, store)`. When a key's work reaches its point, it tells the test (`RPUSH` on the shared
Redis, which no fault touches) and waits there until the test releases it (`release`), or until the
fault ends the process or the task. The test waits for every key to arrive (`arrived`), applies the
fault, releases the keys (for a fault that lets the work go on), and reads what happened:

- the effect of a key: `INCR fault:<run>:effect:<key>` on the shared Redis, made by `work` between
  `after_claim` and `mid_effect`; for a key whose point is `in_transaction` (Postgres only), a row
  in `fault_ledger` inserted inside `store.transaction()` (counted only once committed);
- how often the handler ran: `INCR fault:<run>:ran:<key>` at its start.

Points outside the handler are the store wrapper's: `before_claim` (before the claim call),
`before_store` (before the completion write), `after_store` (after it returned).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, Final

import redis.asyncio as aioredis

from idem_asgi.records import ClaimResult, RecordKey, StoredResponse
from tests.support.fault_matrix import POINTS, Point
from tests.support.servers import REDIS_URL
from tests.support.stores import Delegating

LEDGER: Final = "fault_ledger"
"""The Postgres table of `in_transaction` effects: (run text, key text)."""


class Plan:
    """A process's plan: its run id and each key's point, read from the environment (or given)."""

    def __init__(self, run: str | None = None, points: Mapping[str, str] | None = None, *, stops: bool = True) -> None:
        self.run = run if run is not None else os.environ.get("IDEM_FAULT_RUN", "")
        given = points if points is not None else json.loads(os.environ.get("IDEM_FAULT_POINTS", "{}"))
        unknown = set(given.values()) - set(POINTS)
        if unknown:
            raise ValueError(f"unknown points {sorted(unknown)}")
        self.points: dict[str, str] = dict(given)
        self.stops = stops  # False: the plan as a settling process works it (counted, never stopped)
        self.passed: set[str] = set()
        self._redis: aioredis.Redis | None = None

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(REDIS_URL)
        return self._redis

    def env(self) -> dict[str, str]:
        """The environment variables that hand this plan to a process."""
        return {"IDEM_FAULT_RUN": self.run, "IDEM_FAULT_POINTS": json.dumps(self.points)}

    def point_of(self, key: str) -> str | None:
        return self.points.get(key)

    async def reached(self, key: str, point: Point) -> None:
        """If `key`'s point is `point`, the first time this process gets there: tell the test, then
        wait until it releases the key. The same call made again (a claim held while the store is
        down, a completion retried in the background, a redelivery in this process) goes past, as
        the real work's would."""
        if not self.stops or self.points.get(key) != point or key in self.passed:
            return
        self.passed.add(key)
        await self.redis.rpush(f"fault:{self.run}:arrived", f"{key} {point}")
        waiting = aioredis.Redis.from_url(REDIS_URL)  # a connection of its own: BLPOP holds it
        cancelling: Any = getattr(asyncio.current_task(), "cancelling", None)  # (Python 3.11+)
        try:
            while not await waiting.blpop([f"fault:{self.run}:go:{key}"], timeout=1):
                # A cancellation that lands while redis-py sends the command is lost before Python 3.12:
                # redis-py wraps each send in `asyncio.wait_for(..., socket_timeout)`, which there returns
                # the finished send's result instead of raising. The task still says it is being
                # cancelled: end the wait as the cancellation would have.
                if cancelling is not None and cancelling():
                    raise asyncio.CancelledError
        finally:
            await waiting.aclose()

    async def effect(self, key: str) -> None:
        await self.redis.incr(f"fault:{self.run}:effect:{key}")

    async def ran(self, key: str) -> None:
        await self.redis.incr(f"fault:{self.run}:ran:{key}")

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


async def work(plan: Plan, key: str, store: Any = None) -> str:
    """The handler's work for `key`, the same on every surface: counted, stopped at its point.

    A key whose point is `in_transaction` makes its effect inside `store.transaction()` (a ledger row,
    Postgres); every other key's effect is an `INCR` on the shared Redis, between `after_claim` and
    `mid_effect`."""
    await plan.ran(key)
    if plan.point_of(key) == "in_transaction":
        async with store.transaction() as conn:
            await conn.execute(f"INSERT INTO {LEDGER} (run, key) VALUES ($1, $2)", plan.run, key)
            await plan.reached(key, "in_transaction")
        return f"applied {key}"
    await plan.reached(key, "after_claim")
    await plan.effect(key)
    await plan.reached(key, "mid_effect")
    return f"applied {key}"


class PointStore(Delegating):
    """The process's store: stops a key's work at `before_claim`, `before_store` and `after_store`.
    Keys are matched by the record key's `key` (a consumer's message id, a job's key, the request's
    `Idempotency-Key`)."""

    def __init__(self, inner: Any, plan: Plan) -> None:
        super().__init__(inner)
        self.plan = plan

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        await self.plan.reached(key.key, "before_claim")
        return await self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        await self.plan.reached(key.key, "before_store")
        stored: bool = await self.inner.complete(key, token, response, ttl=ttl)
        await self.plan.reached(key.key, "after_store")
        return stored


# -- the test's side ----------------------------------------------------------------------------


async def arrived(plan: Plan, keys: Iterable[str], within: float) -> set[str]:
    """Wait until every key reported its point (or `within` s passed); the keys that did."""
    wanted, seen = set(keys), set[str]()
    deadline = time.monotonic() + within
    while seen < wanted and time.monotonic() < deadline:
        item = await plan.redis.blpop([f"fault:{plan.run}:arrived"], timeout=0.2)
        if item is not None:
            value = item[1]
            seen.add((value.decode() if isinstance(value, bytes) else value).split(" ", 1)[0])
        else:
            await asyncio.sleep(0)
    return seen


async def release(plan: Plan, keys: Iterable[str]) -> None:
    """Let the keys' work go on from their points."""
    for key in keys:
        await plan.redis.rpush(f"fault:{plan.run}:go:{key}", "go")


async def counts(plan: Plan, keys: Iterable[str], what: str = "effect") -> dict[str, int]:
    """`effect` or `ran` per key, from the shared Redis."""
    keys = list(keys)
    values = await plan.redis.mget([f"fault:{plan.run}:{what}:{k}" for k in keys]) if keys else []
    return {k: int(v or 0) for k, v in zip(keys, values, strict=True)}


async def ledger_rows(conn: Any, plan: Plan, keys: Iterable[str]) -> dict[str, int]:
    """Committed `in_transaction` effects per key (an asyncpg connection)."""
    keys = list(keys)
    rows = await conn.fetch(f"SELECT key, count(*) FROM {LEDGER} WHERE run = $1 GROUP BY key", plan.run)
    found = {r[0]: int(r[1]) for r in rows}
    return {k: found.get(k, 0) for k in keys}


async def ensure_ledger(conn: Any) -> None:
    await conn.execute(f"CREATE TABLE IF NOT EXISTS {LEDGER} (run text NOT NULL, key text NOT NULL)")


async def cleanup(plan: Plan) -> None:
    """Drop the run's keys from the shared Redis."""
    found = [k async for k in plan.redis.scan_iter(match=f"fault:{plan.run}:*", count=1000)]
    if found:
        await plan.redis.delete(*found)
