"""`backend` runs a test once per real store (memory, redis, postgres); `shared_store` once per
store several processes can share (redis, postgres). `throwaway` is a private redis-server,
`cluster` a three-primary Redis Cluster (one per test module). Stores and servers are in
`tests/support/`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from idem_asgi.backends import Backend
from tests.support.servers import POSTGRES_DSN, REDIS_URL, RedisProcess, redis_cluster, redis_process, require
from tests.support.stores import BACKENDS, SHARED, make_backend


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Every store the contract must hold on; tests isolate themselves with fresh keys."""
    b = await make_backend(request.param)
    try:
        yield b
    finally:
        await b.aclose()


@pytest.fixture
def namespace() -> str:
    """A namespace no other test uses, so tests sharing a real store never meet."""
    return f"t-{uuid.uuid4().hex}"


@pytest.fixture(params=SHARED)
def shared_store(request: pytest.FixtureRequest) -> str:
    """ "redis" or "postgres", for tests whose workers are separate processes; skipped when missing."""
    name = str(request.param)
    require(name, REDIS_URL if name == "redis" else POSTGRES_DSN)
    return name


@pytest.fixture
def throwaway(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private redis-server (no persistence) on a free port."""
    with redis_process(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RedisProcess]]:
    """Three primaries, no replicas, all slots assigned; killed on teardown."""
    with redis_cluster(tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes
