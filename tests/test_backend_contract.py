"""The backend contract: the same tests, unchanged, on every store: memory, Redis through the lean
pool `from_url` builds, Redis through a plain redis-py client handed in, a three-primary Redis
Cluster, and Postgres (directly, and with the plain URL through a transaction-mode PgBouncer).

A plain client a user hands in takes the lean pool too (`redis-client`); one the lean pool cannot
serve (here: a client name) keeps redis-py for every call (`redis-py`), as a Cluster does."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from idem_asgi.backends import Backend, Maintenance
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.claims.decide import Action, decide
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, Existing, RecordKey, StaleRecord, StoredResponse
from tests.support.pgbouncer import pgbouncer
from tests.support.servers import REDIS_URL, redis_cluster, redis_sentinel, require
from tests.support.stores import BACKENDS, TEST_TABLE, make_backend

DAY = 86_400.0
STORES = [
    *BACKENDS,
    pytest.param("redis-client", marks=pytest.mark.redis),
    pytest.param("redis-py", marks=pytest.mark.redis),
    pytest.param("redis-cluster", marks=pytest.mark.redis),
    pytest.param("redis-sentinel", marks=pytest.mark.redis),  # durable claims, through Sentinel (redis-py)
    pytest.param("redis-durable", marks=pytest.mark.redis),  # durable claims, lean pool on the primary
    pytest.param("redis-cluster-durable", marks=pytest.mark.redis),  # durable claims per shard
    pytest.param("postgres-pgbouncer", marks=pytest.mark.postgres),  # the plain URL, through a transaction pooler
]


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A three-primary Redis Cluster for this module (its own redis-server processes)."""
    with redis_cluster(tmp_path_factory.mktemp("contract-cluster")) as nodes:
        yield nodes[0].url


@pytest.fixture(scope="module")
def replicated_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis Cluster of three primaries with one replica each, for this module."""
    with redis_cluster(tmp_path_factory.mktemp("contract-cluster-replicas"), replicas=1) as nodes:
        yield nodes[0].url


@pytest.fixture(scope="module")
def sentinel_topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(redis+sentinel:// URL, the primary's redis:// URL) of a primary with two replicas and
    three sentinels for this module."""
    with redis_sentinel(tmp_path_factory.mktemp("contract-sentinel")) as (primary, _, sentinels):
        yield "redis+sentinel://" + ",".join(s.address for s in sentinels) + "/mymaster/0", primary.url


@pytest.fixture(scope="module")
def pgbouncer_dsn() -> Iterator[str]:
    """A PgBouncer in `pool_mode = transaction` in front of the test database, for this module."""
    with pgbouncer("transaction") as dsn:
        yield dsn


@pytest.fixture(params=STORES)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    prefix = f"idem-test:{uuid.uuid4().hex}:"
    client = None
    if request.param in ("redis-client", "redis-py"):
        # The user's own client: a plain one gets the lean pool on its address; one with a client
        # name (like TLS or RESP3) keeps redis-py serving every call.
        require("redis", REDIS_URL)
        name = "contract" if request.param == "redis-py" else None
        client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5, client_name=name)
        redis_store = RedisBackend(client, prefix=prefix)
        assert (redis_store._lean is None) == (name is not None)
        store: Backend = redis_store
    elif request.param == "redis-cluster":
        store = RedisBackend.from_url(request.getfixturevalue("cluster_url"), cluster=True, prefix=prefix)
    elif request.param == "redis-cluster-durable":
        url = request.getfixturevalue("replicated_cluster_url")
        store = RedisBackend.from_url(url, cluster=True, prefix=prefix, durable_replicas=1)
    elif request.param in ("redis-sentinel", "redis-durable"):
        sentinel_url, primary_url = request.getfixturevalue("sentinel_topology")
        url = sentinel_url if request.param == "redis-sentinel" else primary_url
        redis_store = RedisBackend.from_url(url, prefix=prefix, durable_replicas=2)
        assert (redis_store._lean is None) == (request.param == "redis-sentinel")
        store = redis_store
    elif request.param == "postgres-pgbouncer":
        pg = PostgresBackend.from_dsn(request.getfixturevalue("pgbouncer_dsn"), table=TEST_TABLE, max_size=20)
        await pg.setup()
        store = pg
    else:
        store = await make_backend(request.param, prefix=prefix)
    try:
        yield store
    finally:
        await store.aclose()
        if client is not None:
            await client.aclose()


