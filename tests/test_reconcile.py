"""The reconcile runner on every store: a stuck claim (its holder killed mid-request, lease over)
is resolved from outside the request path, and every write is fenced by the token it listed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

import pytest

from idem_asgi.backends import Backend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.context import held_claim
from idem_asgi.http import problems
from idem_asgi.ops.reconcile import (
    ReconcilableBackend,
    ReconcileItem,
    ReconcileReport,
    Resolution,
    is_dry_run,
    key_among,
    reconcile,
    resolver_from_recover,
)
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, Record, RecordKey, StaleRecord, StoredResponse
from tests.support.asgi import drive, http_scope
from tests.support.charges import BODY, KEY, LEASE, Payments, crash_first_request, post, protect, rk
from tests.support.problems import assert_problem
from tests.support.servers import RedisProcess
from tests.support.stores import BACKENDS, make_backend

DAY = 86_400.0
FOUND = StoredResponse(
    201,
    [(b"content-type", b"application/json"), (b"x-provider", b"acme"), (b"x-b", b"2"), (b"x-b", b"1")],
    b'{"charge":"ch_from_provider","amount":1230}' + bytes(range(256)),
)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Every store, keeping raw keys (`store_keys=True`): these resolvers look records up by their
    key, as one asking the payment provider by the forwarded key does."""
    b = await make_backend(request.param, store_keys=True)
    try:
        yield b
    finally:
        await b.aclose()


def store(backend: Backend) -> ReconcilableBackend:
    assert isinstance(backend, Backend)
    return backend  # type: ignore[return-value]  # every built-in backend has the Maintenance half


def counts(report: ReconcileReport) -> tuple[int, int, int, int, int, int]:
    r = report
    return (r.examined, r.completed, r.released, r.unresolved, r.skipped, r.errors)


async def stuck(backend: Backend, namespace: str) -> Payments:
    """A payment whose worker was killed mid-request: its claim is in progress, its lease over."""
    app = Payments(hang_first=True)
    await crash_first_request(protect(app, backend, namespace, lease=LEASE), app)
    return app


async def stuck_claim(backend: Backend, namespace: str) -> int:
    """The same, straight at the store (for tests that send no request afterwards): a shorter wait."""
    claimed = await backend.claim(rk(namespace), b"fp", lease=0.05, ttl=DAY)
    assert isinstance(claimed, Claimed)
    await asyncio.sleep(0.12)
    return claimed.token


async def test_resolved_answer_is_stored_and_replayed_byte_for_byte(backend: Backend, namespace: str) -> None:
    app = await stuck(backend, namespace)
    mw = protect(app, backend, namespace, lease=LEASE)
    assert_problem(await post(mw), problems.OUTCOME_UNKNOWN)
    dead = await backend.get(rk(namespace))
    asked: list[StaleRecord] = []

    async def resolve(s: StaleRecord) -> StoredResponse:
        asked.append(s)
        return FOUND  # the provider has a charge under this key: this is its answer

    report = await reconcile(store(backend), resolve, older_than=0, namespace=namespace, ttl=600)

    assert counts(report) == (1, 1, 0, 0, 0, 0)
    assert [(s.key, s.record) for s in asked] == [(rk(namespace), dead)]
    [item] = report.items
    assert (item.namespace, item.scope, item.key, item.action) == (namespace, "", KEY, "completed")
    replay = await drive(mw, http_scope(key=KEY), [BODY])
    assert replay.status == 201
    assert replay.headers == [*FOUND.headers, (b"idempotent-replayed", b"true")]
    assert replay.body == FOUND.body
    assert app.calls == 1  # never run again
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == COMPLETED and record.fingerprint == dead.fingerprint  # type: ignore[union-attr]
    assert await store(backend).stale(0, namespace=namespace) == []


async def test_release_lets_the_retry_run(backend: Backend, namespace: str) -> None:
    app = await stuck(backend, namespace)
    mw = protect(app, backend, namespace, lease=LEASE)

    report = await reconcile(store(backend), lambda s: "release", older_than=0, namespace=namespace)

    assert counts(report) == (1, 0, 1, 0, 0, 0)
    assert await backend.get(rk(namespace)) is None
    retry = await post(mw)
    assert retry.status_code == 201 and app.calls == 2
    assert (await post(mw)).headers["idempotent-replayed"] == "true"
    assert app.calls == 2


