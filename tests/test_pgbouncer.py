"""Postgres behind a stock PgBouncer (Debian's 1.18) in transaction pooling mode, with the plain URL.

PgBouncer refuses the startup parameter `default_transaction_isolation` ("unsupported startup
parameter") and hands each transaction whichever server connection is free, so asyncpg's named
prepared statements go missing ("prepared statement ... does not exist"). `from_dsn` sends no
startup parameter and, seeing a pooler (`_postgres_pooler.py`), makes no named statements.

Here: the start-up check, concurrent requests through the middleware (one execution, identical
replays), a two-instance uvicorn storm, `transaction()` and its recover hook, all through a
throwaway PgBouncer (`tests/support/pgbouncer.py`);
then statement pooling, which refuses transaction blocks: a start-up error naming the fix. The
contract suite runs through it too (`tests/test_backend_contract.py[postgres-pgbouncer]`).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.context import held_claim
from idem_asgi.errors import BackendMisconfigured
from idem_asgi.middleware import check_store
from idem_asgi.records import Claimed, RecordKey
from tests.support.pgbouncer import pgbouncer
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require
from tests.support.stores import TEST_TABLE
from tests.test_concurrency import Counted, check_one_key, fire
from tests.test_multiprocess_storm import cleanup, storm, two_instances

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
        app = Counted()
        namespace = f"pgb-{uuid.uuid4().hex}"
        mw = IdempotencyMiddleware(
            app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
        )
        transport = httpx.ASGITransport(app=mw)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            one = await asyncio.gather(*(fire(client, "one", i * 0.001) for i in range(100)))
            keys = [f"k{i}" for i in range(50)]
            many = await asyncio.gather(*(fire(client, k, 0.0) for k in keys for _ in range(4)))
            replays = await asyncio.gather(*(fire(client, k, 0.0) for k in keys))
        check_one_key(one)
        for i in range(len(keys)):
            check_one_key([*many[4 * i : 4 * i + 4], replays[i]])
        assert set(app.executions.values()) == {1} and len(app.executions) == 51
    finally:
        await backend.aclose()


async def test_a_two_instance_uvicorn_storm_through_a_transaction_pooler_runs_each_key_once(
    bouncer: str, tmp_path: Path
) -> None:
    require("redis", REDIS_URL)  # the execution counter
    run = uuid.uuid4().hex[:12]
    namespace, counter = f"storm-{run}", f"idem-storm-count:{run}:"
    env = {**os.environ, "IDEM_STORM_BACKEND": bouncer, "IDEM_STORM_NAMESPACE": namespace,
           "IDEM_STORM_COUNTER_URL": REDIS_URL, "IDEM_STORM_COUNTER": counter}  # fmt: skip
    keys = [f"{run}-{i:03d}" for i in range(100)]
    try:
        async with two_instances(env, tmp_path) as instances:
            answers = await storm([i.port for i in instances], keys, 8)
            late = await storm([i.port for i in instances], keys, 1)
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            counts = [int(c or 0) for c in await client.mget([counter + k for k in keys])]
        finally:
            await client.aclose()
        statuses = sorted({status for group in answers.values() for status, _, _ in group})
        print(
            f"\n[pgbouncer storm] {len(keys)} keys x 8 over 2 instances: executions {sum(counts)}, statuses {statuses}"
        )
        assert counts == [1] * len(keys)
        assert set(statuses) <= {201, 409}, statuses
        for key, group in answers.items():
            first = {body for status, _, body in group if status == 201}
            assert len(first) == 1, key
            assert [(s, body) for s, _, body in late[key]] == [(201, *first)], key
    finally:
        await cleanup(bouncer, namespace, counter)


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
    """Given an option only asyncpg's pool has, `from_dsn` builds that pool: it too makes no named
    prepared statements behind a pooler (before: "prepared statement ... does not exist" once the
    statements were reused on other server connections)."""
    backend = PostgresBackend.from_dsn(bouncer, table=TEST_TABLE, max_size=10, max_inactive_connection_lifetime=60)
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
