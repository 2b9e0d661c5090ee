"""The Redis store (`RedisBackend`); its parts (scripts, lean pool, Sentinel, durable claims) are private modules."""

from ._store import RedisBackend

__all__ = ["RedisBackend"]