async def test_unknown_outcome_leaves_the_claim_blocked(backend: Backend, namespace: str) -> None:
    app = await stuck(backend, namespace)
    mw = protect(app, backend, namespace, lease=LEASE)
    before = await backend.get(rk(namespace))

    report = await reconcile(store(backend), lambda s: None, older_than=0, namespace=namespace)

    assert counts(report) == (1, 0, 0, 1, 0, 0)
    assert await backend.get(rk(namespace)) == before
    assert_problem(await post(mw), problems.OUTCOME_UNKNOWN)
    assert app.calls == 1


async def test_a_claim_completed_by_its_live_holder_meanwhile_is_skipped(backend: Backend, namespace: str) -> None:
    app = await stuck(backend, namespace)
    mw = protect(app, backend, namespace, lease=LEASE)
    holders = StoredResponse(201, [(b"content-type", b"application/json")], b'{"charge":1,"from":"holder"}')

    async def resolve(s: StaleRecord) -> StoredResponse:
        # While the provider is being asked, the slow holder wakes up and stores its own answer.
        assert await backend.complete(s.key, s.record.token, holders, ttl=600)
        return FOUND

    report = await reconcile(store(backend), resolve, older_than=0, namespace=namespace)

    assert counts(report) == (1, 0, 0, 0, 1, 0)
    assert report.items[0].detail == "changed since it was listed"
    replay = await post(mw)
    assert replay.content == holders.body and replay.headers["idempotent-replayed"] == "true"


async def test_a_holder_that_renewed_its_lease_meanwhile_is_not_released(backend: Backend, namespace: str) -> None:
    """A release is fenced by the lease too (takeover first): a revived holder keeps its claim."""
    token = await stuck_claim(backend, namespace)

    async def resolve(s: StaleRecord) -> Literal["release"]:
        assert await backend.extend(s.key, s.record.token, lease=30)  # the holder was only paused
        return "release"

    report = await reconcile(store(backend), resolve, older_than=0, namespace=namespace)

    assert counts(report) == (1, 0, 0, 0, 1, 0)
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == IN_PROGRESS and record.token == token


async def test_a_resolver_that_raises_is_counted_and_the_run_goes_on(backend: Backend, namespace: str) -> None:
    keys = [RecordKey.build(namespace, "tenant-1", f"k{i}") for i in range(4)]
    for i, key in enumerate(keys):
        assert isinstance(await backend.claim(key, b"fp", lease=0.05 * (i + 1), ttl=DAY), Claimed)
    await asyncio.sleep(0.35)

    def resolve(s: StaleRecord) -> Resolution:  # a plain function works too
        if s.key.key == "k1":
            raise RuntimeError("provider timed out")
        if s.key.key == "k2":
            return "complete it, please"  # type: ignore[return-value]  # not a valid answer, on purpose
        return "release"

    report = await reconcile(store(backend), resolve, older_than=0, namespace=namespace, concurrency=3)

    assert counts(report) == (4, 0, 2, 0, 0, 2)
    assert [i.key for i in report.items] == ["k0", "k1", "k2", "k3"]  # oldest lease first
    assert report.items[1].detail == "resolve raised RuntimeError: provider timed out"
    assert [await backend.get(k) is None for k in keys] == [True, False, False, True]


async def test_dry_run_asks_but_writes_nothing(backend: Backend, namespace: str) -> None:
    await stuck_claim(backend, namespace)
    before = await backend.get(rk(namespace))

    report = await reconcile(store(backend), lambda s: FOUND, older_than=0, namespace=namespace, dry_run=True)

    assert report.dry_run and counts(report) == (1, 1, 0, 0, 0, 0)
    assert report.items[0].detail == "dry run: would store a 201 answer"
    assert await backend.get(rk(namespace)) == before


