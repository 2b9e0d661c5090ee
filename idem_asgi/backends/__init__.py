"""Stores for idempotency records, and `backend_from_url` to pick one by URL.

`RedisBackend` and `PostgresBackend` import their drivers only when used, so the extras
(`idem-asgi[redis]`, `idem-asgi[postgres]`) stay optional. Every store class names its URL schemes
(`SCHEMES`) and builds itself from a URL (`from_url`); `SCHEMES` below is the one table from scheme
to class that `backend_from_url`, the middleware's `backend="..."` and the `idem-asgi` CLI all use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from ..errors import ConfigurationError
from ._protocol import Backend, Checkable, Maintenance
from .memory import MemoryBackend

if TYPE_CHECKING:
    from .postgres import PostgresBackend
    from .redis import RedisBackend

__all__ = [
    "SCHEMES",
    "Backend",
    "Checkable",
    "Maintenance",
    "MemoryBackend",
    "PostgresBackend",
    "RedisBackend",
    "backend_class",
    "backend_from_url",
]

SCHEMES: Final[dict[str, tuple[str, str]]] = {
    "memory": ("memory", "MemoryBackend"),
    "redis": ("redis", "RedisBackend"),
    "rediss": ("redis", "RedisBackend"),
    "redis+sentinel": ("redis", "RedisBackend"),
    "unix": ("redis", "RedisBackend"),
    "postgres": ("postgres", "PostgresBackend"),
    "postgresql": ("postgres", "PostgresBackend"),
}
"""URL scheme -> (module in this package, class). Each class lists the same schemes in its `SCHEMES`."""


def __getattr__(name: str) -> Any:
    if name in ("RedisBackend", "PostgresBackend"):
        module = "redis" if name == "RedisBackend" else "postgres"
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(name)


def backend_class(url: str) -> Any:
    """The store class for `url`'s scheme (importing its driver); `ConfigurationError` for an unknown one."""
    scheme, sep, _ = url.partition("://")
    found = SCHEMES.get(scheme.lower()) if sep else None
    if found is None:
        shown = repr(scheme.lower()) if sep and scheme else "none"
        raise ConfigurationError(
            f"unknown backend URL scheme {shown}; use memory://, redis://, rediss://, redis+sentinel://, unix:// or postgresql://"
        )
    module, name = found
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def backend_from_url(url: str, **options: Any) -> Backend:
    """Build a store from `memory://`, `redis://`, `rediss://`, `redis+sentinel://`, `unix://` or `postgresql://` URLs.

    `options` go to the class's `from_url` (`RedisBackend.from_url`, `PostgresBackend.from_dsn`,
    `MemoryBackend(...)`).
    """
    store: Backend = backend_class(url).from_url(url, **options)
    return store
