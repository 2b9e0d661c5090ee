"""Postgres behind a stock PgBouncer (Debian's 1.18) in transaction pooling mode, with the plain URL.

PgBouncer refuses the startup parameter `default_transaction_isolation` ("unsupported startup
parameter") and hands each transaction whichever server connection is free, so asyncpg's named
prepared statements go missing ("prepared statement ... does not exist"). `from_dsn` sends no
startup parameter and, seeing a pooler (`backends/postgres/_pooler.py`), makes no named statements.

Here: the start-up check, concurrent requests through the middleware (one execution, identical
replays), a uvicorn storm, `transaction()` and its recover hook, all through a
throwaway PgBouncer (`tests/support/pgbouncer.py`);
then statement pooling, which refuses transaction blocks: a start-up error naming the fix. The
contract suite runs through it too (`tests/test_backend_contract.py`, its `postgres-pgbouncer` store).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.context import held_claim
from idem_asgi.errors import BackendMisconfigured
from idem_asgi.http.middleware import check_store
from idem_asgi.records import Claimed, RecordKey
from tests.support.failover import assert_failover_kept_the_contract, run_storm
from tests.support.pgbouncer import pgbouncer
from tests.support.scorecard import report
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require
from tests.support.stores import TEST_TABLE

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def bouncer() -> Iterator[str]:
    """The DSN of a transaction-mode PgBouncer in front of the test database, for this module."""
    with pgbouncer("transaction") as dsn:
        yield dsn


async def test_the_plain_url_serves_concurrent_requests_through_a_transaction_pooler(bouncer: str) -> None:
    """100 duplicates of one key and 50 keys x 4, concurrently, through PgBouncer: each key runs once."""
    backend = PostgresBackend.from_dsn(bouncer, table=TEST_TABLE, min_size=1, max_size=20)
    try:
        assert await check_store(backend) is None
        executions: Counter[str] = Counter()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            key = dict(scope["headers"])[b"idempotency-key"].decode()
            executions[key] += 1
            await asyncio.sleep(0.02)  # duplicates arrive while it runs
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": f"{key} {uuid.uuid4().hex}".encode()})

        namespace = f"pgb-{uuid.uuid4().hex}"
        mw = IdempotencyMiddleware(
            app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
        )
        keys = ["one"] * 100 + [f"k{i}" for i in range(50) for _ in range(4)]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as client:

            async def post(key: str) -> httpx.Response:
                return await client.post("/payments", content=b"{}", headers={"Idempotency-Key": key})

            answers = await asyncio.gather(*(post(k) for k in keys))
            replays = await asyncio.gather(*(post(k) for k in dict.fromkeys(keys)))
        assert set(executions.values()) == {1} and len(executions) == 51
        firsts = {
            r.request.headers["idempotency-key"]: r.content
            for r in answers
            if "idempotent-replayed" not in r.headers and r.status_code == 201
        }
        assert len(firsts) == 51
        for r in [*answers, *replays]:
            assert r.status_code in (201, 409), r.text
            if r.status_code == 201:
                assert r.content == firsts[r.request.headers["idempotency-key"]]
        assert all(r.headers.get("idempotent-replayed") == "true" for r in replays)
    finally:
        await backend.aclose()


async def test_held_repeats_poll_through_a_transaction_pooler_where_listen_cannot_work(bouncer: str) -> None:
    """LISTEN needs its session: behind a transaction pooler the backend opens no listening
    connection and `watch` says None, so a repeat held on another process's claim polls."""
    backend = PostgresBackend.from_dsn(bouncer, table=f"idem_pgb_{uuid.uuid4().hex[:8]}")
    try:
        key = RecordKey.build("pgb-watch", None, uuid.uuid4().hex)
        claimed = await backend.claim(key, b"f", lease=10, ttl=60)
        assert isinstance(claimed, Claimed)
        assert await backend.watch(key, claimed.token, lambda digest: None) is None
        assert backend._notices is None
    finally:
        await backend.aclose()


async def test_a_uvicorn_storm_through_a_transaction_pooler_runs_each_key_once(bouncer: str, tmp_path: Path) -> None:
    """100 keys x 8 duplicates through uvicorn (100 in flight, clients retrying 409 and 503), then
    every key again and fresh keys (`tests/support/failover.py`, with no fault): one execution
    per key, identical replays, nothing lost."""
    require("redis", REDIS_URL)  # the execution counter

    async def no_fault() -> None:
        return None

    name = "pgbouncer_transaction_mode_storm"
    result = await run_storm(name, bouncer, {}, tmp_path / "uvicorn.log", no_fault, seed=name)
    report(result, tag="STORM")
    assert set(result["statuses"]) <= {"201", "409"}, result["statuses"]
    assert_failover_kept_the_contract(result, durable=True)


