"""Durable claims (`durable_replicas`): a claim counts only once replicas confirm it (`WAIT`).

Each test starts its own primary and replica (free ports) and breaks replication on purpose by
stopping the replica (SIGSTOP), so what asynchronous replication loses is shown deterministically,
not left to a race: an acknowledged claim that never reached the replica is gone once the replica
is promoted, and the retry runs again. With durable claims the same claim is refused (503) before
the app runs and withdrawn, so nothing can run twice. Both client paths are covered: the lean pool
(`from_url`) and redis-py (a client of the user's with a client name).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import BackendUnavailable, ConfigurationError
from idem_asgi.http.problems import STORE_UNAVAILABLE
from idem_asgi.records import Claimed, RecordKey, StoredResponse
from tests.support.asgi import drive, http_scope
from tests.support.faultproxy import StoreProxy
from tests.support.problems import assert_problem
from tests.support.servers import RedisProcess, redis_cluster, redis_process, replica_synced

pytestmark = pytest.mark.redis

RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id":"pay_1"}')


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    with redis_process(tmp_path / "primary") as primary:
        args = ["--replicaof", "127.0.0.1", str(primary.port)]
        with redis_process(tmp_path / "replica", args=args) as replica:
            deadline = time.monotonic() + 10
            while not replica_synced(primary, replica):
                assert time.monotonic() < deadline, "replica never synced"
                time.sleep(0.05)
            yield primary, replica


@pytest.fixture(params=["lean", "redis-py"])
async def durable(
    request: pytest.FixtureRequest, pair: tuple[RedisProcess, RedisProcess]
) -> AsyncIterator[RedisBackend]:
    primary, _ = pair
    prefix = f"idem-durable:{uuid.uuid4().hex[:8]}:"
    if request.param == "lean":
        store = RedisBackend.from_url(primary.url, prefix=prefix, durable_replicas=1, timeout=1.0)
        assert store._lean is not None
        yield store
        await store.aclose()
        return
    client = aioredis.Redis.from_url(primary.url, socket_timeout=1.0, client_name="app")
    store = RedisBackend(client, prefix=prefix, durable_replicas=1, timeout=1.0)
    assert store._lean is None
    yield store
    await store.aclose()
    await client.aclose()


def key() -> RecordKey:
    return RecordKey.build("durable", None, uuid.uuid4().hex)


async def on_replica(replica: RedisProcess, store: RedisBackend, k: RecordKey) -> dict[bytes, bytes]:
    client = aioredis.Redis.from_url(replica.url)
    try:
        record = await client.hgetall(store._key(k))
        return {bytes(f): bytes(v) for f, v in record.items()}  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def test_a_durable_claim_and_its_completion_are_on_the_replica_when_they_return(
    durable: RedisBackend, pair: tuple[RedisProcess, RedisProcess]
) -> None:
    _, replica = pair
    k = key()
    result = await durable.claim(k, b"f", lease=10, ttl=60)
    assert isinstance(result, Claimed)
    assert (await on_replica(replica, durable, k))[b"s"] == b"p"  # no sleep: WAIT said so
    assert await durable.complete(k, result.token, RESPONSE, ttl=60)
    assert (await on_replica(replica, durable, k))[b"s"] == b"c"


async def test_a_durable_completion_with_a_shorter_replay_ttl_puts_its_tombstone_on_the_replica(
    durable: RedisBackend, pair: tuple[RedisProcess, RedisProcess]
) -> None:
    """The completion's WAIT covers both of its keys: the record and the tombstone that outlives it."""
    _, replica = pair
    k = key()
    result = await durable.claim(k, b"f", lease=10, ttl=60)
    assert isinstance(result, Claimed)
    answer = msgspec.structs.replace(RESPONSE, replay_for=30.0)
    assert await durable.complete(k, result.token, answer, ttl=60)
    client = aioredis.Redis.from_url(replica.url)
    try:
        assert await client.exists(durable._keys(k)[1]) == 1  # no sleep: WAIT said so
        assert 29_000 < await client.pttl(durable._key(k)) <= 30_000
    finally:
        await client.aclose()


async def test_a_claim_the_replica_does_not_confirm_is_withdrawn_and_refused(
    durable: RedisBackend, pair: tuple[RedisProcess, RedisProcess]
) -> None:
    primary, replica = pair
    k = key()
    replica.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="0 of 1 replicas confirmed the claim"):
            await durable.claim(k, b"f", lease=10, ttl=60)
        assert time.monotonic() - started < 1.0  # durable_timeout: half of timeout
        client = aioredis.Redis.from_url(primary.url)
        try:
            assert not await client.exists(durable._key(k)), "the unconfirmed claim was withdrawn"
        finally:
            await client.aclose()
    finally:
        replica.signal(signal.SIGCONT)
    assert isinstance(await durable.claim(k, b"f", lease=10, ttl=60), Claimed)  # replica back: served


async def test_an_unconfirmed_completion_raises_and_lands_when_written_again(
    durable: RedisBackend, pair: tuple[RedisProcess, RedisProcess]
) -> None:
    _, replica = pair
    k = key()
    result = await durable.claim(k, b"f", lease=10, ttl=60)
    assert isinstance(result, Claimed)
    replica.signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable, match="confirmed the completion"):
            await durable.complete(k, result.token, RESPONSE, ttl=60)
    finally:
        replica.signal(signal.SIGCONT)
    # What the middleware's background retry does: the same write again, now confirmed.
    assert await durable.complete(k, result.token, RESPONSE, ttl=60)
    assert (await on_replica(replica, durable, k))[b"s"] == b"c"


