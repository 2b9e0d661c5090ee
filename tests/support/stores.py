"""The stores tests run on: one list, one factory, and one delegating wrapper for fault injection.

- `BACKENDS` (memory, redis, postgres) and `SHARED` (the ones several processes can share), as
  pytest params with their markers.
- `store_url(name)`, `store_from_url(url, ...)`, and `make_backend(name)`: a fresh, isolated store
  of the named kind (its own Redis key prefix; the shared Postgres test table, set up).
- `Delegating(inner)`: the whole `Backend` protocol handed to `inner` (everything else passed
  through); the fault-injecting and recording proxies subclass it and override what they change.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal, overload

import pytest

from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.records import ClaimResult, Record, RecordKey, StoredResponse
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require

if TYPE_CHECKING:
    from idem_asgi.backends.postgres import PostgresBackend
    from idem_asgi.backends.redis import RedisBackend

BACKENDS = [
    pytest.param("memory", marks=pytest.mark.memory),
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("postgres", marks=pytest.mark.postgres),
]
SHARED = BACKENDS[1:]
"""The stores several processes can share: redis, postgres."""
TEST_TABLE = "idem_test_records"
"""The Postgres table tests share; their rows are told apart by namespace."""


def store_url(name: str) -> str:
    """`memory://`, or the shared Redis or Postgres (required: skipped, or failed under CI, when unreachable)."""
    if name == "memory":
        return "memory://"
    if name == "redis":
        require("redis", REDIS_URL)
        return REDIS_URL
    require("postgres", POSTGRES_DSN)
    return POSTGRES_DSN


def store_from_url(
    url: str,
    *,
    prefix: str = "",
    table: str = TEST_TABLE,
    pool: int | None = None,
    store_keys: bool = False,
    timeout: float | None = None,
    history: int = 0,
) -> Backend:
    """A store for `url` (`memory://`, `redis://`, `postgresql://`), not set up yet.

    `prefix` is the Redis key prefix, `table` the Postgres table; `pool` bounds the connections
    (unset: the driver's default for Redis, 20 for Postgres); `store_keys` keeps raw keys (for
    tests whose resolvers or listings need them; the default keeps digests, as the product does);
    `timeout` the store's call timeout (unset: its default); `history` the steps kept per key (0: none).
    """
    if url.startswith("memory://"):
        return MemoryBackend(history=history)
    options: dict[str, Any] = {"store_keys": store_keys, "history": history}
    options |= {} if timeout is None else {"timeout": timeout}
    if url.startswith(("postgres://", "postgresql://")):
        from idem_asgi.backends.postgres import PostgresBackend

        return PostgresBackend.from_dsn(url, table=table, min_size=1, max_size=pool or 20, **options)
    from idem_asgi.backends.redis import RedisBackend

    if pool is not None:
        options["max_connections"] = pool
    return RedisBackend.from_url(url, prefix=prefix, **options)


@overload
async def make_backend(
    name: Literal["memory"],
    *,
    prefix: str | None = ...,
    table: str = ...,
    pool: int | None = ...,
    store_keys: bool = ...,
    history: int = ...,
) -> MemoryBackend: ...
@overload
async def make_backend(
    name: Literal["redis"],
    *,
    prefix: str | None = ...,
    table: str = ...,
    pool: int | None = ...,
    store_keys: bool = ...,
    history: int = ...,
) -> RedisBackend: ...
@overload
async def make_backend(
    name: Literal["postgres"],
    *,
    prefix: str | None = ...,
    table: str = ...,
    pool: int | None = ...,
    store_keys: bool = ...,
    history: int = ...,
) -> PostgresBackend: ...
@overload
async def make_backend(
    name: str,
    *,
    prefix: str | None = ...,
    table: str = ...,
    pool: int | None = ...,
    store_keys: bool = ...,
    history: int = ...,
) -> Backend: ...
async def make_backend(
    name: str,
    *,
    prefix: str | None = None,
    table: str = TEST_TABLE,
    pool: int | None = None,
    store_keys: bool = False,
    history: int = 0,
) -> Any:
    """A fresh, isolated backend of the named kind: its own key prefix (`idem-test:<uuid>:` unless
    given) on Redis, the table set up on Postgres; `history` steps kept per key (0: none). Skips
    (fails under CI) when the server is missing."""
    prefix = prefix or f"idem-test:{uuid.uuid4().hex}:"
    store = store_from_url(
        store_url(name), prefix=prefix, table=table, pool=pool, store_keys=store_keys, history=history
    )
    if name == "postgres":
        from idem_asgi.backends.postgres import PostgresBackend

        assert isinstance(store, PostgresBackend)
        await store.setup()
    return store


class Delegating:
    """Implements the `Backend` protocol by handing every call to `inner` (also `wrapped`, the
    attribute `PostgresBackend.transaction()` follows to find its own claim through wrappers).

    Any other attribute (`stale`, `purge`, `setup`, `pending_orphans`, ...) is `inner`'s. Subclasses
    override the calls they change; `before(op, key)` runs first in each of the seven store calls
    (not `aclose`), for a subclass that only logs, refuses or rewrites the key.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.wrapped = inner

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "wrapped"):  # not set yet (a copy being made): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    def before(self, op: str, key: RecordKey) -> RecordKey:
        """Called with the call's name (`claim`, `takeover`, ...) and key; returns the key to hand on."""
        return key

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        key = self.before("claim", key)
        return await self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        key = self.before("takeover", key)
        return await self.inner.takeover(key, stale_token, fingerprint, lease=lease, ttl=ttl)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        key = self.before("complete", key)
        return await self.inner.complete(key, token, response, ttl=ttl)

    async def release(self, key: RecordKey, token: int) -> bool:
        key = self.before("release", key)
        return await self.inner.release(key, token)

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        key = self.before("mark_failed", key)
        return await self.inner.mark_failed(key, token)

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        key = self.before("extend", key)
        return await self.inner.extend(key, token, lease=lease)

    async def get(self, key: RecordKey) -> Record | None:
        key = self.before("get", key)
        return await self.inner.get(key)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Counting(Delegating):
    """Counts the store calls, by name (`watch` too, where the store has it)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()

    def before(self, op: str, key: RecordKey) -> RecordKey:
        self.calls[op] += 1
        return key

    def __getattr__(self, name: str) -> Any:
        found = super().__getattr__(name)
        if name != "watch":
            return found

        async def watch(*args: Any, **kwargs: Any) -> Any:  # counted when called, not when looked up
            self.calls["watch"] += 1
            return await found(*args, **kwargs)

        return watch
