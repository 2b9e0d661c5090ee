"""The lean asyncpg connection pool `PostgresBackend.from_dsn` builds (`_postgres_lean.LeanPool`),
against the shared Postgres: bounded, first come first served, broken connections replaced,
cancelled statements really cancelled on the server, and asyncpg's pool used when asked for."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.postgres._errors import wrapped
from idem_asgi.backends.postgres._lean import LeanPool, broken_by
from idem_asgi.errors import BackendUnavailable, ConfigurationError
from idem_asgi.records import Claimed, Existing, RecordKey
from tests.support.servers import POSTGRES_DSN, require

pytestmark = pytest.mark.postgres


@pytest.fixture
async def app_name() -> AsyncIterator[str]:
    """An application_name no other test uses, so pg_stat_activity shows this test's connections only."""
    require("postgres", POSTGRES_DSN)
    yield f"lean-{uuid.uuid4().hex[:12]}"


async def connections(name: str) -> int:
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        return int(await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name))
    finally:
        await conn.close()


def lean(name: str, *, min_size: int = 1, max_size: int = 4) -> LeanPool:
    return LeanPool(POSTGRES_DSN, min_size=min_size, max_size=max_size, server_settings={"application_name": name})


async def test_500_concurrent_statements_share_at_most_max_size_connections(app_name: str) -> None:
    pool = await lean(app_name, max_size=4).start()
    peak = 0

    async def one(i: int) -> int:
        nonlocal peak
        async with pool.acquire(timeout=10) as conn:
            peak = max(peak, pool.get_size())
            value: int = await conn.fetchval("SELECT $1::int * 2", i)
            return value

    try:
        assert await asyncio.gather(*(one(i) for i in range(500))) == [i * 2 for i in range(500)]
        assert peak <= 4 and pool.get_size() <= 4
        assert await connections(app_name) == pool.get_size()
    finally:
        await pool.close()
    assert pool.is_closing()
    for _ in range(50):
        if await connections(app_name) == 0:
            break
        await asyncio.sleep(0.02)
    assert await connections(app_name) == 0


async def test_waiters_are_served_first_come_first_served_and_the_impatient_time_out(app_name: str) -> None:
    pool = await lean(app_name, max_size=1).start()
    order: list[str] = []
    held = await pool.take(1)

    async def wait(name: str, within: float) -> None:
        try:
            conn = await pool.take(within)
        except TimeoutError:
            order.append(name + " timed out")
            return
        order.append(name)
        await asyncio.sleep(0.01)
        pool.put(conn)

    try:
        first = asyncio.create_task(wait("first", 5))
        await asyncio.sleep(0.01)
        impatient = asyncio.create_task(wait("impatient", 0.02))
        cancelled = asyncio.create_task(wait("cancelled", 5))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        last = asyncio.create_task(wait("last", 5))
        await asyncio.sleep(0)
        pool.put(held)
        assert pool.take_now() is None, "a newcomer queues behind the waiters instead of taking the connection"
        newcomer = asyncio.create_task(wait("newcomer", 5))
        await asyncio.gather(first, impatient, cancelled, last, newcomer, return_exceptions=True)
        assert order == ["impatient timed out", "first", "last", "newcomer"]
        assert pool.take_now() is not None, "the one connection came back"
    finally:
        pool.terminate()


async def test_a_terminated_connection_is_replaced_and_its_waiter_served(app_name: str) -> None:
    pool = await lean(app_name, max_size=1).start()
    try:
        conn = await pool.take(1)
        pid = conn.get_server_pid()
        waiter = asyncio.create_task(pool.take(5))
        await asyncio.sleep(0.01)
        admin = await asyncpg.connect(POSTGRES_DSN)
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        # what asyncpg raises depends on when the server's goodbye arrives: any of these (the last,
        # its internal state error, was seen once in CI), and the pool must treat each as broken
        lost = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.exceptions.InternalClientError, OSError)
        with pytest.raises(lost):
            await conn.fetchval("SELECT 1")
        assert conn.is_closed(), "put() drops it whatever the error said"
        pool.put(conn, broken=True)
        fresh = await asyncio.wait_for(waiter, 5)
        assert fresh is not conn and fresh.get_server_pid() != pid
        assert await fresh.fetchval("SELECT 1") == 1
        pool.put(fresh)
    finally:
        await pool.close()


async def test_expire_connections_replaces_idle_and_busy_ones(app_name: str) -> None:
    pool = await lean(app_name, min_size=2, max_size=2).start()
    try:
        busy = await pool.take(1)
        old_pids = {busy.get_server_pid(), *(c.get_server_pid() for c in pool._idle)}
        await pool.expire_connections()
        pool.put(busy)
        assert busy.is_closed() and pool.get_size() == 0
        async with pool.acquire(timeout=5) as conn:
            assert conn.get_server_pid() not in old_pids
    finally:
        await pool.close()


