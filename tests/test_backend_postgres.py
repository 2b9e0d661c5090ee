"""PostgresBackend beyond the shared contract: schema, housekeeping, SQL safety, races, timeouts.

Every test gets its own table on the shared server (dropped afterwards), so purges and
listings never see another test's rows. Raw asyncpg connections read what was stored.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from idem_asgi.backends.postgres import PostgresBackend, StaleRecord
from idem_asgi.context import held_claim
from idem_asgi.errors import BackendUnavailable, ClaimLost, ConfigurationError
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, Existing, RecordKey, StoredResponse
from tests.support.servers import POSTGRES_DSN, free_port, require

pytestmark = pytest.mark.postgres

DAY = 86_400.0
RESPONSE = StoredResponse(201, [(b"content-type", b"application/octet-stream"), (b"x-a", b"\x00\xff")], b"ok")


def fresh_table() -> str:
    return f"idem_pgtest_{uuid.uuid4().hex[:16]}"


async def drop(*names: str) -> None:
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        for name in names:
            await conn.execute(f"DROP TABLE IF EXISTS {name}")
    finally:
        await conn.close()


@pytest.fixture
async def raw() -> AsyncIterator[asyncpg.Connection]:
    require("postgres", POSTGRES_DSN)
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def pg() -> AsyncIterator[PostgresBackend]:
    """A backend on a table of its own, dropped afterwards."""
    require("postgres", POSTGRES_DSN)
    table = fresh_table()
    backend = PostgresBackend.from_dsn(
        POSTGRES_DSN,
        table=table,
        min_size=1,
        max_size=20,
        timeout=5.0,
        store_keys=True,  # raw columns inspected here
    )
    try:
        await backend.setup()
        yield backend
    finally:
        try:
            await drop(backend.table)
        finally:
            await backend.aclose()


APP_ROWS = "namespace <> ''"
"""The records (not the settings row that says the app keeps raw keys: `store_keys=True`)."""


def k(key: str = "key-1", scope: str | None = None, namespace: str = "ns") -> RecordKey:
    return RecordKey.build(namespace, scope, key)


async def relations(conn: asyncpg.Connection, table: str, schema: str = "public") -> list[str]:
    rows = await conn.fetch(
        "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 ORDER BY 1", schema, table
    )
    return [r[0] for r in rows]


# --- schema -----------------------------------------------------------------------------------


async def test_ddl_text_is_valid_and_can_run_twice(raw: asyncpg.Connection) -> None:
    table = fresh_table()
    backend = PostgresBackend(table=table)
    try:
        await raw.execute(backend.ddl)
        await raw.execute(backend.ddl)
        assert await relations(raw, table) == [
            f"{table}_expires_idx",
            f"{table}_inflight_idx",
            f"{table}_kept_idx",
            f"{table}_pkey",
        ]
        columns = await raw.fetch(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = $1", table
        )
        types = {c["column_name"]: c["data_type"] for c in columns}
        assert types["body"] == types["headers"] == types["fingerprint"] == "bytea"
        assert types["expires_at"] == types["lease_until"] == "timestamp with time zone"
    finally:
        await drop(f'"{table}"')


async def test_setup_is_idempotent_and_safe_from_many_workers_at_once() -> None:
    require("postgres", POSTGRES_DSN)
    table = fresh_table()
    # CREATE TABLE IF NOT EXISTS races with itself (pg_type unique violation) without a lock.
    backends = [PostgresBackend.from_dsn(POSTGRES_DSN, table=table, min_size=1, max_size=1) for _ in range(6)]
    try:
        await asyncio.gather(*[b.setup() for b in backends])
        await asyncio.gather(*[b.setup() for b in backends])
        assert isinstance(await backends[0].claim(k(), b"fp", lease=30, ttl=DAY), Claimed)
    finally:
        try:
            await drop(f'"{table}"')
        finally:
            for b in backends:
                await b.aclose()


async def test_setup_of_an_existing_table_waits_for_no_lock(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    # An open writing transaction holds ROW EXCLUSIVE; CREATE INDEX (even IF NOT EXISTS) would
    # queue behind it for SHARE, and every claim behind that. setup() must see the table is there.
    async with raw.transaction():
        await raw.execute(f"LOCK TABLE {pg.table} IN ROW EXCLUSIVE MODE")
        started = time.monotonic()
        await asyncio.wait_for(pg.setup(), 2)
        assert time.monotonic() - started < 1


async def test_custom_schema_table(raw: asyncpg.Connection) -> None:
    schema = f"idem_pgtest_schema_{uuid.uuid4().hex[:12]}"
    await raw.execute(f'CREATE SCHEMA "{schema}"')
    try:
        async with PostgresBackend.from_dsn(POSTGRES_DSN, table=f"{schema}.Records", min_size=1, max_size=2) as b:
            await b.setup()
            await b.setup()
            claimed = await b.claim(k(), b"fp", lease=30, ttl=DAY)
            assert isinstance(claimed, Claimed)
            assert await b.complete(k(), claimed.token, RESPONSE, ttl=DAY)
            rec = await b.get(k())
            assert rec is not None and rec.response == RESPONSE
            assert await raw.fetchval(f'SELECT count(*) FROM "{schema}"."Records"') == 1
            indexes = await relations(raw, "Records", schema)
            assert indexes == ["Records_expires_idx", "Records_inflight_idx", "Records_kept_idx", "Records_pkey"]
            assert await raw.fetchval("SELECT to_regclass('public.\"Records\"')") is None
    finally:
        await raw.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "a.",
        ".a",
        "a.b.c",
        'a"b',
        "a;b",
        "a b",
        "a-b",
        "1abc",
        "t\n",
        "x" * 64,
        "Robert'); DROP TABLE students;--",
        'idem"; DROP TABLE x; --',
        "ïdem",
    ],
)
def test_bad_table_identifiers_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError):
        PostgresBackend(table=name)


async def test_longest_table_name_keeps_distinct_index_names(raw: asyncpg.Connection) -> None:
    table = "t" + uuid.uuid4().hex + "x" * 30  # 63 characters, the limit
    assert len(table) == 63
    async with PostgresBackend.from_dsn(POSTGRES_DSN, table=table, min_size=1, max_size=1) as b:
        try:
            await b.setup()
            indexes = await relations(raw, table)
            assert len(indexes) == 4, indexes  # pkey, expires, inflight, kept: none lost to truncation
            assert isinstance(await b.claim(k(), b"fp", lease=30, ttl=DAY), Claimed)
        finally:
            await drop(b.table)


# --- storage ----------------------------------------------------------------------------------


async def test_body_is_stored_as_bytea_verbatim(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    body = bytes(range(256)) * 64 + b"\x00\x00\r\n\\x00'\""
    headers = [(b"content-type", b"application/octet-stream"), (b"x-dup", b"1"), (b"x-dup", b"\xff\x00")]
    claimed = await pg.claim(k(), b"\x00fp\xff", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    assert await pg.complete(k(), claimed.token, StoredResponse(201, headers, body), ttl=DAY)
    row = await raw.fetchrow(
        f"SELECT body, pg_typeof(body)::text AS type, octet_length(body) AS n, fingerprint, status, state "
        f"FROM {pg.table} WHERE namespace = $1 AND scope = $2 AND key = $3",
        "ns",
        "",
        "key-1",
    )
    assert row["type"] == "bytea" and row["n"] == len(body)
    assert row["body"] == body
    assert row["fingerprint"] == b"\x00fp\xff"
    assert (row["status"], row["state"]) == (201, b"c")
    rec = await pg.get(k())
    assert rec is not None and rec.response == StoredResponse(201, headers, body)


async def test_hostile_values_are_bound_parameters(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    canary = fresh_table()
    await raw.execute(f"CREATE TABLE {canary} (id int)")
    try:
        hostile = [
            f"'; DROP TABLE {canary}; --",
            f"x'); DROP TABLE {canary}; --",
            "$1",
            "$$; SELECT 1; $$",
            "\\'",
            "%s%s%(x)s",
            "{0}",
            "' OR '1'='1",
        ]
        for i, value in enumerate(hostile):
            key = RecordKey.build(value, value, value)  # namespace, scope and key all hostile
            claimed = await pg.claim(key, value.encode(), lease=30, ttl=DAY)
            assert isinstance(claimed, Claimed), value
            assert await pg.complete(key, claimed.token, RESPONSE, ttl=DAY)
            rows = await raw.fetch(
                f"SELECT namespace, scope, key FROM {pg.table} WHERE key = $1 AND scope = $1 AND namespace = $1", value
            )
            assert [tuple(r) for r in rows] == [(value, value, value)], value
            again = await pg.claim(key, value.encode(), lease=30, ttl=DAY)
            assert isinstance(again, Existing) and again.record.response == RESPONSE
            assert await raw.fetchval(f"SELECT count(*) FROM {pg.table} WHERE {APP_ROWS}") == i + 1
        assert await raw.fetchval("SELECT to_regclass($1)", canary) is not None
    finally:
        await raw.execute(f"DROP TABLE IF EXISTS {canary}")


async def test_a_given_pool_is_left_open() -> None:
    require("postgres", POSTGRES_DSN)
    table = fresh_table()
    pool = await asyncpg.create_pool(POSTGRES_DSN, min_size=1, max_size=2)
    try:
        async with PostgresBackend(pool, table=table) as backend:
            await backend.setup()
            assert isinstance(await backend.claim(k(), b"fp", lease=30, ttl=DAY), Claimed)
        await backend.aclose()
        assert not pool.is_closing()
        assert await pool.fetchval(f'SELECT count(*) FROM "{table}"') == 1
        await pool.execute(f'DROP TABLE "{table}"')
    finally:
        await pool.close()


async def test_a_pool_built_by_from_dsn_is_closed() -> None:
    require("postgres", POSTGRES_DSN)
    backend = PostgresBackend.from_dsn(POSTGRES_DSN, table=fresh_table(), min_size=1, max_size=1)
    await backend.setup()
    pool = backend._pool
    try:
        await drop(backend.table)
    finally:
        await backend.aclose()
    assert pool is not None and pool.is_closing()


# --- the claim under concurrency ----------------------------------------------------------------


async def test_claim_statement_sees_nothing_when_a_concurrent_insert_commits_late(
    pg: PostgresBackend, raw: asyncpg.Connection
) -> None:
    """Why `claim` re-runs its statement: one run can find neither a free key nor a visible row."""
    other = await asyncpg.connect(POSTGRES_DSN)
    try:
        args = ("ns", "", "key-1", b"fp")
        tx = raw.transaction()
        await tx.start()
        first = await raw.fetch(pg.sql.claim, *args, 1, 30.0, DAY, None)
        assert [r[0] for r in first] == [True]
        # The second statement takes its snapshot now, then waits on the uncommitted insert.
        second = asyncio.ensure_future(other.fetch(pg.sql.claim, *args, 2, 30.0, DAY, None))
        await asyncio.sleep(0.3)
        assert not second.done()
        await tx.commit()
        assert await asyncio.wait_for(second, 5) == []  # the winner's row is not in its snapshot
        # Through the backend the same race ends as a read of the winner's record.
        tx = raw.transaction()
        await tx.start()
        await raw.fetch(pg.sql.claim, "ns", "", "key-2", b"fp", 3, 30.0, DAY, None)
        late = asyncio.ensure_future(pg.claim(k("key-2"), b"fp", lease=30, ttl=DAY))
        await asyncio.sleep(0.3)
        await tx.commit()
        result = await asyncio.wait_for(late, 5)
        assert isinstance(result, Existing) and result.record.token == 3
    finally:
        await other.close()


async def test_200_concurrent_claims_on_a_fresh_key_one_winner_no_error(pg: PostgresBackend) -> None:
    for round_ in range(5):
        key = k(f"hot-{round_}")
        results = await asyncio.gather(*[pg.claim(key, b"fp", lease=30, ttl=DAY) for _ in range(200)])
        winners = [r for r in results if isinstance(r, Claimed)]
        losers = [r for r in results if isinstance(r, Existing)]
        assert (len(winners), len(losers)) == (1, 199)
        assert {r.record.token for r in losers} == {winners[0].token}
        assert all(r.record.state == IN_PROGRESS for r in losers)


async def test_200_concurrent_takeovers_of_an_expired_lease_one_winner(pg: PostgresBackend) -> None:
    first = await pg.claim(k(), b"fp", lease=0.1, ttl=DAY)
    assert isinstance(first, Claimed)
    await asyncio.sleep(0.25)
    results = await asyncio.gather(*[pg.takeover(k(), first.token, b"fp", lease=30, ttl=DAY) for _ in range(200)])
    winners = [r for r in results if isinstance(r, Claimed)]
    assert len(winners) == 1
    assert all(r.record.token in (first.token, winners[0].token) for r in results if isinstance(r, Existing))


async def test_a_replay_takes_no_row_lock(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    """Replays and in-progress duplicates are plain reads: they never queue behind a writer."""
    done = await pg.claim(k("done"), b"fp", lease=30, ttl=DAY)
    running = await pg.claim(k("running"), b"fp", lease=30, ttl=DAY)
    assert isinstance(done, Claimed) and isinstance(running, Claimed)
    assert await pg.complete(k("done"), done.token, RESPONSE, ttl=DAY)
    async with raw.transaction():
        await raw.execute(f"SELECT 1 FROM {pg.table} FOR UPDATE")  # every row locked by someone else
        started = time.monotonic()
        replay = await asyncio.wait_for(pg.claim(k("done"), b"fp", lease=30, ttl=DAY), 2)
        dup = await asyncio.wait_for(pg.claim(k("running"), b"fp", lease=30, ttl=DAY), 2)
        assert time.monotonic() - started < 0.5
    assert isinstance(replay, Existing) and replay.record.state == COMPLETED
    assert isinstance(dup, Existing) and dup.record.state == IN_PROGRESS
    # Nor do they write: the claim statement on a live key takes no transaction id, so its commit
    # flushes no WAL (the former ON CONFLICT DO UPDATE locked the row, and so did both).
    for key in ("done", "running"):
        async with raw.transaction():
            rows = await raw.fetch(pg.sql.claim, "ns", "", key, b"fp", 99, 30.0, DAY, None)
            assert [r[0] for r in rows] == [False]
            assert await raw.fetchval("SELECT txid_current_if_assigned()") is None


# --- housekeeping -------------------------------------------------------------------------------


async def fill(pg: PostgresBackend, expired: int, live: int) -> None:
    for i in range(expired):
        claimed = await pg.claim(k(f"old-{i}"), b"fp", lease=0.1, ttl=0.2)
        assert isinstance(claimed, Claimed)
        if i % 2:
            assert await pg.complete(k(f"old-{i}"), claimed.token, RESPONSE, ttl=0.2)
    for i in range(live):
        claimed = await pg.claim(k(f"live-{i}"), b"fp", lease=0.1, ttl=DAY)
        assert isinstance(claimed, Claimed)
        if i % 2:
            assert await pg.complete(k(f"live-{i}"), claimed.token, RESPONSE, ttl=DAY)
    await asyncio.sleep(0.35)


async def live_keys(pg: PostgresBackend, raw: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await raw.fetch(f"SELECT key FROM {pg.table} WHERE {APP_ROWS}")}


async def test_purge_removes_only_expired_rows_in_batches(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    await fill(pg, expired=25, live=6)
    assert await pg.purge(batch_size=10, max_batches=1) == 10
    assert await raw.fetchval(f"SELECT count(*) FROM {pg.table} WHERE {APP_ROWS}") == 21
    assert await pg.purge(batch_size=10) == 15  # two more batches: 10, then 5 (short, so it stops)
    assert await live_keys(pg, raw) == {f"live-{i}" for i in range(6)}
    assert await pg.purge() == 0
    with pytest.raises(ValueError):
        await pg.purge(batch_size=0)


async def test_purge_skips_rows_locked_by_live_traffic(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    await fill(pg, expired=5, live=1)
    async with raw.transaction():
        await raw.execute(f"SELECT 1 FROM {pg.table} WHERE key = 'old-0' FOR UPDATE")
        started = time.monotonic()
        assert await asyncio.wait_for(pg.purge(batch_size=2), 3) == 4
        assert time.monotonic() - started < 1
    assert await live_keys(pg, raw) == {"old-0", "live-0"}
    assert await pg.purge() == 1


async def test_purge_while_expired_keys_are_claimed_again(pg: PostgresBackend, raw: asyncpg.Connection) -> None:
    """Serving and purging at once: every new claim wins and its record survives the purge."""
    await fill(pg, expired=60, live=0)
    claims = [pg.claim(k(f"old-{i}"), b"new", lease=30, ttl=DAY) for i in range(60)]
    first = asyncio.ensure_future(pg.purge(batch_size=7))  # started in this order: a purge, the claims, a purge
    claimed = asyncio.gather(*claims)
    last = asyncio.ensure_future(pg.purge(batch_size=3))
    purged_first, results, purged_last = await asyncio.gather(first, claimed, last)
    assert all(isinstance(r, Claimed) for r in results)
    assert 0 <= purged_first + purged_last <= 60
    assert await pg.purge() == 0
    assert await live_keys(pg, raw) == {f"old-{i}" for i in range(60)}
    for i in range(60):
        rec = await pg.get(k(f"old-{i}"))
        assert rec is not None and rec.fingerprint == b"new"


async def test_stale_lists_only_expired_in_progress_records(pg: PostgresBackend) -> None:
    crashed = RecordKey.build("ns", "tenant:a", "crashed")
    other_ns = RecordKey.build("other", None, "crashed-too")
    crashed_claim = await pg.claim(crashed, b"fp1", lease=0.1, ttl=DAY)
    other_claim = await pg.claim(other_ns, b"fp2", lease=0.1, ttl=DAY)
    assert isinstance(crashed_claim, Claimed) and isinstance(other_claim, Claimed)
    assert isinstance(await pg.claim(k("running"), b"fp", lease=30, ttl=DAY), Claimed)
    done = await pg.claim(k("done"), b"fp", lease=0.1, ttl=DAY)
    assert isinstance(done, Claimed) and await pg.complete(k("done"), done.token, RESPONSE, ttl=DAY)
    assert isinstance(await pg.claim(k("gone"), b"fp", lease=0.1, ttl=0.2), Claimed)  # past its TTL too
    await asyncio.sleep(0.35)

    stale = await pg.stale(0)
    assert [type(s) for s in stale] == [StaleRecord, StaleRecord]
    by_key = {s.key: s.record for s in stale}
    assert set(by_key) == {crashed, other_ns}  # digest and all: usable with complete/release
    assert by_key[crashed].token == crashed_claim.token and by_key[crashed].fingerprint == b"fp1"
    assert by_key[other_ns].token == other_claim.token and by_key[other_ns].state == IN_PROGRESS
    assert await pg.stale(older_than=60) == []
    assert len(await pg.stale(0, limit=1)) == 1
    # The reconcile job resolves one; it disappears from the list.
    assert await pg.release(crashed, crashed_claim.token)
    assert [s.key for s in await pg.stale(0)] == [other_ns]


# --- failures -----------------------------------------------------------------------------------


async def test_a_blocked_statement_ends_within_the_timeout_and_is_cancelled(raw: asyncpg.Connection) -> None:
    table = fresh_table()
    backend = PostgresBackend.from_dsn(POSTGRES_DSN, table=table, timeout=0.5, min_size=1, max_size=2)
    try:
        await backend.setup()
        claimed = await backend.claim(k(), b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        async with raw.transaction():
            await raw.execute(f'SELECT 1 FROM "{table}" FOR UPDATE')
            started = time.monotonic()
            with pytest.raises(BackendUnavailable):
                await backend.complete(k(), claimed.token, RESPONSE, ttl=DAY)
            assert 0.4 < time.monotonic() - started < 0.8
            # The server got a cancel request: the UPDATE stops waiting on our lock (bounded poll).
            waiting = -1
            for _ in range(100):
                waiting = await raw.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
                    f'%UPDATE "{table}"%',
                )
                if waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert waiting == 0
        # Cancelled, not merely abandoned: the record is still in progress, and the pool works.
        rec = await backend.get(k())
        assert rec is not None and rec.state == IN_PROGRESS
        assert await backend.complete(k(), claimed.token, RESPONSE, ttl=DAY)
    finally:
        try:
            await drop(f'"{table}"')
        finally:
            await backend.aclose()


async def test_an_unreachable_server_is_unavailable_at_once() -> None:
    backend = PostgresBackend.from_dsn(f"postgresql://postgres@127.0.0.1:{free_port()}/test", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable):
        await backend.claim(k(), b"fp", lease=30, ttl=DAY)
    with pytest.raises(BackendUnavailable):
        await backend.setup()
    assert time.monotonic() - started < 2
    await backend.aclose()


# --- exactly once in the same database: transaction() -----------------------------------------


@pytest.fixture
async def ledger(pg: PostgresBackend, raw: asyncpg.Connection) -> AsyncIterator[str]:
    """A business table with no unique constraint: a second execution shows as a second row."""
    name = fresh_table() + "_ledger"
    await raw.execute(f"CREATE TABLE {name} (key text NOT NULL, amount int NOT NULL)")
    try:
        yield name
    finally:
        await raw.execute(f"DROP TABLE {name}")


async def state_of(raw: asyncpg.Connection, pg: PostgresBackend, key: str) -> bytes | None:
    value: bytes | None = await raw.fetchval(f"SELECT state FROM {pg.table} WHERE key = $1", key)
    return value


async def test_transaction_commits_the_effect_with_the_claim(
    pg: PostgresBackend, raw: asyncpg.Connection, ledger: str
) -> None:
    claimed = await pg.claim(k(), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(claimed, Claimed)
    with held_claim(pg, k(), claimed.token) as held:
        async with pg.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 100)", "key-1")
            assert (
                await state_of(raw, pg, "key-1") == b"t"
            )  # inside a transaction not committed yet (the mark before BEGIN)
            assert not held.effect
        assert held.effect  # committed: the request's failure can no longer release it
    assert await state_of(raw, pg, "key-1") == b"e"
    assert await raw.fetchval(f"SELECT count(*) FROM {ledger}") == 1
    rec = await pg.get(k())
    assert rec is not None and rec.state == IN_PROGRESS  # still in progress for the middleware
    assert await pg.release(k(), claimed.token) is False  # an effect that happened is never released
    await asyncio.sleep(0.3)
    [stale] = await pg.stale(0)
    assert stale.key == k() and stale.effect_committed is True
    assert await pg.recover_uncommitted(k(), stale.record) is None  # never run again
    again = await pg.takeover(k(), claimed.token, b"fp", lease=30, ttl=DAY)
    assert isinstance(again, Existing)  # not even by a takeover with the right token
    assert await pg.complete(k(), claimed.token, RESPONSE, ttl=DAY)  # the answer can still be stored
    assert await state_of(raw, pg, "key-1") == b"c"


async def test_a_failed_transaction_leaves_only_a_claim_that_can_run_again(
    pg: PostgresBackend, raw: asyncpg.Connection, ledger: str
) -> None:
    claimed = await pg.claim(k(), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(claimed, Claimed)
    with pytest.raises(RuntimeError), held_claim(pg, k(), claimed.token):
        async with pg.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 100)", "key-1")
            raise RuntimeError("the handler failed after its write")
    assert await raw.fetchval(f"SELECT count(*) FROM {ledger}") == 0
    assert await state_of(raw, pg, "key-1") == b"p"
    await asyncio.sleep(0.3)
    [stale] = await pg.stale(0)
    assert stale.effect_committed is False
    assert await pg.recover_uncommitted(k(), stale.record) == "run"


async def test_a_holder_whose_claim_was_taken_over_cannot_commit(
    pg: PostgresBackend, raw: asyncpg.Connection, ledger: str
) -> None:
    claimed = await pg.claim(k(), b"fp", lease=0.1, ttl=DAY)
    assert isinstance(claimed, Claimed)
    await asyncio.sleep(0.25)

    async def new_holder() -> int:  # another request, in its own context
        taken = await pg.takeover(k(), claimed.token, b"fp", lease=30, ttl=DAY)
        assert isinstance(taken, Claimed)
        with held_claim(pg, k(), taken.token):
            async with pg.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 2)", "key-1")
        return taken.token

    new_token = await asyncio.create_task(new_holder())
    with pytest.raises(ClaimLost), held_claim(pg, k(), claimed.token):
        async with pg.transaction() as conn:  # the old holder, late
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 1)", "key-1")
    assert [tuple(r) for r in await raw.fetch(f"SELECT * FROM {ledger}")] == [("key-1", 2)]
    rec = await pg.get(k())
    assert rec is not None and rec.token == new_token


async def test_concurrent_requests_each_mark_their_own_claim(
    pg: PostgresBackend, raw: asyncpg.Connection, ledger: str
) -> None:
    async def request(i: int) -> None:
        claimed = await pg.claim(k(f"key-{i}"), b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        await asyncio.sleep(0.01 * (i % 3))
        with held_claim(pg, k(f"key-{i}"), claimed.token):
            async with pg.transaction() as conn:
                await conn.execute(f"INSERT INTO {ledger} VALUES ($1, $2)", f"key-{i}", i)

    await asyncio.gather(*[request(i) for i in range(20)])
    rows = await raw.fetch(f"SELECT key, state FROM {pg.table} WHERE {APP_ROWS}")
    assert {(r["key"], r["state"]) for r in rows} == {(f"key-{i}", b"e") for i in range(20)}
    assert await raw.fetchval(f"SELECT count(DISTINCT key) FROM {ledger}") == 20


async def test_transaction_inside_your_own_unit_of_work(
    pg: PostgresBackend, raw: asyncpg.Connection, ledger: str
) -> None:
    claimed = await pg.claim(k(), b"fp", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        held = held_claim(pg, k(), claimed.token)
        held.__enter__()
        outer = conn.transaction()
        await outer.start()
        async with pg.transaction(conn) as same:
            assert same is conn
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 100)", "key-1")
        assert await state_of(raw, pg, "key-1") == b"p"  # your COMMIT decides
        await outer.rollback()
        assert await state_of(raw, pg, "key-1") == b"p"
        assert await raw.fetchval(f"SELECT count(*) FROM {ledger}") == 0
        async with conn.transaction(), pg.transaction(conn):
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 100)", "key-1")
        assert await state_of(raw, pg, "key-1") == b"e"
        assert await raw.fetchval(f"SELECT count(*) FROM {ledger}") == 1
        held.__exit__(None, None, None)
    finally:
        await conn.close()


async def test_transaction_without_a_claim_is_a_plain_transaction(
    pg: PostgresBackend, raw: asyncpg.Connection, ledger: str
) -> None:
    async def unprotected() -> None:  # a request without a key: the middleware claimed nothing
        async with pg.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 1)", "no-key")

    await asyncio.create_task(unprotected())
    assert await raw.fetchval(f"SELECT count(*) FROM {ledger}") == 1
    claimed = await pg.claim(k(), b"fp", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    other = PostgresBackend(table=pg.table.strip('"'))
    with pytest.raises(ConfigurationError), held_claim(pg, k(), claimed.token):
        async with other.transaction():
            pass


async def test_a_pool_that_is_not_read_committed_claims_once_without_serialization_errors() -> None:
    """Under REPEATABLE READ a losing claimer gets 40001. The backend no longer pins the sessions
    with a startup parameter (PgBouncer refuses it): it sees the default and runs each statement in a
    READ COMMITTED transaction. Before: `setup()` refused such a pool, and `from_dsn` with the
    same `server_settings` too."""
    require("postgres", POSTGRES_DSN)
    settings = {"default_transaction_isolation": "repeatable read"}
    pool = await asyncpg.create_pool(POSTGRES_DSN, min_size=1, max_size=10, server_settings=settings)
    try:
        for backend in (
            PostgresBackend(pool, table=fresh_table()),
            PostgresBackend.from_dsn(POSTGRES_DSN, table=fresh_table(), max_size=10, server_settings=settings),
        ):
            try:
                await backend.setup()
                for i in range(5):
                    key = RecordKey.build("rr", None, f"key-{i}")
                    results = await asyncio.gather(*(backend.claim(key, b"fp", lease=30, ttl=60) for _ in range(40)))
                    assert sum(isinstance(r, Claimed) for r in results) == 1
                    assert all(isinstance(r, Claimed | Existing) for r in results)
            finally:
                await drop(backend.table)
                await backend.aclose()
    finally:
        await pool.close()


# --- fair turns at the pool (asyncpg's own queue lets newcomers barge past waiters) ---------------


async def test_turns_go_to_the_longest_waiter_and_skip_the_ones_that_gave_up() -> None:
    from idem_asgi.backends.postgres._pool import Turns as _Turns

    turns = _Turns(1)
    await turns.take(1.0)  # the only turn
    order: list[str] = []

    async def wait(name: str, within: float) -> None:
        try:
            await turns.take(within)
        except TimeoutError:
            order.append(name + " timed out")
            return
        order.append(name)
        turns.give_back()

    first = asyncio.create_task(wait("first", 5))
    impatient = asyncio.create_task(wait("impatient", 0.01))
    cancelled = asyncio.create_task(wait("cancelled", 5))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    last = asyncio.create_task(wait("last", 5))
    await asyncio.sleep(0)
    turns.give_back()
    # A newcomer arriving now queues behind the waiters instead of taking the turn.
    newcomer = asyncio.create_task(wait("newcomer", 5))
    await asyncio.gather(first, impatient, last, newcomer, return_exceptions=True)
    assert order == ["impatient timed out", "first", "last", "newcomer"]
    await turns.take(0.01)  # every turn came back: one free again


async def test_a_closed_backend_fails_every_call_and_opens_no_pool() -> None:
    """After `aclose()`, `from_dsn`'s backend made its last pool: a late write or a renewal still
    running fails at once instead of opening a new pool nobody would close."""
    require("postgres", POSTGRES_DSN)
    store = PostgresBackend.from_dsn(POSTGRES_DSN, table="idem_closed_records")
    key = RecordKey.build("closed", None, uuid.uuid4().hex)
    claimed = await store.claim(key, b"f", lease=10, ttl=60)
    assert isinstance(claimed, Claimed)
    await store.aclose()
    for call in (
        store.claim(key, b"f", lease=10, ttl=60),
        store.complete(key, claimed.token, StoredResponse(201, [], b"{}"), ttl=60),
        store.extend(key, claimed.token, lease=10),
        store.get(key),
    ):
        with pytest.raises(BackendUnavailable, match="closed"):
            await call
    assert store._pool is None, "no pool opened again"
