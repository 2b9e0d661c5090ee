"""Redis store: one Lua script per operation, so a claim-or-read is one atomic round trip.

Layout: one hash per record at `{prefix}{<digest>}` (the digest is the hash tag, so a record
never spans Redis Cluster slots and client characters never reach the key). Fields:
`s` state (`p` in progress, `c` completed), `f` fingerprint, `t` fencing token, `l` lease
deadline and `e` expiry (ms, Redis clock), `r` the msgpack-encoded response. The key's own
expiry is the route TTL, so an in-progress record whose holder died stays visible (and
blocks) after its lease ends, until recovery or the TTL resolves it.

Scripts are idempotent for their caller's token, so a retried command whose reply was lost
cannot turn our own claim into a conflict.
"""

from __future__ import annotations

import random
from types import TracebackType
from typing import Any, Final

from ..errors import BackendError, BackendUnavailable, ConfigurationError
from ..records import (
    COMPLETED,
    IN_PROGRESS,
    Claimed,
    ClaimResult,
    Existing,
    Record,
    RecordKey,
    StoredResponse,
    decode_response,
    encode_response,
)

try:
    import redis.asyncio as aioredis
    from redis import exceptions as redis_errors
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("RedisBackend needs redis-py: pip install 'idem-asgi[redis]'") from exc

_NOW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1]; ARGV: fingerprint, token, lease_ms, ttl_ms
CLAIM: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 'f', 't', 'l', 'e', 'r')
if cur[1] and cur[3] ~= ARGV[2] then
  return {0, now, cur[1], cur[2], cur[3], cur[4], cur[5], cur[6]}
end
if not cur[1] then
  redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[1], 't', ARGV[2], 'l', now + ARGV[3], 'e', now + ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {1, now}
"""
)

# KEYS[1]; ARGV: stale token, fingerprint, new token, lease_ms, ttl_ms
TAKEOVER: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 'f', 't', 'l', 'e', 'r')
if cur[3] == ARGV[3] then return {1, now} end
if cur[1] and not (cur[1] == 'p' and cur[3] == ARGV[1] and tonumber(cur[4]) <= now) then
  return {0, now, cur[1], cur[2], cur[3], cur[4], cur[5], cur[6]}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[2], 't', ARGV[3], 'l', now + ARGV[4], 'e', now + ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {1, now}
"""
)

# KEYS[1]; ARGV: token, response blob, ttl_ms
COMPLETE: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[2] ~= ARGV[1] then return 0 end
if cur[1] == 'c' then return 1 end
redis.call('HSET', KEYS[1], 's', 'c', 'r', ARGV[2], 'l', now, 'e', now + ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS[1]; ARGV: token
RELEASE: Final = """
local cur = redis.call('HMGET', KEYS[1], 's', 't')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS[1]; ARGV: token, lease_ms
EXTEND: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 't', 'l')
if cur[1] ~= 'p' or cur[2] ~= ARGV[1] then return 0 end
local deadline = now + ARGV[2]
if tonumber(cur[3]) < deadline then redis.call('HSET', KEYS[1], 'l', deadline) end
return 1
"""
)

# KEYS[1]
READ: Final = (
    _NOW
    + """
local cur = redis.call('HMGET', KEYS[1], 's', 'f', 't', 'l', 'e', 'r')
if not cur[1] then return {0, now} end
return {1, now, cur[1], cur[2], cur[3], cur[4], cur[5], cur[6]}
"""
)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _record(reply: list[Any]) -> Record:
    _, _, state, fingerprint, token, lease_until, expires_at, blob = reply
    return Record(
        COMPLETED if state == b"c" else IN_PROGRESS,
        fingerprint,
        int(token),
        int(lease_until) / 1000,
        int(expires_at) / 1000,
        decode_response(blob) if blob else None,
    )


class RedisBackend:
    """Idempotency records in Redis (6.2+, Valkey, Redis Cluster) through redis-py's asyncio client.

    Args:
        client: A `redis.asyncio.Redis` or `RedisCluster` made with `decode_responses=False`.
            It stays yours: `aclose()` closes only a client built by `from_url`.
        prefix: Prepended to every key, so several apps can share one Redis.
    """

    def __init__(self, client: Any, *, prefix: str = "idem:", _owned: bool = False) -> None:
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
        if kwargs.get("decode_responses") or (getattr(client, "get_encoder", None) and _decodes(client)):
            raise ConfigurationError("RedisBackend needs a client made with decode_responses=False")
        self.client = client
        self.prefix = prefix
        self._owned = _owned
        self._claim = client.register_script(CLAIM)
        self._takeover = client.register_script(TAKEOVER)
        self._complete = client.register_script(COMPLETE)
        self._release = client.register_script(RELEASE)
        self._extend = client.register_script(EXTEND)
        self._read = client.register_script(READ)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "idem:",
        max_connections: int = 256,
        timeout: float = 2.0,
        cluster: bool = False,
        **client_options: Any,
    ) -> RedisBackend:
        """Build a backend that owns its client.

        The pool blocks up to `timeout` seconds for a free connection instead of failing a
        burst (redis-py's default pool raises at 100); each command and each connect is
        bounded by `timeout` too, so an outage answers 503 in bounded time.
        """
        options: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(ExponentialBackoff(cap=0.05, base=0.01), retries=1),
            "decode_responses": False,
            **client_options,
        }
        client: Any
        if cluster:
            client = aioredis.RedisCluster.from_url(url, max_connections=max_connections, **options)
        else:
            pool = aioredis.BlockingConnectionPool.from_url(
                url, max_connections=max_connections, timeout=timeout, **options
            )
            client = aioredis.Redis(connection_pool=pool)
        return cls(client, prefix=prefix, _owned=True)

    async def __aenter__(self) -> RedisBackend:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _key(self, key: RecordKey) -> str:
        return f"{self.prefix}{{{key.digest}}}"

    async def _call(self, script: Any, key: RecordKey, *args: Any) -> Any:
        try:
            return await script(keys=[self._key(key)], args=args)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, TimeoutError, OSError) as exc:
            raise BackendUnavailable(f"redis unavailable: {exc}") from exc
        except redis_errors.RedisError as exc:
            raise BackendError(f"redis error: {exc}") from exc

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        token = random.getrandbits(62) + 1
        reply = await self._call(self._claim, key, fingerprint, token, _ms(lease), _ms(ttl))
        if reply[0] == 1:
            return Claimed(token)
        return Existing(_record(reply), reply[1] / 1000)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult:
        token = random.getrandbits(62) + 1
        reply = await self._call(self._takeover, key, stale_token, fingerprint, token, _ms(lease), _ms(ttl))
        if reply[0] == 1:
            return Claimed(token)
        return Existing(_record(reply), reply[1] / 1000)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        return bool(await self._call(self._complete, key, token, encode_response(response), _ms(ttl)))

    async def release(self, key: RecordKey, token: int) -> bool:
        return bool(await self._call(self._release, key, token))

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        return bool(await self._call(self._extend, key, token, _ms(lease)))

    async def get(self, key: RecordKey) -> Record | None:
        reply = await self._call(self._read, key)
        return _record(reply) if reply[0] == 1 else None

    async def aclose(self) -> None:
        """Close the client if `from_url` made it."""
        if self._owned:
            await self.client.aclose()
            pool = getattr(self.client, "connection_pool", None)
            if pool is not None:
                await pool.disconnect()


def _decodes(client: Any) -> bool:
    try:
        return bool(client.get_encoder().decode_responses)
    except Exception:
        return False
