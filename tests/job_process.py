"""A job process for tests/test_job_lifecycle.py: calls `@idempotent` jobs in a process of its own,
so a test can freeze its store under it or SIGKILL it mid-run. Effects are counted by INCR in the
shared Redis (6379), outside the job's store.

    python -m tests.job_process '<json config>'

The config's `mode`:

- `call`: call `charge("o1")` once (`wait`, `lease`) on the Redis store at `url`, and print one JSON
  line (pid, result or error, when the call returned, the record's state read right after it,
  and when `asyncio.run` returned). The run that
  holds the claim does its effect, publishes its pid at `<sig>:holder`, then waits for the test to
  set `<sig>:frozen` (the test freezes the store first) before it returns its result. Every
  process adds 1 to `<sig>:claimed` once its first claim call was answered.
- `die`: call `charge(key)` for each of `keys` at once on the store named `store` (redis or
  postgres); each does its effect, and once all have, the process SIGKILLs itself.
- `die-in-transaction`: on Postgres, `book("o1")` and `book("o2")` at once; each inserts its row in
  the `ledger` table inside `backend.transaction()`. Once `o1` is inside its transaction (row
  inserted, not committed) and `o2`'s has committed, the process SIGKILLs itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import redis.asyncio as aioredis

from idem_asgi.backends import Backend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs import idempotent
from idem_asgi.records import ClaimResult, RecordKey
from tests.support.servers import POSTGRES_DSN, REDIS_URL
from tests.support.stores import TEST_TABLE, Delegating, store_from_url


class Told(Delegating):
    """Adds 1 to `<sig>:claimed` in the shared Redis once its first claim call was answered."""

    def __init__(self, inner: Backend, shared: aioredis.Redis, sig: str) -> None:
        super().__init__(inner)
        self.shared = shared
        self.sig = sig
        self.told = False

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        result = await super().claim(key, fingerprint, lease=lease, ttl=ttl)
        if not self.told:
            self.told = True
            await self.shared.incr(f"{self.sig}:claimed")
        return result


async def call(config: dict[str, Any]) -> dict[str, Any]:
    shared = aioredis.Redis.from_url(REDIS_URL)
    sig = config["sig"]
    store = Told(RedisBackend.from_url(config["url"], prefix=config["prefix"]), shared, sig)

    @idempotent(store, args=["order_id"], namespace=config["namespace"], wait=config["wait"], lease=config["lease"])
    async def charge(order_id: str) -> str:
        await shared.incr(f"{sig}:effects")
        await shared.set(f"{sig}:holder", os.getpid())
        deadline = time.monotonic() + 20
        while not await shared.exists(f"{sig}:frozen") and time.monotonic() < deadline:  # noqa: ASYNC110 - polls another process's signal
            await asyncio.sleep(0.02)
        return f"ch_{os.getpid()}"

    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        out["result"] = await charge("o1")
    except Exception as exc:
        out["error"] = type(exc).__name__
    out["returned_at"] = time.time()
    try:  # what the record says once the call returned
        record = await store.get(RecordKey.build(config["namespace"], None, "order_id=o1"))
        out["record"] = None if record is None else record.state
    except Exception as exc:
        out["record"] = type(exc).__name__
    await shared.aclose()
    return out  # the store is not closed: the process ends as a short-lived script's does


async def die(config: dict[str, Any]) -> None:
    shared = aioredis.Redis.from_url(REDIS_URL)
    name = config["store"]
    url = REDIS_URL if name == "redis" else POSTGRES_DSN
    store = store_from_url(url, prefix=config["prefix"], table=TEST_TABLE, pool=5)
    keys: list[str] = config["keys"]
    done = 0
    everyone = asyncio.Event()

    @idempotent(store, args=["order_id"], namespace=config["namespace"], lease=config["lease"])
    async def charge(order_id: str) -> str:
        nonlocal done
        await shared.incr(f"{config['counter']}:{order_id}")
        done += 1
        if done == len(keys):
            everyone.set()
        await everyone.wait()
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run: after the effect, before its result is stored
        raise AssertionError("unreachable")

    await asyncio.gather(*(charge(k) for k in keys))


async def die_in_transaction(config: dict[str, Any]) -> None:
    from idem_asgi.backends.postgres import PostgresBackend

    store = store_from_url(POSTGRES_DSN, table=TEST_TABLE, pool=5)
    assert isinstance(store, PostgresBackend)
    ledger = config["ledger"]
    inside, committed = asyncio.Event(), asyncio.Event()

    @idempotent(store, args=["order_id"], namespace=config["namespace"], lease=config["lease"])
    async def book(order_id: str) -> str:
        if order_id == "o1":
            async with store.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", order_id)
                inside.set()
                await committed.wait()
                os.kill(os.getpid(), signal.SIGKILL)  # inside the transaction: never committed
        else:
            async with store.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", order_id)
            await inside.wait()
            committed.set()
            await asyncio.Event().wait()  # killed by o1, after this COMMIT
        raise AssertionError("unreachable")

    await asyncio.gather(book("o1"), book("o2"))


def main() -> None:
    config = json.loads(sys.argv[1])
    mode = config["mode"]
    if mode == "call":
        out = asyncio.run(call(config))
        out["exited_at"] = time.time()  # asyncio.run returned: the process ends now
        print(json.dumps(out), flush=True)
    elif mode == "die":
        asyncio.run(die(config))
    else:
        asyncio.run(die_in_transaction(config))


if __name__ == "__main__":
    main()