RESPONSE = StoredResponse(
    201,
    [(b"content-type", b"application/json"), (b"x-b", b"2"), (b"x-a", b"1"), (b"x-b", b"3")],
    bytes(range(256)) * 4,
)


def k(namespace: str, key: str = "key-1", scope: str | None = None) -> RecordKey:
    return RecordKey.build(namespace, scope, key)


async def test_first_claim_owns_the_key(backend: Backend, namespace: str) -> None:
    result = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(result, Claimed)
    assert result.token > 0


async def test_second_claim_reads_the_in_progress_record(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    second = await backend.claim(k(namespace), b"other", lease=30, ttl=DAY)
    assert isinstance(first, Claimed) and isinstance(second, Existing)
    rec = second.record
    assert (rec.state, rec.fingerprint, rec.token, rec.response) == (IN_PROGRESS, b"fp", first.token, None)
    assert 29 < rec.lease_until - second.now <= 30.5
    assert DAY - 5 < rec.expires_at - second.now <= DAY + 1


async def test_completed_record_returns_response_verbatim(backend: Backend, namespace: str) -> None:
    claimed = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    assert await backend.complete(k(namespace), claimed.token, RESPONSE, ttl=DAY) is True
    again = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(again, Existing)
    assert again.record.state == COMPLETED
    assert again.record.fingerprint == b"fp"
    assert again.record.response == RESPONSE
    assert decide(again, b"fp") is Action.REPLAY


async def test_complete_with_a_stale_token_is_fenced_out(backend: Backend, namespace: str) -> None:
    claimed = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    assert await backend.complete(k(namespace), claimed.token + 1, RESPONSE, ttl=DAY) is False
    rec = await backend.get(k(namespace))
    assert rec is not None and rec.state == IN_PROGRESS and rec.response is None


async def test_release_frees_the_key_for_a_new_claim(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(first, Claimed)
    assert await backend.release(k(namespace), first.token) is True
    assert await backend.get(k(namespace)) is None
    second = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(second, Claimed) and second.token != first.token


async def test_release_with_a_stale_token_is_fenced_out(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(first, Claimed)
    assert await backend.release(k(namespace), first.token + 1) is False
    assert await backend.get(k(namespace)) is not None


async def test_release_never_deletes_a_completed_record(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(first, Claimed)
    assert await backend.complete(k(namespace), first.token, RESPONSE, ttl=DAY)
    assert await backend.release(k(namespace), first.token) is False
    rec = await backend.get(k(namespace))
    assert rec is not None and rec.state == COMPLETED


async def test_extend_pushes_the_lease_by_the_store_clock(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=1, ttl=DAY)
    assert isinstance(first, Claimed)
    before = await backend.get(k(namespace))
    assert await backend.extend(k(namespace), first.token, lease=60) is True
    after = await backend.get(k(namespace))
    assert before is not None and after is not None
    assert after.lease_until >= before.lease_until + 58
    assert await backend.extend(k(namespace), first.token + 1, lease=60) is False


async def test_extend_of_a_completed_record_is_refused(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(first, Claimed)
    assert await backend.complete(k(namespace), first.token, RESPONSE, ttl=DAY)
    assert await backend.extend(k(namespace), first.token, lease=60) is False


async def test_expired_lease_is_reported_and_the_record_kept(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(first, Claimed)
    await asyncio.sleep(0.35)
    again = await backend.claim(k(namespace), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(again, Existing)
    assert again.record.token == first.token
    assert decide(again, b"fp") is Action.EXPIRED


async def test_takeover_of_an_expired_lease_fences_the_old_holder(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(first, Claimed)
    await asyncio.sleep(0.35)
    taken = await backend.takeover(k(namespace), first.token, b"fp", lease=30, ttl=DAY)
    assert isinstance(taken, Claimed) and taken.token != first.token
    assert await backend.complete(k(namespace), first.token, RESPONSE, ttl=DAY) is False
    assert await backend.release(k(namespace), first.token) is False
    assert await backend.extend(k(namespace), first.token, lease=30) is False
    assert await backend.complete(k(namespace), taken.token, RESPONSE, ttl=DAY) is True


async def test_takeover_of_a_live_lease_is_refused(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(first, Claimed)
    taken = await backend.takeover(k(namespace), first.token, b"fp", lease=30, ttl=DAY)
    assert isinstance(taken, Existing) and taken.record.token == first.token


async def test_takeover_with_the_wrong_stale_token_is_refused(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(first, Claimed)
    await asyncio.sleep(0.35)
    taken = await backend.takeover(k(namespace), first.token + 1, b"fp", lease=30, ttl=DAY)
    assert isinstance(taken, Existing) and taken.record.token == first.token


async def test_only_one_of_two_concurrent_takeovers_wins(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=0.2, ttl=DAY)
    assert isinstance(first, Claimed)
    await asyncio.sleep(0.35)
    results = await asyncio.gather(
        *[backend.takeover(k(namespace), first.token, b"fp", lease=30, ttl=DAY) for _ in range(20)]
    )
    assert sum(isinstance(r, Claimed) for r in results) == 1


async def test_expired_record_counts_as_new(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=0.2, ttl=0.3)
    assert isinstance(first, Claimed)
    assert await backend.complete(k(namespace), first.token, RESPONSE, ttl=0.3)
    await asyncio.sleep(0.5)
    assert await backend.get(k(namespace)) is None
    again = await backend.claim(k(namespace), b"other", lease=30, ttl=DAY)
    assert isinstance(again, Claimed)


async def test_thirty_day_ttl_is_kept(backend: Backend, namespace: str) -> None:
    first = await backend.claim(k(namespace), b"fp", lease=30, ttl=30 * DAY)
    assert isinstance(first, Claimed)
    assert await backend.complete(k(namespace), first.token, RESPONSE, ttl=30 * DAY)
    again = await backend.claim(k(namespace), b"fp", lease=30, ttl=30 * DAY)
    assert isinstance(again, Existing)
    assert 30 * DAY - 5 < again.record.expires_at - again.now <= 30 * DAY + 1


async def test_get_of_an_absent_key_is_none(backend: Backend, namespace: str) -> None:
    assert await backend.get(k(namespace)) is None


async def test_scopes_never_share_a_record(backend: Backend, namespace: str) -> None:
    a = await backend.claim(k(namespace, "same", scope="tenant-a"), b"fp", lease=30, ttl=DAY)
    b = await backend.claim(k(namespace, "same", scope="tenant-b"), b"fp", lease=30, ttl=DAY)
    c = await backend.claim(k(namespace, "same"), b"fp", lease=30, ttl=DAY)
    assert isinstance(a, Claimed) and isinstance(b, Claimed) and isinstance(c, Claimed)


async def test_length_prefixing_keeps_look_alike_keys_apart(backend: Backend, namespace: str) -> None:
    a = await backend.claim(RecordKey.build(namespace, "a:b", "c"), b"fp", lease=30, ttl=DAY)
    b = await backend.claim(RecordKey.build(namespace, "a", "b:c"), b"fp", lease=30, ttl=DAY)
    assert isinstance(a, Claimed) and isinstance(b, Claimed)


async def test_hostile_key_characters_are_stored_safely(backend: Backend, namespace: str) -> None:
    for key in ("*", "{tag}", "'; DROP TABLE idem_records; --", "a:b:c", "\\x00"):
        claimed = await backend.claim(k(namespace, key), b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed), key
        assert await backend.complete(k(namespace, key), claimed.token, RESPONSE, ttl=DAY)
        rec = await backend.get(k(namespace, key))
        assert rec is not None and rec.response == RESPONSE


async def test_hundred_concurrent_claims_have_exactly_one_winner(backend: Backend, namespace: str) -> None:
    results = await asyncio.gather(*[backend.claim(k(namespace), b"fp", lease=30, ttl=DAY) for _ in range(100)])
    winners = [r for r in results if isinstance(r, Claimed)]
    assert len(winners) == 1
    assert all(r.record.token == winners[0].token for r in results if isinstance(r, Existing))


async def test_not_replayable_marker_survives_the_store(backend: Backend, namespace: str) -> None:
    claimed = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    marker = StoredResponse(200, [(b"content-type", b"text/plain")], b"", replayable=False)
    assert await backend.complete(k(namespace), claimed.token, marker, ttl=DAY)
    again = await backend.claim(k(namespace), b"fp", lease=30, ttl=DAY)
    assert isinstance(again, Existing) and again.record.response == marker
    assert decide(again, b"fp") is Action.NOT_STORED


async def test_backend_is_an_async_context_manager(backend: Backend) -> None:
    assert isinstance(backend, Backend)
    async with backend as entered:  # type: ignore[attr-defined]
        assert entered is backend


# --- the ops half (Maintenance): stale() and purge() -----------------------------------------


async def test_every_backend_has_the_maintenance_half(backend: Backend) -> None:
    assert isinstance(backend, Maintenance)


async def test_stale_lists_expired_in_progress_records_with_their_key(backend: Backend, namespace: str) -> None:
    assert isinstance(backend, Maintenance)
    crashed = RecordKey.build(namespace, "tenant:a{x}", "crashed*[1]")
    older = RecordKey.build(namespace, None, "older")
    first = await backend.claim(older, b"fp0", lease=0.1, ttl=DAY)
    second = await backend.claim(crashed, b"fp1", lease=0.2, ttl=DAY)
    assert isinstance(first, Claimed) and isinstance(second, Claimed)
    assert isinstance(await backend.claim(k(namespace, "running"), b"fp", lease=30, ttl=DAY), Claimed)
    done = await backend.claim(k(namespace, "done"), b"fp", lease=0.1, ttl=DAY)
    assert isinstance(done, Claimed) and await backend.complete(k(namespace, "done"), done.token, RESPONSE, ttl=DAY)
    assert isinstance(await backend.claim(k(namespace, "gone"), b"fp", lease=0.1, ttl=0.3), Claimed)  # TTL over too
    await asyncio.sleep(0.45)

    stale = await backend.stale(0, namespace=namespace)
    assert [s.key.digest for s in stale] == [older.digest, crashed.digest]  # oldest lease first
    assert all(isinstance(s, StaleRecord) and not s.effect_committed for s in stale)
    listed = (stale[1].key.namespace, stale[1].key.scope, stale[1].key.key)
    if getattr(backend, "store_keys", True):  # the memory store, or a store told to keep raw keys
        assert listed == (namespace, "tenant:a{x}", "crashed*[1]") and stale[0].key == older
    else:  # by default a shared store keeps only the digest: nothing a client sent
        assert listed == (namespace, "?", "?") and stale[1].key.hidden
    rec = stale[1].record
    assert (rec.state, rec.fingerprint, rec.token, rec.response) == (IN_PROGRESS, b"fp1", second.token, None)
    assert rec.lease_until < rec.expires_at
    assert await backend.stale(60, namespace=namespace) == []
    assert len(await backend.stale(0, 1, namespace=namespace)) == 1
    # The listed key is usable as is: take it over by its token, and it is no longer stale.
    taken = await backend.takeover(stale[1].key, rec.token, rec.fingerprint, lease=30, ttl=DAY)
    assert isinstance(taken, Claimed)
    assert [s.key.digest for s in await backend.stale(0, namespace=namespace)] == [older.digest]


async def test_stale_keeps_to_its_namespace(backend: Backend, namespace: str) -> None:
    assert isinstance(backend, Maintenance)
    other = namespace + "-other"
    assert isinstance(await backend.claim(k(other), b"fp", lease=0.1, ttl=DAY), Claimed)
    await asyncio.sleep(0.25)
    assert await backend.stale(0, namespace=namespace) == []
    assert [s.key.digest for s in await backend.stale(0, namespace=other)] == [k(other).digest]


async def test_purge_deletes_only_expired_records(backend: Backend, namespace: str) -> None:
    """Redis expires keys by itself and returns 0; the others delete and count."""
    assert isinstance(backend, Maintenance)
    for name in ("short-done", "short-running"):
        claimed = await backend.claim(k(namespace, name), b"fp", lease=0.1, ttl=0.3)
        assert isinstance(claimed, Claimed)
        if name == "short-done":
            assert await backend.complete(k(namespace, name), claimed.token, RESPONSE, ttl=0.3)
    live = await backend.claim(k(namespace, "live"), b"fp", lease=30, ttl=DAY)
    assert isinstance(live, Claimed)
    await asyncio.sleep(0.45)
    deleted = await backend.purge(batch_size=1)
    if type(backend).__name__ == "RedisBackend":
        assert deleted == 0
    else:
        assert deleted >= 2  # a shared Postgres table may hold other tests' expired rows too
    assert await backend.get(k(namespace, "short-done")) is None
    assert await backend.get(k(namespace, "short-running")) is None
    rec = await backend.get(k(namespace, "live"))
    assert rec is not None and rec.token == live.token
    assert await backend.purge() >= 0