async def test_a_dry_run_tells_the_resolver_it_is_one(backend: Backend, namespace: str) -> None:
    await stuck_claim(backend, namespace)
    told: list[bool] = []

    async def resolve(stale: StaleRecord) -> Resolution:
        told.append(is_dry_run())
        return FOUND

    await reconcile(store(backend), resolve, older_than=0, namespace=namespace, dry_run=True)
    assert told == [True] and not is_dry_run()  # told inside the run only
    await reconcile(store(backend), resolve, older_than=0, namespace=namespace)
    assert told == [True, False]


async def test_a_resolver_finds_a_digest_only_claim_by_its_key_among_candidates(
    backend: Backend, namespace: str
) -> None:
    key = RecordKey.build(namespace, "tenant-42", "pay-7f3a")
    assert isinstance(await backend.claim(key, b"fp", lease=0.05, ttl=DAY), Claimed)
    await asyncio.sleep(0.12)
    (listed,) = await store(backend).stale(0, 10, namespace=namespace)
    found: list[tuple[str, str] | None] = []

    async def resolve(stale: StaleRecord) -> Resolution:
        found.append(key_among(stale, [("tenant-1", "pay-7f3a"), (None, "pay-7f3a"), ("tenant-42", "pay-7f3a")]))
        return FOUND if found[-1] == ("tenant-42", "pay-7f3a") else None

    report = await reconcile(store(backend), resolve, older_than=0, namespace=namespace)
    assert found == [("tenant-42", "pay-7f3a")] and counts(report) == (1, 1, 0, 0, 0, 0)
    if listed.key.hidden:  # the default on Redis and Postgres: only the digest is stored
        assert (listed.key.scope, listed.key.key) == ("?", "?")
        assert key_among(listed, [("tenant-42", "pay-other")]) is None
    else:  # the memory store keeps the key itself
        assert key_among(listed, []) == ("tenant-42", "pay-7f3a")
    record = await backend.get(key)
    assert record is not None and record.state == COMPLETED


def test_reconcile_prints_a_digest_only_claim_as_stale_does() -> None:
    from idem_asgi.ops.cli_output import item_label, key_label

    key = RecordKey.hashed("idem", RecordKey.build("idem", "t", "k").digest)
    item = ReconcileItem(key.namespace, key.scope, key.key, 1, 0.0, "completed", "", key.digest)
    assert item_label(item) == key_label(key) == f"idem / sha256:{key.digest[:16]}"  # not "? / ?"


async def test_older_than_spares_recently_expired_leases(backend: Backend, namespace: str) -> None:
    await stuck_claim(backend, namespace)
    report = await reconcile(store(backend), lambda s: "release", older_than=60, namespace=namespace)
    assert counts(report) == (0, 0, 0, 0, 0, 0)
    assert await backend.get(rk(namespace)) is not None


@pytest.mark.memory
async def test_a_middleware_recover_hook_serves_as_resolver(namespace: str) -> None:
    backend = await make_backend("memory")
    app = await stuck(backend, namespace)

    async def recover(key: RecordKey, record: Record) -> Literal["run"]:
        return "run"  # the provider never saw the key

    report = await reconcile(store(backend), resolver_from_recover(recover), older_than=0)

    assert counts(report) == (1, 0, 1, 0, 0, 0)
    assert (await post(protect(app, backend, namespace, lease=LEASE))).status_code == 201


# --- store-specific paths --------------------------------------------------------------------


@pytest.fixture
async def pg() -> AsyncIterator[Backend]:
    b = await make_backend("postgres", store_keys=True)
    try:
        yield b
    finally:
        await b.aclose()


@pytest.mark.postgres
async def test_postgres_committed_effect_is_completed_under_its_token_never_released(
    pg: Backend, namespace: str
) -> None:
    from idem_asgi.backends.postgres import PostgresBackend

    assert isinstance(pg, PostgresBackend)
    committed = [RecordKey.build(namespace, None, name) for name in ("answer", "release")]
    for key in committed:
        claimed = await pg.claim(key, b"fp", lease=0.1, ttl=DAY)
        assert isinstance(claimed, Claimed)
        with held_claim(pg, key, claimed.token):
            async with pg.transaction():  # the handler's writes committed with the claim's mark
                pass
    await asyncio.sleep(0.25)

    report = await reconcile(
        pg, lambda s: FOUND if s.key.key == "answer" else "release", older_than=0, namespace=namespace
    )

    assert counts(report) == (2, 1, 0, 0, 1, 0)
    assert {i.key: i.action for i in report.items} == {"answer": "completed", "release": "skipped"}
    done = await pg.get(committed[0])
    assert done is not None and done.state == COMPLETED and done.response == FOUND
    kept = await pg.get(committed[1])
    assert kept is not None and kept.state == IN_PROGRESS  # a retry must never run it again


