"""Checkpoints: a handler records how far it got, and recovery reads it after the worker dies."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy, StoredResponse
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.claims.leases import grace
from idem_asgi.errors import ClaimLost
from idem_asgi.records import Claimed, Record, RecordKey
from tests.support.pgbouncer import pgbouncer
from tests.support.stores import TEST_TABLE, make_backend

pytestmark = pytest.mark.postgres


@pytest.fixture(scope="module")
def bouncer() -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the test database, for this module."""
    with pgbouncer("transaction") as dsn:
        yield dsn


@pytest.fixture(params=["direct", "pgbouncer"])
async def pg(request: pytest.FixtureRequest) -> AsyncIterator[PostgresBackend]:
    """The test database, directly and through a transaction pooler (the plain URL either way)."""
    if request.param == "direct":
        backend = await make_backend("postgres", pool=4)
    else:
        backend = PostgresBackend.from_dsn(request.getfixturevalue("bouncer"), table=TEST_TABLE, max_size=4)
        await backend.setup()
    try:
        yield backend
    finally:
        await backend.aclose()


async def test_checkpoint_is_stored_on_the_claim_and_fenced(pg: PostgresBackend) -> None:
    key = RecordKey.build(f"t-{uuid.uuid4().hex}", None, "k")
    claimed = await pg.claim(key, b"fp", lease=30, ttl=60)
    assert isinstance(claimed, Claimed)
    await pg.checkpoint("charged ch_1", key=key, token=claimed.token)
    record = await pg.get(key)
    assert record is not None and record.checkpoint == "charged ch_1"
    with pytest.raises(ClaimLost):
        await pg.checkpoint("forged", key=key, token=claimed.token + 1)


async def test_recover_hook_sees_the_dead_handlers_checkpoint(pg: PostgresBackend) -> None:
    namespace = f"t-{uuid.uuid4().hex}"
    charges: list[str] = []
    seen: list[str | None] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        charges.append("ch_1")
        await pg.checkpoint("charged ch_1")  # the provider answered; then the worker dies
        await asyncio.sleep(30)

    async def recover(key: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
        seen.append(record.checkpoint)
        if record.checkpoint == "charged ch_1":  # ask the provider by this reference: it succeeded
            return StoredResponse(201, [(b"content-type", b"application/json")], b'{"charge":"ch_1"}')
        return "run"

    mw = IdempotencyMiddleware(
        app,
        backend=pg,
        namespace=namespace,
        routes=[RoutePolicy("/pay", lease=0.3, single_tenant=True, recover=recover)],
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t")
    async with client:
        first = asyncio.ensure_future(client.post("/pay", content=b"{}", headers={"Idempotency-Key": "k"}))
        for _ in range(100):
            if charges:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        first.cancel()  # the worker dies mid-request: the claim stays, its lease runs out
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.6)
        # The expired lease is first answered in progress (its holder might be alive, about to
        # renew); seen unchanged after its grace, it is recovered.
        retry: Any = await client.post("/pay", content=b"{}", headers={"Idempotency-Key": "k"})
        assert retry.status_code == 409 and seen == []
        await asyncio.sleep(grace(0.3))
        retry = await client.post("/pay", content=b"{}", headers={"Idempotency-Key": "k"})
    assert seen == ["charged ch_1"]
    assert retry.status_code == 201 and retry.content == b'{"charge":"ch_1"}'
    assert retry.headers["idempotent-replayed"] == "true"
    assert charges == ["ch_1"]  # recovered from the checkpoint, never charged twice