@pytest.mark.parametrize("replicas", [0, 1], ids=["async-replication", "durable"])
async def test_promoting_a_replica_that_missed_a_claim(replicas: int, tmp_path: Path) -> None:
    """The failure durable claims exist for, made deterministic: the replica follows the primary
    through a proxy that starts dropping the replication stream; the primary acknowledges a claim
    and dies; the replica is promoted. Without durable claims the key is free again on the new
    primary (a retry runs the payment twice); with them the claim was refused before the app ran."""
    prefix = f"idem-promote:{uuid.uuid4().hex[:8]}:"
    k = key()
    with redis_process(tmp_path / "primary") as primary:
        async with StoreProxy(primary.port) as link:
            args = ["--replicaof", "127.0.0.1", str(link.port)]
            with redis_process(tmp_path / "replica", args=args) as replica:
                deadline = time.monotonic() + 10
                while not await asyncio.to_thread(replica_synced, primary, replica):
                    assert time.monotonic() < deadline, "replica never synced"
                    await asyncio.sleep(0.05)  # the proxy runs on this loop
                old = RedisBackend.from_url(primary.url, prefix=prefix, durable_replicas=replicas, timeout=1.0)
                link.blackhole()  # from now on the replica hears nothing
                try:
                    first: object = await old.claim(k, b"f", lease=10, ttl=60)
                except BackendUnavailable:
                    first = "refused"
                finally:
                    await old.aclose()
                primary.kill()
                admin = aioredis.Redis.from_url(replica.url)
                try:
                    await admin.replicaof("NO", "ONE")
                finally:
                    await admin.aclose()
                new = RedisBackend.from_url(replica.url, prefix=prefix, timeout=1.0)
                try:
                    retry = await new.claim(k, b"f", lease=10, ttl=60)
                finally:
                    await new.aclose()
    assert isinstance(retry, Claimed), "the promoted replica never saw the claim: the key is free"
    if replicas == 0:
        assert isinstance(first, Claimed), "yet the primary had acknowledged it: the payment runs twice"
    else:
        assert first == "refused", "the claim never counted, so the first request never ran the app"


async def test_the_middleware_answers_503_before_the_app_runs(pair: tuple[RedisProcess, RedisProcess]) -> None:
    primary, replica = pair
    runs = 0

    async def app(scope: object, receive: object, send: object) -> None:  # pragma: no cover - must not run
        nonlocal runs
        runs += 1

    store = RedisBackend.from_url(
        primary.url, prefix=f"idem-mw:{uuid.uuid4().hex[:8]}:", durable_replicas=1, timeout=1.0
    )
    mw = IdempotencyMiddleware(app, backend=store, routes=[RoutePolicy("/pay", required=True, single_tenant=True)])
    replica.signal(signal.SIGSTOP)
    try:
        answer = await drive(mw, http_scope("POST", "/pay", key="k-1"), [b"{}"])
    finally:
        replica.signal(signal.SIGCONT)
        await store.aclose()
    assert_problem(answer, STORE_UNAVAILABLE)
    assert runs == 0


async def keys_on_every_shard(store: RedisBackend, shards: int) -> list[RecordKey]:
    """Random keys until each of the cluster's `shards` primaries holds some (12 random keys miss
    a shard about 2 % of the time)."""
    await store.client.initialize()  # the slot map
    keys: list[RecordKey] = []
    ports: set[int] = set()
    while len(ports) < shards or len(keys) < 12:
        keys.append(key())
        ports.add(store.client.get_node_from_key(store._key(keys[-1])).port)
        assert len(keys) < 1000, "the keys never reached every shard"
    return keys


async def test_on_a_cluster_each_shard_s_replica_confirms_its_claims(tmp_path: Path) -> None:
    """Durable claims per shard: with every replica stopped no claim counts (503, withdrawn); with
    them running, claims on all three shards are confirmed."""
    with redis_cluster(tmp_path / "cluster", replicas=1) as nodes:
        store = RedisBackend.from_url(nodes[0].url, cluster=True, prefix="idem-cd:", durable_replicas=1, timeout=1.0)
        try:
            keys = await keys_on_every_shard(store, 3)
            for replica in nodes[3:]:
                replica.signal(signal.SIGSTOP)
            try:
                with pytest.raises(BackendUnavailable, match="0 of 1 replicas confirmed the claim"):
                    await store.claim(keys[0], b"f", lease=10, ttl=60)
            finally:
                for replica in nodes[3:]:
                    replica.signal(signal.SIGCONT)
            results = [await store.claim(k, b"f", lease=10, ttl=60) for k in keys]
            assert all(isinstance(r, Claimed) for r in results)
            primaries = {store.client.get_node_from_key(store._key(k)).port for k in keys}
            assert len(primaries) == 3, "the keys covered every shard"
        finally:
            await store.aclose()


def test_durable_claims_refuse_a_bad_timeout() -> None:
    plain = aioredis.Redis()
    with pytest.raises(ConfigurationError, match="durable_timeout"):
        RedisBackend(plain, durable_replicas=1, timeout=1.0, durable_timeout=1.0)
    with pytest.raises(ConfigurationError, match="durable_replicas"):
        RedisBackend(plain, durable_replicas=-1)
