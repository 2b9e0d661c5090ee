"""Nothing a client sent as its key, nor the scope it is kept under, sits in a shared store: Redis
and Postgres keep the namespace and the key's digest only (unless `store_keys=True`), and
`idem-asgi migrate` rewrites records of earlier versions so that they are still found."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis.asyncio as aioredis

from idem_asgi.backends import Backend
from idem_asgi.ops.cli import run
from idem_asgi.records import Claimed, Existing, RecordKey, StoredResponse
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require
from tests.support.stores import SHARED, make_backend

RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id":"pay_1"}')
SECRET_KEY = "card-4242-4242-idem"
SECRET_SCOPE = "user:alice@example.com"


@pytest.fixture(params=SHARED)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def at_rest(kind: str, store: Backend, key: RecordKey) -> bytes:
    """Every byte the store keeps for `key`'s record, joined."""
    if kind == "redis":
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            fields = await client.hgetall(store._key(key))  # type: ignore[attr-defined]
        finally:
            await client.aclose()
        assert fields, "the record exists"
        return b"|".join(f + b"=" + v for f, v in fields.items())  # type: ignore[operator,misc]
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        rows = await conn.fetch(f"SELECT * FROM {store.table} WHERE namespace = $1", key.namespace)  # type: ignore[attr-defined]
    finally:
        await conn.close()
    assert len(rows) == 1, rows
    return b"|".join(str(v).encode() if not isinstance(v, bytes) else v for v in rows[0].values())


@pytest.fixture
async def stores(kind: str) -> AsyncIterator[tuple[Backend, Backend, list[str]]]:
    """(default store, one keeping raw keys) over the same keyspace, and the CLI arguments naming it."""
    prefix = f"idem-test:{uuid.uuid4().hex}:"
    table = f"idem_keys_{uuid.uuid4().hex[:12]}"  # its own: migrate rewrites a whole table
    hashed = await make_backend(kind, prefix=prefix, table=table)
    raw = await make_backend(kind, prefix=prefix, table=table, store_keys=True)
    args = ["--backend", REDIS_URL, "--prefix", prefix] if kind == "redis" else ["--backend", POSTGRES_DSN]
    if kind == "postgres":
        args += ["--table", hashed.table.strip('"')]  # type: ignore[attr-defined]
    try:
        yield hashed, raw, args
    finally:
        await hashed.aclose()
        await raw.aclose()
        if kind == "postgres":
            conn = await asyncpg.connect(POSTGRES_DSN)
            try:
                await conn.execute(f'DROP TABLE IF EXISTS "{table}"')
            finally:
                await conn.close()


async def test_by_default_only_the_digest_is_kept(kind: str, stores: tuple[Backend, Backend, list[str]]) -> None:
    hashed, _, _ = stores
    key = RecordKey.build(f"t-{uuid.uuid4().hex}", SECRET_SCOPE, SECRET_KEY)
    claimed = await hashed.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(claimed, Claimed) and await hashed.complete(key, claimed.token, RESPONSE, ttl=600)
    kept = await at_rest(kind, hashed, key)
    assert SECRET_KEY.encode() not in kept and SECRET_SCOPE.encode() not in kept
    assert key.namespace.encode() in kept  # the namespace stays: it names the app, and stale() filters by it
    replay = await hashed.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(replay, Existing) and replay.record.response == RESPONSE


async def test_store_keys_keeps_them_for_the_tools(kind: str, stores: tuple[Backend, Backend, list[str]]) -> None:
    _, raw, _ = stores
    key = RecordKey.build(f"t-{uuid.uuid4().hex}", SECRET_SCOPE, SECRET_KEY)
    assert isinstance(await raw.claim(key, b"fp", lease=30, ttl=600), Claimed)
    kept = await at_rest(kind, raw, key)
    assert SECRET_KEY.encode() in kept and SECRET_SCOPE.encode() in kept


