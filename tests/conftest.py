"""`backend` runs a test once per real store (memory, redis, postgres); `shared_store` once per
store several processes can share (redis, postgres)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from idem_asgi.backends import Backend, MemoryBackend
from tests.servers import POSTGRES_DSN, REDIS_URL, require

BACKENDS = [
    pytest.param("memory", marks=pytest.mark.memory),
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]


async def make_backend(name: str) -> Backend:
    """A fresh, isolated backend of the named kind (own key prefix or own table)."""
    if name == "memory":
        return MemoryBackend()
    if name == "redis":
        require("redis", REDIS_URL)
        from idem_asgi.backends.redis import RedisBackend

        return RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{uuid.uuid4().hex}:")
    require("postgres", POSTGRES_DSN)
    from idem_asgi.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_dsn(POSTGRES_DSN, table="idem_test_records", min_size=1, max_size=20)
    await backend.setup()
    return backend


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


@pytest.fixture(params=BACKENDS[1:])
def shared_store(request: pytest.FixtureRequest) -> str:
    """"redis" or "postgres", for tests whose workers are separate processes; skipped when missing."""
    name = str(request.param)
    require(name, REDIS_URL if name == "redis" else POSTGRES_DSN)
    return name
