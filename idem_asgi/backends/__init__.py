"""Stores for idempotency records, and `backend_from_url` to pick one by URL.

`RedisBackend` and `PostgresBackend` import their drivers only when used, so the extras
(`idem-asgi[redis]`, `idem-asgi[postgres]`) stay optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ._protocol import Backend, Maintenance
from .memory import MemoryBackend

if TYPE_CHECKING:
    from .postgres import PostgresBackend
    from .redis import RedisBackend

__all__ = ["Backend", "Maintenance", "MemoryBackend", "PostgresBackend", "RedisBackend", "backend_from_url"]


def __getattr__(name: str) -> Any:
    if name == "RedisBackend":
        from .redis import RedisBackend

        return RedisBackend
    if name == "PostgresBackend":
        from .postgres import PostgresBackend

        return PostgresBackend
    raise AttributeError(name)


def backend_from_url(url: str, **options: Any) -> Backend:
    """Build a backend from `memory://`, `redis://`, `rediss://`, `unix://` or `postgresql://` URLs."""
    scheme = url.partition("://")[0].lower()
    if scheme == "memory":
        return MemoryBackend(**options)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisBackend

        return RedisBackend.from_url(url, **options)
    if scheme in ("postgres", "postgresql"):
        from .postgres import PostgresBackend

        return PostgresBackend.from_dsn(url, **options)
    raise ConfigurationError(
        f"unknown backend URL scheme {scheme!r}; use memory://, redis://, rediss://, unix:// or postgresql://"
    )
