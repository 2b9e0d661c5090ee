"""The store contract the package ships (`idem_asgi.testing.contract.StoreContract`), run unchanged on
every store: memory, Redis through the lean pool `from_url` builds, Redis through a plain redis-py
client handed in, a Redis Cluster, Sentinel and durable claims, and Postgres (the lean pool,
asyncpg's own pool, and the plain URL through a transaction-mode PgBouncer).

A plain client a user hands in takes the lean pool too (`redis-client`); one the lean pool cannot
serve (here: a client name) keeps redis-py for every call (`redis-py`), as a Cluster does."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from idem_asgi.backends import Backend, Maintenance
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.testing.contract import StoreContract
from tests.support.pgbouncer import pgbouncer
from tests.support.servers import POSTGRES_DSN, REDIS_URL, redis_cluster, redis_sentinel, require
from tests.support.stores import BACKENDS, TEST_TABLE, make_backend

STORES = [
    *BACKENDS,
    pytest.param("redis-client", marks=pytest.mark.redis),
    pytest.param("redis-py", marks=pytest.mark.redis),
    pytest.param("redis-cluster", marks=pytest.mark.redis),
    pytest.param("redis-sentinel", marks=pytest.mark.redis),  # durable claims, through Sentinel (redis-py)
    pytest.param("redis-durable", marks=pytest.mark.redis),  # durable claims, lean pool on the primary
    pytest.param("redis-cluster-durable", marks=pytest.mark.redis),  # durable claims per shard
    pytest.param("postgres-pgbouncer", marks=pytest.mark.postgres),  # the plain URL, through a transaction pooler
    pytest.param("postgres-asyncpg", marks=pytest.mark.postgres),  # asyncpg's own pool, not the lean one
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
async def contract_store(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
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
    elif request.param == "postgres-asyncpg":
        require("postgres", POSTGRES_DSN)
        pg = PostgresBackend.from_dsn(POSTGRES_DSN, table=TEST_TABLE, implementation="asyncpg")
        await pg.setup()
        store = pg
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


class TestEveryStore(StoreContract):
    """The shipped suite, on each store above (its `contract_store` fixture is this module's)."""

    async def test_the_store_is_an_async_context_manager(self, contract_store: Backend) -> None:
        """`async with store:` enters the store itself (and closes it on the way out)."""
        async with contract_store as entered:  # type: ignore[attr-defined]
            assert entered is contract_store

    async def test_every_packaged_store_has_the_maintenance_half(self, contract_store: Backend) -> None:
        """`stale()`/`purge()` (the shipped suite skips those tests for a store without them)."""
        assert isinstance(contract_store, Maintenance)