async def test_a_statement_that_times_out_is_cancelled_on_the_server_and_its_connection_reused(
    app_name: str,
) -> None:
    """The claim of a timed-out request must not land later: the server gets a cancel request."""
    table = f"idem_lean_{uuid.uuid4().hex[:12]}"
    backend = PostgresBackend.from_dsn(
        POSTGRES_DSN, table=table, timeout=0.3, min_size=1, max_size=1, server_settings={"application_name": app_name}
    )
    admin = await asyncpg.connect(POSTGRES_DSN)
    key = RecordKey.build("lean", None, "k")
    try:
        await backend.setup()
        assert isinstance(backend._pool, LeanPool)
        async with admin.transaction():
            await admin.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
            with pytest.raises(BackendUnavailable):
                await backend.claim(key, b"fp", lease=30, ttl=60)
            # Still under the lock: a statement only abandoned client-side would wait on it here.
            waiting = -1
            for _ in range(100):
                waiting = await admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                    app_name,
                )
                if waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert waiting == 0
        # The same single connection serves the next call, once the cancel has been processed.
        assert isinstance(await backend.claim(key, b"fp", lease=30, ttl=60), Claimed)
        assert isinstance(await backend.claim(key, b"fp", lease=30, ttl=60), Existing)
        assert await connections(app_name) == 1
    finally:
        await backend.aclose()
        await admin.execute(f'DROP TABLE IF EXISTS "{table}"')
        await admin.close()


async def test_the_pool_is_the_one_implementation_names(app_name: str) -> None:
    """`implementation=` picks the pool (lean by default); an option of asyncpg's pool is refused
    on the lean one, not taken as a hint to switch pools (it used to switch silently)."""
    inits: list[int] = []

    async def init(conn: asyncpg.Connection) -> None:
        inits.append(conn.get_server_pid())

    with pytest.raises(ConfigurationError, match="init: an option of asyncpg's pool; pass implementation='asyncpg'"):
        PostgresBackend.from_dsn(POSTGRES_DSN, init=init)
    with pytest.raises(ConfigurationError, match="implementation must be 'lean' or 'asyncpg'"):
        PostgresBackend.from_dsn(POSTGRES_DSN, implementation="psycopg")  # type: ignore[arg-type]
    table = f"idem_lean_{uuid.uuid4().hex[:12]}"
    chosen = []
    choices: list[dict[str, Any]] = [
        {},
        {"implementation": "asyncpg"},
        {"implementation": "asyncpg", "init": init},
        {"implementation": "asyncpg", "max_inactive_connection_lifetime": 60.0},
    ]
    for options in choices:
        backend = PostgresBackend.from_dsn(POSTGRES_DSN, table=table, min_size=1, max_size=2, **options)
        try:
            await backend.setup()
            chosen.append(type(backend._pool).__name__)
            assert isinstance(
                await backend.claim(RecordKey.build("lean", None, str(options)), b"f", lease=5, ttl=5), Claimed
            )
        finally:
            await backend.aclose()
    admin = await asyncpg.connect(POSTGRES_DSN)
    try:
        await admin.execute(f'DROP TABLE IF EXISTS "{table}"')
    finally:
        await admin.close()
    assert chosen == ["LeanPool", "Pool", "Pool", "Pool"]
    assert inits, "asyncpg's pool ran the init hook"


def test_asyncpgs_state_error_on_a_killed_connection_means_broken_and_unavailable() -> None:
    lost = asyncpg.exceptions.InternalClientError("cannot switch to state 11; another operation (2) is in progress")
    assert broken_by(lost), "never handed to the next statement"
    assert isinstance(wrapped(lost), BackendUnavailable), "a 503 (the statement may or may not have run), not a 500"


async def test_callers_cancelled_while_their_connection_opens_leave_no_unretrieved_error(app_name: str) -> None:
    """A request cancelled while the pool opens a connection for it (a client gone, a `wait_for`):
    asyncpg's connect, cancelled midway, used to leave futures whose exception nobody read, and
    asyncio printed "Future exception was never retrieved" for them. The connection now opens in a
    task of its own and joins the pool when the caller has gone; no error is left unread and the
    pool never exceeds `max_size`."""
    loop = asyncio.get_running_loop()
    unread: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unread.append(str(context.get("message"))))
    pool = await lean(app_name, min_size=0, max_size=8).start()
    try:
        for delay in (0.0005, 0.001, 0.002, 0.004, 0.008):
            takers = [asyncio.ensure_future(pool.take(10)) for _ in range(8)]
            await asyncio.sleep(delay)
            for taker in takers:
                taker.cancel()
            for outcome in await asyncio.gather(*takers, return_exceptions=True):
                if not isinstance(outcome, BaseException):
                    pool.put(outcome)
            await asyncio.sleep(0.3)  # the connections opening meanwhile join the pool
            gc.collect()
            assert pool.get_size() <= 8
        await asyncio.sleep(0.2)
        gc.collect()
        assert unread == []
        assert pool.get_size() == await connections(app_name)  # every connection opened is the pool's
        async with pool.acquire(timeout=5) as conn:
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await pool.close()
        loop.set_exception_handler(previous)
