"""`idem-asgi migrate` is a deploy step that is safe at every deploy: run as its own process while an app
with `store_keys=True` serves under uvicorn (one payment completed, one in flight), with or without
`--store-keys`, it never changes how that app finds its records. Every retry afterwards replays, and
each handler ran once (a plain `migrate` rewrote the app's rows to the digest form it does not look
up: the retry charged again, and the payment in flight could not store its answer)."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from tests.support.asgi import read_body
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require, serving
from tests.support.stores import SHARED


class Shop:
    """POST /pay: counts runs per key; the key `held` waits for `gate` (a payment in flight)."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await read_body(receive)
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        self.runs[key] += 1
        if key == "held":
            self.entered.set()
            await self.gate.wait()
        body = json.dumps({"charge": f"ch_{uuid.uuid4().hex}", "key": key}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@dataclass
class Deployed:
    kind: str
    backend: Backend
    cli: list[str]  # the arguments that name the store to `idem-asgi`


@pytest.fixture(params=SHARED)
async def deployed(request: pytest.FixtureRequest) -> AsyncIterator[Deployed]:
    """An app's store that keeps raw keys (`store_keys=True`), on a table or prefix of its own."""
    kind = str(request.param)
    if kind == "redis":
        require("redis", REDIS_URL)
        prefix = f"idem-test:{uuid.uuid4().hex}:"
        async with RedisBackend.from_url(REDIS_URL, prefix=prefix, store_keys=True) as redis_backend:
            yield Deployed(kind, redis_backend, ["--backend", REDIS_URL, "--prefix", prefix])
        return
    require("postgres", POSTGRES_DSN)
    table = f"idem_live_{uuid.uuid4().hex[:12]}"
    try:
        async with PostgresBackend.from_dsn(POSTGRES_DSN, table=table, store_keys=True, min_size=1) as pg:
            yield Deployed(kind, pg, ["--backend", POSTGRES_DSN, "--table", table])
    finally:
        conn = await asyncpg.connect(POSTGRES_DSN)
        try:
            await conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        finally:
            await conn.close()


async def migrate(store: Deployed, *flags: str) -> dict[str, object]:
    """`python -m idem_asgi ... migrate` in a process of its own, as a deploy runs it."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "idem_asgi",
        *store.cli,
        "--json",
        "migrate",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    doc: dict[str, object] = json.loads(out)
    return doc


async def raw_names(store: Deployed, *keys: str) -> list[str]:
    """The raw keys the store keeps for the app's records (what the ops tools display)."""
    if store.kind == "redis":
        assert isinstance(store.backend, RedisBackend)
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            names = await client.keys(store.backend.prefix + "{*}")
            values = [await client.hget(name, "k") for name in names]
        finally:
            await client.aclose()
        return sorted(v.decode() if isinstance(v, bytes) else v for v in values if v)
    assert isinstance(store.backend, PostgresBackend)
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        rows = await conn.fetch(f"SELECT key FROM {store.backend.table} WHERE key = ANY($1::text[])", list(keys))
    finally:
        await conn.close()
    return sorted(row["key"] for row in rows)


@pytest.mark.parametrize("flags", [[], ["--store-keys"]], ids=["migrate", "migrate --store-keys"])
async def test_migrate_while_an_app_keeping_raw_keys_serves_changes_nothing_it_finds(
    deployed: Deployed, flags: list[str]
) -> None:
    shop = Shop()
    app = IdempotencyMiddleware(shop, backend=deployed.backend, routes=[RoutePolicy("/pay", single_tenant=True)])
    async with serving(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def pay(key: str) -> httpx.Response:
            return await client.post("/pay", json={"amount": 1230}, headers={"Idempotency-Key": key})

        paid = await pay("paid")
        assert paid.status_code == 201
        in_flight = asyncio.ensure_future(pay("held"))
        await asyncio.wait_for(shop.entered.wait(), 10)

        doc = await migrate(deployed, *flags)  # the deploy step, while the app serves
        assert doc["store_keys"] is True and doc["keys_hashed"] == 0, doc
        assert await raw_names(deployed, "paid", "held") == ["held", "paid"]  # kept as the app keeps them

        shop.gate.set()
        held = await asyncio.wait_for(in_flight, 10)
        assert held.status_code == 201
        for first, key in ((paid, "paid"), (held, "held")):
            retry = await pay(key)
            assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true", retry.text
            assert retry.content == first.content
    assert shop.runs == Counter({"paid": 1, "held": 1})
