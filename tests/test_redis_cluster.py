"""RedisBackend on a real three-primary Redis Cluster (the `cluster` fixture), in a temporary directory.

Records hash by their `{digest}` tag, so they spread over the nodes; every script touches one
key, so every operation runs on the record's own node.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.records import Claimed, Existing, RecordKey, StoredResponse
from tests.support.pay import Payments, post
from tests.support.servers import RedisProcess, redis_cli

pytestmark = pytest.mark.redis

DAY = 86_400.0
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json"), (b"x-a", b"1")], b'{"paid":true}')


@pytest.fixture
async def backend(cluster: list[RedisProcess]) -> AsyncIterator[RedisBackend]:
    # A small pool, so bursts must wait for it; a long timeout, so the wait is what is tested,
    # not how fast this (shared, 2-core) machine gets through the queue.
    b = RedisBackend.from_url(
        cluster[0].url, cluster=True, prefix=f"idem-test:{uuid.uuid4().hex}:", max_connections=8, timeout=10
    )
    try:
        yield b
    finally:
        await b.aclose()


def rk(key: str) -> RecordKey:
    return RecordKey.build("cluster-tests", "tenant", key)


async def keys_per_node(cluster: list[RedisProcess], prefix: str) -> list[int]:
    counts = []
    for node in cluster:
        direct = aioredis.Redis(port=node.port)
        try:
            counts.append(len([k async for k in direct.scan_iter(match=f"{prefix}*", count=1000)]))
        finally:
            await direct.aclose()
    return counts


async def test_every_operation_works_on_records_spread_over_the_nodes(
    backend: RedisBackend, cluster: list[RedisProcess]
) -> None:
    names = [f"key-{i}" for i in range(60)]
    for name in names:
        claimed = await backend.claim(rk(name), b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed), name
        again = await backend.claim(rk(name), b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Existing) and again.record.token == claimed.token
        assert await backend.extend(rk(name), claimed.token, lease=60)
        record = await backend.get(rk(name))
        assert record is not None and record.lease_until - again.now > 58
        if name.endswith(("0", "5")):
            assert await backend.release(rk(name), claimed.token)
            assert await backend.get(rk(name)) is None
        else:
            assert await backend.complete(rk(name), claimed.token, RESPONSE, ttl=DAY)
            replay = await backend.claim(rk(name), b"fp", lease=30, ttl=DAY)
            assert isinstance(replay, Existing) and replay.record.response == RESPONSE
    counts = await keys_per_node(cluster, backend.prefix)
    assert sum(counts) == 48
    assert all(c > 0 for c in counts), counts  # every primary holds records


async def test_takeover_of_an_expired_lease_on_every_node(backend: RedisBackend, cluster: list[RedisProcess]) -> None:
    names = [f"stale-{i}" for i in range(12)]
    first = {n: await backend.claim(rk(n), b"fp", lease=0.2, ttl=DAY) for n in names}
    await asyncio.sleep(0.35)
    for name, claimed in first.items():
        assert isinstance(claimed, Claimed)
        taken = await backend.takeover(rk(name), claimed.token, b"fp", lease=30, ttl=DAY)
        assert isinstance(taken, Claimed) and taken.token != claimed.token
        assert await backend.complete(rk(name), claimed.token, RESPONSE, ttl=DAY) is False
        assert await backend.complete(rk(name), taken.token, RESPONSE, ttl=DAY) is True
    assert len([c for c in await keys_per_node(cluster, backend.prefix) if c]) >= 2


async def test_fifty_way_concurrent_claims_on_many_keys(backend: RedisBackend, cluster: list[RedisProcess]) -> None:
    """60 keys x 50 concurrent claims through 8 connections: one winner per key, no error."""
    names = [f"burst-{i}" for i in range(60)]
    calls = [(n, backend.claim(rk(n), b"fp", lease=30, ttl=DAY)) for n in names for _ in range(50)]
    results = await asyncio.gather(*(c for _, c in calls))
    winners: dict[str, list[int]] = {}
    for (name, _), result in zip(calls, results, strict=True):
        if isinstance(result, Claimed):
            winners.setdefault(name, []).append(result.token)
    assert sorted(winners) == sorted(names)
    assert all(len(tokens) == 1 for tokens in winners.values())
    for (name, _), result in zip(calls, results, strict=True):
        if isinstance(result, Existing):
            assert result.record.token == winners[name][0]
    assert all(c > 0 for c in await keys_per_node(cluster, backend.prefix))


async def test_scripts_reload_after_a_node_flushes_them(backend: RedisBackend, cluster: list[RedisProcess]) -> None:
    for i in range(10):
        assert isinstance(await backend.claim(rk(f"warm-{i}"), b"fp", lease=30, ttl=DAY), Claimed)
    for node in cluster:
        redis_cli("-p", str(node.port), "script", "flush", timeout=5)
    for i in range(30):
        claimed = await backend.claim(rk(f"after-{i}"), b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        assert await backend.complete(rk(f"after-{i}"), claimed.token, RESPONSE, ttl=DAY)


async def test_a_given_cluster_client_stays_usable_and_decoding_ones_are_refused(cluster: list[RedisProcess]) -> None:
    client = aioredis.RedisCluster(host="127.0.0.1", port=cluster[1].port)
    try:
        async with RedisBackend(client, prefix=f"idem-test:{uuid.uuid4().hex}:") as backend:
            assert isinstance(await backend.claim(rk("given"), b"fp", lease=30, ttl=DAY), Claimed)
        assert await client.ping() is True
    finally:
        await client.aclose()
    decoding = aioredis.RedisCluster(host="127.0.0.1", port=cluster[1].port, decode_responses=True)
    try:
        with pytest.raises(ConfigurationError):
            RedisBackend(decoding)
    finally:
        await decoding.aclose()


async def test_middleware_runs_once_and_replays_on_a_cluster(backend: RedisBackend) -> None:
    app = Payments()
    mw = IdempotencyMiddleware(
        app, backend=backend, routes=[RoutePolicy("/pay", methods=["POST"], required=True, single_tenant=True)]
    )
    keys = [f"mw-{uuid.uuid4().hex}" for _ in range(30)]
    answers = await asyncio.gather(*(post(mw, k) for k in keys for _ in range(5)))
    assert all(a.status in (201, 409) for a in answers)
    assert all(app.runs[k] == 1 for k in keys)
    replays = await asyncio.gather(*(post(mw, k) for k in keys))
    firsts = {a.body for a in answers if a.status == 201 and not a.replayed}
    assert all(r.replayed and r.body in firsts for r in replays)


async def test_answers_past_replay_ttl_leave_tombstones_on_every_node(
    backend: RedisBackend, cluster: list[RedisProcess]
) -> None:
    """Two horizons on a cluster: the record and its tombstone share the `{digest}` slot, so complete,
    claim and read (two keys each) run on the record's node; past `replay_for` only tombstones remain,
    spread over every primary, and each still refuses its key."""
    kept = StoredResponse(201, [(b"location", b"/payments/1")], b'{"paid":true}', replay_for=0.5)
    names = [f"horizon-{i}" for i in range(30)]
    for name in names:
        claimed = await backend.claim(rk(name), b"fp", lease=30, ttl=DAY)
        assert isinstance(claimed, Claimed)
        assert await backend.complete(rk(name), claimed.token, kept, ttl=DAY)
    await asyncio.sleep(0.7)
    for name in names:
        again = await backend.claim(rk(name), b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Existing) and again.record.response is not None, name
        assert again.record.response.tombstone and again.record.response.status == 201
        assert again.record.response.headers == [(b"location", b"/payments/1")]
        read = await backend.get(rk(name))
        assert read is not None and read.response is not None and read.response.tombstone
    counts = await keys_per_node(cluster, backend.prefix + "t{")
    assert sum(counts) == 30 and all(c > 0 for c in counts), counts
    assert sum(await keys_per_node(cluster, backend.prefix + "{")) == 0, "the records left with their answers"