async def test_migrate_rewrites_older_records_and_they_are_still_found(
    kind: str, stores: tuple[Backend, Backend, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    require(kind, REDIS_URL if kind == "redis" else POSTGRES_DSN)
    hashed, raw, args = stores
    namespace = f"t-{uuid.uuid4().hex}"
    done = RecordKey.build(namespace, SECRET_SCOPE, SECRET_KEY)
    running = RecordKey.build(namespace, SECRET_SCOPE, SECRET_KEY + "-running")
    claimed = await raw.claim(done, b"fp", lease=30, ttl=600)  # written as an earlier version did
    assert isinstance(claimed, Claimed) and await raw.complete(done, claimed.token, RESPONSE, ttl=600)
    held = await raw.claim(running, b"fp2", lease=30, ttl=600)
    assert isinstance(held, Claimed)
    await raw.forget_raw_keys()  # type: ignore[attr-defined]  # ... which recorded nothing about the form it used (0.1.0)

    assert await run([*args, "--json", "migrate"]) == 0
    out = capsys.readouterr().out
    assert '"keys_hashed":' in out and '"keys_hashed": 0' not in out, out

    for key in (done, running):
        kept = await at_rest(kind, hashed, key) if kind == "redis" else b""
        assert SECRET_KEY.encode() not in kept
    if kind == "postgres":
        conn = await asyncpg.connect(POSTGRES_DSN)
        try:
            table = hashed.table  # type: ignore[attr-defined]
            cells = await conn.fetch(f"SELECT scope, key FROM {table} WHERE namespace = $1", namespace)
        finally:
            await conn.close()
        assert all(SECRET_KEY not in c["key"] and c["scope"] == "" for c in cells) and len(cells) == 2
    # The app, now hashing, finds both: the completed one replays, the running one is still held.
    replay = await hashed.claim(done, b"fp", lease=30, ttl=600)
    assert isinstance(replay, Existing) and replay.record.response == RESPONSE
    busy = await hashed.claim(running, b"fp2", lease=30, ttl=600)
    assert isinstance(busy, Existing) and busy.record.token == held.token
    assert await hashed.complete(running, held.token, RESPONSE, ttl=600)  # its holder can still finish
    # Running migrate again changes nothing.
    assert await run([*args, "--json", "migrate"]) == 0
    assert '"keys_hashed": 0' in capsys.readouterr().out


async def test_plain_migrate_keeps_the_raw_keys_an_app_with_store_keys_looks_up(
    kind: str, stores: tuple[Backend, Backend, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`idem-asgi migrate` at a deploy, without `--store-keys`, rewrote the rows of a `store_keys=True`
    app to the digest form it does not look up: its next retry ran again. It now follows the store."""
    _, raw, args = stores
    key = RecordKey.build(f"t-{uuid.uuid4().hex}", SECRET_SCOPE, SECRET_KEY)
    claimed = await raw.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(claimed, Claimed) and await raw.complete(key, claimed.token, RESPONSE, ttl=600)
    assert await run([*args, "--json", "migrate"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["store_keys"], doc["keys_hashed"]) == (True, 0), doc
    assert SECRET_KEY.encode() in await at_rest(kind, raw, key)  # still raw, as the app keeps it
    replay = await raw.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(replay, Existing) and replay.record.response == RESPONSE


async def test_migrate_no_store_keys_hashes_them_once_those_workers_stopped(
    kind: str, stores: tuple[Backend, Backend, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """The way from `store_keys=True` to the default: stop those workers, `migrate --no-store-keys`, start
    the new ones; the new app finds every record (and a later plain migrate changes nothing)."""
    hashed, raw, args = stores
    key = RecordKey.build(f"t-{uuid.uuid4().hex}", SECRET_SCOPE, SECRET_KEY)
    claimed = await raw.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(claimed, Claimed) and await raw.complete(key, claimed.token, RESPONSE, ttl=600)
    assert await run([*args, "--json", "migrate", "--no-store-keys"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["store_keys"] is False and doc["keys_hashed"] == 1, doc
    assert await raw.raw_keys_recorded() is None  # type: ignore[attr-defined]
    assert SECRET_KEY.encode() not in await at_rest(kind, hashed, key)
    replay = await hashed.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(replay, Existing) and replay.record.response == RESPONSE


async def test_rewriting_stops_where_an_app_keeping_raw_keys_is_recorded(
    kind: str, stores: tuple[Backend, Backend, list[str]]
) -> None:
    """`hash_stored_keys()` itself (not only the CLI) rewrites nothing while such an app is recorded: an
    app starting during a `migrate` is never hidden from its own rows."""
    _, raw, _ = stores
    key = RecordKey.build(f"t-{uuid.uuid4().hex}", SECRET_SCOPE, SECRET_KEY)
    claimed = await raw.claim(key, b"fp", lease=30, ttl=600)  # records raw keys before writing
    assert isinstance(claimed, Claimed)
    assert await raw.hash_stored_keys() == (0, 0)  # type: ignore[attr-defined]
    assert SECRET_KEY.encode() in await at_rest(kind, raw, key)
    busy = await raw.claim(key, b"fp", lease=30, ttl=600)
    assert isinstance(busy, Existing) and busy.record.token == claimed.token


async def test_inspect_finds_a_record_in_either_form_unless_told(
    kind: str, stores: tuple[Backend, Backend, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """One table, an app of each kind (its record in its own form): `inspect` without a flag finds both."""
    hashed, raw, args = stores
    namespace = f"t-{uuid.uuid4().hex}"
    for store, name in ((raw, "kept-raw"), (hashed, "kept-hashed")):
        key = RecordKey.build(namespace, None, name)
        claimed = await store.claim(key, b"fp", lease=30, ttl=600)
        assert isinstance(claimed, Claimed) and await store.complete(key, claimed.token, RESPONSE, ttl=600)
    for name in ("kept-raw", "kept-hashed"):
        assert await run([*args, "--json", "inspect", name, "--namespace", namespace]) == 0, name
        assert json.loads(capsys.readouterr().out)["response"]["status"] == 201