async def test_transaction_and_its_recover_hook_work_through_a_transaction_pooler(bouncer: str) -> None:
    """The business write and the effect mark commit together; a claim whose transaction never
    committed is re-run, one whose transaction did is not."""
    ledger = f"idem_pgb_ledger_{uuid.uuid4().hex[:12]}"
    direct = await asyncpg.connect(POSTGRES_DSN)
    await direct.execute(f"CREATE TABLE {ledger} (key text NOT NULL)")
    backend = PostgresBackend.from_dsn(bouncer, table=TEST_TABLE, min_size=1, max_size=5)
    try:
        await backend.check()
        namespace = f"pgb-{uuid.uuid4().hex}"

        async def handler(scope: Scope, receive: Receive, send: Send) -> None:
            key = dict(scope["headers"])[b"idempotency-key"].decode()
            async with backend.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", key)
            await send({"type": "http.response.start", "status": 201, "headers": []})
            await send({"type": "http.response.body", "body": key.encode()})

        mw = IdempotencyMiddleware(
            handler,
            backend=backend,
            namespace=namespace,
            routes=[RoutePolicy("/pay", single_tenant=True, recover=backend.recover_uncommitted)],
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t") as client:
            sent = await asyncio.gather(
                *(client.post("/pay", content=b"{}", headers={"Idempotency-Key": f"k{i % 20}"}) for i in range(60))
            )
        assert {r.status_code for r in sent} <= {201, 409}
        rows = await direct.fetch(f"SELECT key, count(*) AS n FROM {ledger} GROUP BY key")
        assert {r["key"]: r["n"] for r in rows} == {f"k{i}": 1 for i in range(20)}
        # A claim whose transaction committed is not re-run (outcome unknown); one whose never did is.
        committed = RecordKey.build(namespace, None, "committed-then-died")
        claimed = await backend.claim(committed, b"fp", lease=30, ttl=60)
        assert isinstance(claimed, Claimed)
        with held_claim(backend, committed, claimed.token):
            async with backend.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", "committed-then-died")
        uncommitted = RecordKey.build(namespace, None, "never-committed")
        other = await backend.claim(uncommitted, b"fp", lease=30, ttl=60)
        assert isinstance(other, Claimed)
        for key, expected in ((committed, None), (uncommitted, "run")):
            record = await backend.get(key)
            assert record is not None and await backend.recover_uncommitted(key, record) == expected
    finally:
        await backend.aclose()
        await direct.execute(f"DROP TABLE IF EXISTS {ledger}")
        await direct.close()


async def test_statement_pooling_fails_at_start_up_naming_the_fix() -> None:
    """`pool_mode = statement` refuses transaction blocks, which `transaction()` needs: the start-up
    check says so (before: the check passed and every `transaction()` was a 503)."""
    with pgbouncer("statement") as dsn:
        backend = PostgresBackend.from_dsn(dsn, table=TEST_TABLE, min_size=1, max_size=2)
        try:
            with pytest.raises(BackendMisconfigured, match="pool_mode = transaction"):
                await backend.check()
            problem = await check_store(backend)
            assert problem is not None and "statement pooling" in problem
        finally:
            await backend.aclose()


async def test_a_startup_parameter_the_pooler_refuses_fails_at_start_up_naming_the_fix(bouncer: str) -> None:
    """Before: a per-request 503 ("postgres unavailable") for a refusal no retry can cure."""
    settings = {"default_transaction_isolation": "read committed"}
    backend = PostgresBackend.from_dsn(bouncer, table=TEST_TABLE, min_size=1, max_size=2, server_settings=settings)
    try:
        with pytest.raises(BackendMisconfigured, match="ignore_startup_parameters"):
            await backend.check()
    finally:
        await backend.aclose()


async def test_asyncpg_s_own_pool_gets_the_same_treatment_through_a_pooler(bouncer: str) -> None:
    """With `implementation="asyncpg"`, `from_dsn` builds asyncpg's pool: it too makes no named
    prepared statements behind a pooler (before: "prepared statement ... does not exist" once the
    statements were reused on other server connections)."""
    backend = PostgresBackend.from_dsn(
        bouncer, table=TEST_TABLE, max_size=10, implementation="asyncpg", max_inactive_connection_lifetime=60
    )
    try:
        await backend.check()
        namespace = f"pgb-{uuid.uuid4().hex}"
        keys = [RecordKey.build(namespace, None, f"k{i}") for i in range(40)]
        for _ in range(3):  # claims, then replays of the same statements on whichever connection
            results = await asyncio.gather(*(backend.claim(k, b"fp", lease=30, ttl=60) for k in keys))
            assert len(results) == len(keys)
        assert type(backend._pool).__module__.startswith("asyncpg")
    finally:
        await backend.aclose()
