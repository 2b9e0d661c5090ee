"""A store's optional abilities are protocols, asked once where the store is set up, never per call."""

from __future__ import annotations

import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend, Checkable, KeyForms, Maintenance, MemoryBackend, Watchable
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http.middleware import check_store
from idem_asgi.ops.reconcile import reconcile
from tests.support.stores import Delegating


async def app(scope: object, receive: object, send: object) -> None:  # never called
    raise AssertionError


def abilities(store: object) -> set[str]:
    kinds = {"check": Checkable, "watch": Watchable, "maintenance": Maintenance, "key_forms": KeyForms}
    return {name for name, kind in kinds.items() if isinstance(store, kind)}


async def test_each_store_declares_what_it_can_do() -> None:
    redis = RedisBackend.from_url("redis://127.0.0.1:6379")  # nothing connects before a call
    postgres = PostgresBackend.from_dsn("postgresql://127.0.0.1/test")
    try:
        assert abilities(MemoryBackend()) == {"maintenance"}
        assert abilities(redis) == {"check", "watch", "maintenance", "key_forms"}
        assert abilities(postgres) == {"check", "watch", "maintenance", "key_forms"}
    finally:
        await redis.aclose()
        await postgres.aclose()


async def test_the_middleware_asks_for_watch_once_and_again_when_its_store_is_swapped() -> None:
    redis = RedisBackend.from_url("redis://127.0.0.1:6379")
    try:
        mw = IdempotencyMiddleware(app, backend=redis, routes=[RoutePolicy("/pay", single_tenant=True)])
        assert mw.watcher is redis
        memory = MemoryBackend()
        assert mw.use_backend(memory) is redis and mw.watcher is None
        assert mw.use_backend(redis) is memory and mw.watcher is redis
    finally:
        await redis.aclose()


class Bare(Delegating):
    """A store with the `Backend` methods and nothing else."""

    def __getattr__(self, name: str) -> object:
        raise AttributeError(name)


async def test_a_store_with_only_the_backend_methods_serves_and_the_tools_refuse_it() -> None:
    bare: Backend = Bare(MemoryBackend())
    assert isinstance(bare, Backend) and abilities(bare) == set()
    assert await check_store(bare) is None  # nothing to check: it serves
    with pytest.raises(ConfigurationError, match="has no stale"):
        await reconcile(bare, lambda s: None, older_than=0)  # type: ignore[arg-type]  # as an untyped caller may