@pytest.fixture
async def redis_backend() -> AsyncIterator[RedisBackend]:
    b = await make_backend("redis", store_keys=True)
    try:
        yield b
    finally:
        await b.aclose()


@pytest.mark.redis
async def test_redis_record_written_before_names_were_stored_is_listed_as_unknown(
    redis_backend: RedisBackend, namespace: str
) -> None:
    legacy = RecordKey.build(namespace, None, "from-an-older-release")
    seconds, micros = await redis_backend.client.time()
    now_ms = seconds * 1000 + micros // 1000
    name = redis_backend._key(legacy)
    await redis_backend.client.hset(
        name, mapping={"s": "p", "f": b"fp", "t": 42, "l": now_ms - 5_000, "e": now_ms + 60_000}
    )
    await redis_backend.client.pexpire(name, 60_000)
    foreign = [redis_backend.prefix + "not-a-record", redis_backend.prefix + "{" + "0" * 64 + "}"]
    for other in foreign:
        await redis_backend.client.set(other, b"x", ex=60)  # not record hashes: ignored

    [s] = await redis_backend.stale(0)
    assert (s.key.namespace, s.key.scope, s.key.key, s.key.digest) == ("?", "?", "?", legacy.digest)
    assert s.record.token == 42 and s.record.fingerprint == b"fp"
    assert await redis_backend.stale(0, namespace=namespace) == []
    # Still resolvable: the Redis key is the digest alone.
    report = await reconcile(redis_backend, lambda s: "release", older_than=0)
    assert counts(report) == (1, 0, 1, 0, 0, 0)
    assert await redis_backend.get(legacy) is None
    await redis_backend.client.delete(*foreign)


@pytest.mark.redis
async def test_redis_stale_pages_through_scan_batches(redis_backend: RedisBackend, namespace: str) -> None:
    keys = [RecordKey.build(namespace, "t", f"k{i}") for i in range(30)]
    for key in keys:
        assert isinstance(await redis_backend.claim(key, b"fp", lease=0.05, ttl=60), Claimed)
    live = RecordKey.build(namespace, "t", "live")
    assert isinstance(await redis_backend.claim(live, b"fp", lease=30, ttl=60), Claimed)
    await asyncio.sleep(0.2)
    found = await redis_backend.stale(0, scan_count=4)
    assert sorted(s.key.key for s in found) == sorted(k.key for k in keys)
    assert len(await redis_backend.stale(0, 7, scan_count=4)) == 7
    assert [s.record.lease_until for s in found] == sorted(s.record.lease_until for s in found)


@pytest.mark.redis
async def test_redis_cluster_stale_scans_every_primary(cluster: list[RedisProcess], namespace: str) -> None:
    backend = RedisBackend.from_url(cluster[0].url, cluster=True, prefix=f"idem-test:{uuid.uuid4().hex}:", timeout=10)
    try:
        keys = [RecordKey.build(namespace, "tenant", f"k{i}") for i in range(24)]
        for key in keys:
            assert isinstance(await backend.claim(key, b"fp", lease=0.05, ttl=60), Claimed)
        await asyncio.sleep(0.2)
        started = time.monotonic()
        found = await backend.stale(0, scan_count=5)
        assert time.monotonic() - started < 5
        assert sorted(s.key.digest for s in found) == sorted(k.digest for k in keys)
        assert all(s.key.hidden for s in found)  # the default keeps digests only
        report = await reconcile(backend, lambda s: "release", older_than=0, concurrency=4)
        assert counts(report) == (24, 0, 24, 0, 0, 0)
        assert await backend.stale(0) == []
    finally:
        await backend.aclose()
