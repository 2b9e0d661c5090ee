"""Two horizons per route: `replay_ttl` (how long an answer's bytes are replayed) under `ttl` (how long
its key refuses a second run). Past the first, the store keeps a tombstone (status, `Location`) and a
repeat gets 409 `response-expired` (or the current state); past the second the key is free. On memory,
Redis and Postgres, and across the boundary under a retry storm: each key runs once."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.records import Claimed, RecordKey, StoredResponse
from tests.support.servers import REDIS_URL

pytestmark = pytest.mark.asyncio
KEEP = 0.6  # replay_ttl: seconds an answer's bytes are replayed


class Shop:
    """POST /payments makes a payment (201 + Location) after `delay`; GET /payments/{id} shows it."""

    def __init__(self, delay: float = 0.0) -> None:
        self.runs: Counter[str] = Counter()
        self.payments: dict[str, dict[str, Any]] = {}
        self.delay = delay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] == "GET":
            payment = self.payments.get(scope["path"].rsplit("/", 1)[-1])
            status, out, headers = (200, json.dumps(payment).encode(), []) if payment else (404, b"{}", [])
        else:
            key = dict(scope["headers"])[b"idempotency-key"].decode()
            self.runs[key] += 1
            if self.delay:
                await asyncio.sleep(self.delay)
            pid = f"pay_{key}"
            self.payments[pid] = {"id": pid, "amount": json.loads(body or b"{}").get("amount"), "state": "pending"}
            status, out, headers = (
                201,
                json.dumps(self.payments[pid]).encode(),
                [(b"location", f"/payments/{pid}".encode())],
            )
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})


def protect(shop: Shop, store: Backend, namespace: str, **policy: Any) -> IdempotencyMiddleware:
    options = {"ttl": 60, "replay_ttl": KEEP, **policy}
    route = RoutePolicy("/payments", single_tenant=True, **options)
    return IdempotencyMiddleware(shop, backend=store, routes=[route], namespace=namespace)


async def pay(app: Any, key: str, amount: int = 10) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop.test") as client:
        return await client.post("/payments", json={"amount": amount}, headers={"idempotency-key": key})


async def shrink(store: Backend) -> None:
    """What the deployment runs anyway: Postgres's purge (its shrink rides along); memory and Redis
    shrink on their own (at the next claim's bound check, by Redis expiry)."""
    if isinstance(store, PostgresBackend | MemoryBackend):
        await store.purge()


async def test_past_replay_ttl_a_repeat_gets_response_expired_and_the_app_never_runs_again(
    backend: Backend, namespace: str
) -> None:
    shop = Shop()
    app = protect(shop, backend, namespace)
    key = uuid.uuid4().hex
    first = await pay(app, key)
    again = await pay(app, key)
    assert (again.status_code, again.content, again.headers["idempotent-replayed"]) == (201, first.content, "true")
    await asyncio.sleep(KEEP + 0.2)
    for shrunk in (False, True):  # before the store shrank the record (its time is enough), and after
        if shrunk:
            await shrink(backend)
        late = await pay(app, key)
        assert late.status_code == 409 and late.headers["content-type"] == "application/problem+json"
        problem = late.json()
        assert problem["type"].endswith("response-expired") and problem["status"] == 409
        assert problem["completed_status"] == 201
        completed = time.mktime(time.strptime(problem["completed_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
        assert abs(completed - time.time()) < 30
        assert problem["expires_at"] > problem["completed_at"]
        assert late.headers["location"] == f"/payments/pay_{key}", "what it made is named"
        assert "idempotent-replayed" not in late.headers
    other = await pay(app, key, amount=99)
    assert (other.status_code, other.json()["type"].split(":")[-1]) == (422, "fingerprint-mismatch")
    assert shop.runs[key] == 1


async def test_the_record_shrinks_to_its_tombstone_and_the_key_frees_at_ttl(backend: Backend, namespace: str) -> None:
    """After replay_ttl the store holds status and Location only; after ttl, nothing (the key runs again)."""
    shop = Shop()
    app = protect(shop, backend, namespace, ttl=2.5, replay_ttl=0.5, lease=2)
    key = uuid.uuid4().hex
    await pay(app, key)
    rkey = RecordKey.build(namespace, None, key)
    before = await backend.get(rkey)
    assert before is not None and before.response is not None and len(before.response.body) > 20
    await asyncio.sleep(0.7)
    if isinstance(backend, MemoryBackend):
        held = backend.stored_bytes
        await pay(app, uuid.uuid4().hex)  # a claim checks the bounds, and shrinks what is due
        assert backend.stored_bytes <= held, "the new answer's bytes replaced the shrunk one's"
    await shrink(backend)
    after = await backend.get(rkey)
    assert after is not None and after.response is not None
    tomb = after.response
    assert tomb.tombstone and tomb.body == b"" and not tomb.replayable and tomb.status == 201
    assert tomb.headers == [(b"location", f"/payments/pay_{key}".encode())]
    assert after.fingerprint == before.fingerprint and after.expires_at == pytest.approx(before.expires_at, abs=0.01)
    if isinstance(backend, RedisBackend):
        record, tombstone = backend._keys(rkey)
        client = aioredis.from_url(REDIS_URL)
        try:
            assert await client.exists(record) == 0, "the answer's bytes went with the record hash"
            assert 0 < await client.pttl(tombstone) <= 2500
            assert (await client.memory_usage(tombstone) or 0) < 400
        finally:
            await client.aclose()
    await asyncio.sleep(2.5 - 0.7 + 0.3)
    assert await backend.get(rkey) is None
    again = await pay(app, key)
    assert again.status_code == 201 and "idempotent-replayed" not in again.headers
    assert shop.runs[key] == 2, "after ttl the key is free: the tombstone never outlives it"


async def test_a_retry_storm_across_the_boundary_runs_each_key_once(backend: Backend, namespace: str) -> None:
    """30 keys, each retried in waves from before its first answer until well after its replay_ttl,
    the store shrinking meanwhile: one run per key; every answer a 201, a replay, a 409 while it runs
    or response-expired after; never a 5xx."""
    shop = Shop(delay=0.05)
    app = protect(shop, backend, namespace, replay_ttl=0.4)
    keys = [uuid.uuid4().hex for _ in range(30)]
    seen: Counter[str] = Counter()
    stop = time.monotonic() + 1.2

    async def waves(key: str) -> None:
        while time.monotonic() < stop:
            answers = await asyncio.gather(*(pay(app, key) for _ in range(4)))
            for a in answers:
                kind = a.json().get("type", "").split(":")[-1] if a.status_code == 409 else ""
                seen["replay" if a.headers.get("idempotent-replayed") else f"{a.status_code} {kind}".strip()] += 1
            await asyncio.sleep(0.05)

    async def shrinking() -> None:
        while time.monotonic() < stop:
            await shrink(backend)
            await asyncio.sleep(0.1)

    await asyncio.gather(*(waves(k) for k in keys), shrinking())
    assert shop.runs == Counter(dict.fromkeys(keys, 1))
    assert set(seen) <= {"201", "replay", "409 request-in-progress", "409 response-expired"}, seen
    assert seen["201"] == 30 and seen["replay"] > 0 and seen["409 response-expired"] > 0, seen


async def test_past_replay_ttl_a_current_state_route_answers_what_the_payment_is_now(
    backend: Backend, namespace: str
) -> None:
    shop = Shop()
    app = protect(shop, backend, namespace, replay="current")
    key = uuid.uuid4().hex
    await pay(app, key)
    shop.payments[f"pay_{key}"]["state"] = "captured"
    await asyncio.sleep(KEEP + 0.2)
    await shrink(backend)
    late = await pay(app, key)
    assert late.status_code == 201 and late.json()["state"] == "captured"
    assert late.headers["idempotent-replay-source"] == "current"
    assert late.headers["location"] == f"/payments/pay_{key}" == late.headers["content-location"]
    del shop.payments[f"pay_{key}"]  # gone: no stored bytes to fall back on past replay_ttl
    gone = await pay(app, key)
    assert gone.status_code == 409 and gone.json()["type"].endswith("response-expired")
    assert shop.runs[key] == 1


async def test_replay_ttl_must_fit_under_ttl() -> None:
    with pytest.raises(ConfigurationError, match=r"replay_ttl \(120.0s\) must be at most ttl \(60.0s\)"):
        IdempotencyMiddleware(Shop(), routes=[RoutePolicy("/p", single_tenant=True, ttl=60, replay_ttl=120)])
    with pytest.raises(ConfigurationError, match="durations must be positive"):
        IdempotencyMiddleware(Shop(), routes=[RoutePolicy("/p", single_tenant=True, replay_ttl=0)])


async def test_the_horizon_is_advertised_counted_and_shown_as_a_tombstone(namespace: str) -> None:
    """`advertise_expiry` names the end of the replay (not of the key); a repeat past it emits
    `answer_expired` (not `replayed`); `inspect` calls the shrunk record a tombstone."""
    from idem_asgi.observe import Event
    from idem_asgi.ops.cli_output import response_doc

    events: list[Event] = []
    store = MemoryBackend()
    shop = Shop()
    route = RoutePolicy("/payments", single_tenant=True, ttl=60, replay_ttl=KEEP, advertise_expiry=True)
    app = IdempotencyMiddleware(shop, backend=store, routes=[route], namespace=namespace, observer=events.append)
    key = uuid.uuid4().hex
    first = await pay(app, key)
    advertised = time.mktime(time.strptime(first.headers["idempotency-expires"], "%a, %d %b %Y %H:%M:%S GMT"))
    assert abs(advertised - time.timezone - time.time()) < 5, "the replay's end, not the key's (60 s)"
    again = await pay(app, key)
    assert again.headers["idempotency-expires"] == first.headers["idempotency-expires"]
    await asyncio.sleep(KEEP + 0.2)
    late = await pay(app, key)
    assert late.status_code == 409 and "idempotency-expires" not in late.headers
    assert [e.name for e in events if e.name in ("replayed", "answer_expired")] == ["replayed", "answer_expired"]
    await store.purge()
    record = await store.get(RecordKey.build(namespace, None, key))
    assert record is not None and record.response is not None
    assert response_doc(record.response)["tombstone"] is True


async def test_an_answer_too_large_to_store_stays_not_stored_on_every_store(backend: Backend, namespace: str) -> None:
    """Nothing to shrink: past replay_ttl it is still 409 response-not-stored, alike on each store."""
    shop = Shop()
    app = protect(shop, backend, namespace, max_stored_body=10)
    key = uuid.uuid4().hex
    assert (await pay(app, key)).status_code == 201
    await asyncio.sleep(KEEP + 0.2)
    await shrink(backend)
    late = await pay(app, key)
    assert late.status_code == 409 and late.json()["type"].endswith("response-not-stored")
    assert shop.runs[key] == 1


async def test_postgres_a_row_reused_after_its_ttl_forgets_its_old_horizon(namespace: str) -> None:
    """A key claimed again after its ttl reuses its row: the old answer's `kept_until` goes with it, so
    purge's shrink never picks (and locks) a live claim, nor spends its batches on one."""
    import asyncpg

    from tests.support.servers import POSTGRES_DSN, require
    from tests.support.stores import TEST_TABLE

    require("postgres", POSTGRES_DSN)
    store = PostgresBackend.from_dsn(POSTGRES_DSN, table=TEST_TABLE)
    await store.setup()
    conn = await asyncpg.connect(POSTGRES_DSN)
    answer = StoredResponse(201, [(b"location", b"/p/1")], b'{"ok":true}', replay_for=0.2)
    a, b = RecordKey.build(namespace, None, "a"), RecordKey.build(namespace, None, "b")
    try:
        first = await store.claim(a, b"fp", lease=0.3, ttl=0.5)
        assert isinstance(first, Claimed) and await store.complete(a, first.token, answer, ttl=0.5)
        await asyncio.sleep(0.6)  # a's ttl is over: its row is free
        again = await store.claim(a, b"fp", lease=30, ttl=60)
        assert isinstance(again, Claimed)
        kept = await conn.fetchval(f"SELECT kept_until FROM {store.table} WHERE namespace = $1", namespace)
        assert kept is None, "the reused row kept the old answer's horizon"
        other = await store.claim(b, b"fp", lease=30, ttl=60)
        assert isinstance(other, Claimed) and await store.complete(b, other.token, answer, ttl=60)
        await asyncio.sleep(0.3)
        await store.purge(batch_size=1)
        shrunk = await store.get(b)
        assert shrunk is not None and shrunk.response is not None and shrunk.response.tombstone
        live = await store.get(a)
        assert live is not None and live.state == "in_progress" and live.token == again.token
    finally:
        await conn.execute(f"DELETE FROM {store.table} WHERE namespace = $1", namespace)
        await conn.close()
        await store.aclose()


async def test_a_sealed_answer_keeps_its_clear_location_past_the_horizon(backend: Backend, namespace: str) -> None:
    """With `EncryptBody(..., headers=False)` the headers are stored in clear: past replay_ttl the
    tombstone keeps `Location`, so a current-state route still fetches what the payment is now;
    with `headers=True` nothing readable is left to keep, and the repeat gets response-expired."""
    from idem_asgi.transform import EncryptBody

    def flip(data: bytes) -> bytes:
        return bytes(b ^ 0x5A for b in data)

    for sealed_headers in (False, True):
        shop = Shop()
        route = RoutePolicy("/payments", single_tenant=True, ttl=60, replay_ttl=KEEP, replay="current")
        app = IdempotencyMiddleware(
            shop, backend=backend, routes=[route], namespace=f"{namespace}-{sealed_headers}",
            transform=EncryptBody(flip, flip, headers=sealed_headers),
        )  # fmt: skip
        key = uuid.uuid4().hex
        await pay(app, key)
        shop.payments[f"pay_{key}"]["state"] = "captured"
        await asyncio.sleep(KEEP + 0.2)
        await shrink(backend)
        late = await pay(app, key)
        if sealed_headers:
            assert late.status_code == 409 and late.json()["type"].endswith("response-expired")
        else:
            assert late.status_code == 201 and late.json()["state"] == "captured"
            assert late.headers["idempotent-replay-source"] == "current"
        assert shop.runs[key] == 1
