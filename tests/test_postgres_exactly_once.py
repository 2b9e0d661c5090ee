"""Exactly once in the same database: a worker SIGKILLed mid-request, then retries on a new worker.

The handler writes its ledger row through `PostgresBackend.transaction()`. The first worker is
killed while some requests are inside their transaction and others just after its COMMIT. A
second worker then takes the retries. The ledger (no unique constraint: a double execution would
be a second row) must end with exactly one row per key:

- killed inside the transaction: rolled back with the connection; once the lease ends the
  recover hook sees no committed effect and the retry runs it (on the new worker), once;
- killed after COMMIT: the effect happened; the retry is told `outcome-unknown`, never re-run;
- completed before the kill: replayed.

The negative control (/naive: the same write outside `transaction()`, `on_expired="reclaim"`)
runs twice after the same kill, so the ledger check is shown to catch a double execution.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.records import RecordKey
from tests.support.pgbouncer import pgbouncer
from tests.support.servers import POSTGRES_DSN, UvicornProcess, require

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

N = 4  # keys per kind


def worker(env: dict[str, str], log: Path) -> UvicornProcess:
    """`uvicorn tests.xo_app:app`, one process, with `env` over this process's environment."""
    return UvicornProcess("tests.xo_app:app", {**os.environ, **env}, log)


def url_of(server: UvicornProcess) -> str:
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[UvicornProcess]]:
    started: list[UvicornProcess] = []
    try:
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture
async def tables() -> AsyncIterator[tuple[str, str, str]]:
    require("postgres", POSTGRES_DSN)
    suffix = uuid.uuid4().hex[:12]
    records, ledger, app_name = f"idem_xo_records_{suffix}", f"idem_xo_ledger_{suffix}", f"idem-xo-{suffix}"
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        await conn.execute(f"CREATE TABLE {ledger} (key text NOT NULL, amount int NOT NULL, pid int NOT NULL)")
        async with PostgresBackend.from_dsn(POSTGRES_DSN, table=records, min_size=1, max_size=1) as b:
            await b.setup()
        yield records, ledger, app_name
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {ledger}, {records}")
        await conn.close()


def dump_logs(directory: Path) -> None:
    for log in sorted(directory.glob("worker-*.log")):
        print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}")


