"""Stores for idempotency records, and `backend_from_url` to pick one by URL.

`RedisBackend` and `PostgresBackend` import their drivers only when used, so the extras
(`idem-asgi[redis]`, `idem-asgi[postgres]`) stay optional. Every store class builds itself from a
URL (`from_url`); `SCHEMES` below is the one table from URL scheme to class that `backend_from_url`,
the middleware's `backend="..."` and the `idem-asgi` CLI all use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from ..errors import ConfigurationError
from ._protocol import Backend, Checkable, Histories, KeyForms, Maintenance, Watchable
from .memory import MemoryBackend

if TYPE_CHECKING:
    from .postgres import PostgresBackend
    from .redis import RedisBackend

__all__ = [
    "SCHEMES",
    "Backend",
    "Checkable",
    "Histories",
    "KeyForms",
    "Maintenance",
    "MemoryBackend",
    "PostgresBackend",
    "RedisBackend",
    "Watchable",
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
"""URL scheme -> (module in this package, class): the only list of schemes."""


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
        known = ", ".join(f"{s}://" for s in SCHEMES)
        raise ConfigurationError(f"unknown backend URL scheme {shown}; use one of {known}")
    module, name = found
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def backend_from_url(url: str, **options: Any) -> Backend:
    """Build a store from a URL whose scheme is in `SCHEMES` (`memory://`, `redis://`, `postgresql://`, ...).

    `options` go to the class's `from_url` (`RedisBackend.from_url`, `PostgresBackend.from_dsn`,
    `MemoryBackend(...)`).
    """
    store: Backend = backend_class(url).from_url(url, **options)
    return store