async def poll(what: str, check: Callable[[], Awaitable[bool]], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.fixture(params=["direct", "pgbouncer"])
def app_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL the workers use: the test database, or a transaction-mode PgBouncer in front of it."""
    if request.param == "direct":
        yield POSTGRES_DSN
        return
    with pgbouncer("transaction") as dsn:
        yield dsn


async def test_sigkill_mid_request_leaves_exactly_one_ledger_row_per_key(
    tables: tuple[str, str, str], workers: list[UvicornProcess], tmp_path: Path, app_dsn: str
) -> None:
    records, ledger, app_name = tables
    env = {"IDEM_XO_DSN": app_dsn, "IDEM_XO_RECORDS": records, "IDEM_XO_LEDGER": ledger,
           "IDEM_XO_APP_NAME": app_name}  # fmt: skip
    db = await asyncpg.connect(POSTGRES_DSN)
    tag = uuid.uuid4().hex[:6]
    done = [f"done-{tag}-{i}" for i in range(N)]
    in_tx = [f"in-tx-{tag}-{i}" for i in range(N)]
    after = [f"after-commit-{tag}-{i}" for i in range(N)]
    naive = [f"naive-{tag}-{i}" for i in range(N)]
    body = b'{"amount": 100}'
    try:
        first = worker(env, tmp_path / "worker-1.log")
        workers.append(first)
        await first.wait_ready(timeout=20)
        async with httpx.AsyncClient(base_url=url_of(first), timeout=30) as client:
            for key in done:
                r = await client.post("/pay", content=body, headers={"Idempotency-Key": key})
                assert r.status_code == 201, r.text
            hanging = [
                *(client.post("/pay", content=body, headers={"Idempotency-Key": k, "x-hang": "in-transaction"})
                  for k in in_tx),
                *(client.post("/pay", content=body, headers={"Idempotency-Key": k, "x-hang": "after-commit"})
                  for k in after),
                *(client.post("/naive", content=body, headers={"Idempotency-Key": k, "x-hang": "after-commit"})
                  for k in naive),
            ]  # fmt: skip
            in_flight = asyncio.gather(*hanging, return_exceptions=True)

            async def all_parked() -> bool:
                idle_in_tx = await db.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state = $2",
                    app_name,
                    "idle in transaction",
                )
                committed = await db.fetchval(f"SELECT count(*) FROM {ledger} WHERE key = ANY($1)", after + naive)
                return bool(idle_in_tx == N and committed == 2 * N)

            await poll("every hanging request to park", all_parked)
            first.signal(signal.SIGKILL)
            assert await first.wait_dead(10) is not None
            outcomes = await asyncio.wait_for(in_flight, 10)
        assert all(isinstance(o, httpx.TransportError) for o in outcomes), outcomes  # no answer to anyone

        async def rolled_back() -> bool:
            # (A pooler keeps its server connections, idle, with the name they last carried.)
            sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'"
            return bool(await db.fetchval(sql, app_name) == 0)

        await poll("the killed worker's transactions to roll back", rolled_back)
        assert await db.fetchval(f"SELECT count(*) FROM {ledger} WHERE key = ANY($1)", in_tx) == 0

        second = worker(env, tmp_path / "worker-2.log")
        workers.append(second)
        await second.wait_ready(timeout=20)
        final: dict[str, httpx.Response] = {}
        waits: dict[str, int] = {}
        async with httpx.AsyncClient(base_url=url_of(second), timeout=30) as client:

            async def retry(path: str, key: str) -> None:
                for attempt in range(80):  # bounded: the 1 s lease must run out first
                    r = await client.post(path, content=body, headers={"Idempotency-Key": key})
                    if not (r.status_code == 409 and r.json()["type"].endswith("request-in-progress")):
                        final[key], waits[key] = r, attempt
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"{key} stayed in progress")

            await asyncio.gather(
                *[retry("/pay", k) for k in done + in_tx + after], *[retry("/naive", k) for k in naive]
            )

            for key in done:
                assert final[key].status_code == 201 and final[key].headers["idempotent-replayed"] == "true"
            for key in in_tx:  # rolled back, so run again: by the second worker, once
                r = final[key]
                assert r.status_code == 201 and "idempotent-replayed" not in r.headers, r.text
                assert r.json()["pid"] == second.proc.pid
                again = await client.post("/pay", content=body, headers={"Idempotency-Key": key})
                assert again.headers["idempotent-replayed"] == "true" and again.content == r.content
            for key in after:  # committed, so never run again
                r = final[key]
                assert r.status_code == 409 and r.json()["type"].endswith("outcome-unknown"), r.text

        rows = await db.fetch(f"SELECT key, count(*) AS n, array_agg(pid) AS pids FROM {ledger} GROUP BY key")
        counts = {r["key"]: r["n"] for r in rows}
        assert {k: counts.get(k, 0) for k in done + in_tx + after} == dict.fromkeys(done + in_tx + after, 1)
        assert {k: counts[k] for k in naive} == dict.fromkeys(naive, 2)  # the control: ran twice
        # What a reconcile job sees: the after-commit claims, effect committed, answer lost.
        async with PostgresBackend.from_dsn(POSTGRES_DSN, table=records, min_size=1, max_size=1) as b:
            stale = {s.key.digest: s.effect_committed for s in await b.stale(0)}
        assert stale == {RecordKey.build("idem", None, k).digest: True for k in after}  # xo_app: the default namespace
        print(
            f"\n[sigkill] ledger rows per key: done {[counts[k] for k in done]}, in-transaction "
            f"{[counts[k] for k in in_tx]}, after-commit {[counts[k] for k in after]}, naive control "
            f"{[counts[k] for k in naive]}; 409 polls before the lease ran out: {max(waits.values())}"
        )
    except BaseException:
        dump_logs(tmp_path)
        raise
    finally:
        await db.close()
