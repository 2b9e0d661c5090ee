"""How `RedisBackend` gets its connections: redis-py's client for a URL, and which client serves the
per-request script calls (`implementation`): the lean pool (`_resp.RespPool`) or redis-py.

`"auto"` (the default) takes the lean pool whenever the connection needs nothing it lacks (TLS,
RESP3, a client name, a credential provider, a cluster or Sentinel pool, hiredis missing), and
redis-py otherwise; `"lean"` refuses such a client (`ConfigurationError`) instead of falling back;
`"redis-py"` never builds the lean pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from ...errors import ConfigurationError
from ._url import check_options

try:
    from ._resp import RespPool
except ImportError:  # pragma: no cover - hiredis missing: redis-py serves every call
    RespPool = None  # type: ignore[assignment,misc]

Implementation = Literal["auto", "lean", "redis-py"]
IMPLEMENTATIONS: Final = ("auto", "lean", "redis-py")
_DURABLE: Final = ("durable_replicas", "durable_timeout", "store_keys", "key_secret", "history")


def lean_pool(
    client: Any, implementation: Implementation, *, timeout: float, max_connections: int = 256
) -> RespPool | None:
    """The lean pool for `client` as `implementation` asks, or None (redis-py serves every call)."""
    if implementation not in IMPLEMENTATIONS:
        raise ConfigurationError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}; got {implementation!r}")
    if implementation == "redis-py":
        return None
    lean = None if RespPool is None else RespPool.from_client(client, timeout=timeout, max_connections=max_connections)
    if lean is None and implementation == "lean":
        raise ConfigurationError(
            "implementation='lean' needs hiredis and a plain redis.asyncio.Redis over TCP or a unix socket "
            "(no TLS, RESP3, client_name, credential provider, cluster or Sentinel); use 'auto' or 'redis-py'"
        )
    return lean


def refuse_decoding(client: Any) -> None:
    """The scripts' replies are bytes: a client that decodes them to str cannot serve."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if kwargs.get("decode_responses") or (getattr(client, "get_encoder", None) and _decodes(client)):
        raise ConfigurationError("RedisBackend needs a client made with decode_responses=False")


def _decodes(client: Any) -> bool:
    try:
        return bool(client.get_encoder().decode_responses)
    except Exception:
        return False


@dataclass
class Opened:
    """What `RedisBackend.from_url` builds before the backend: the client and what goes with it."""

    client: Any
    backend_options: dict[str, Any]
    """`durable_replicas`, `durable_timeout`, `store_keys`, `key_secret`, `history` (and `max_concurrency`
    where pools raise when full)."""
    lean: RespPool | None = None
    sentinel: Any = field(default=None)


def open_url(
    url: str, *, max_connections: int, timeout: float, cluster: bool, implementation: Implementation, options: Any
) -> Opened:
    """The client for `url` (see `RedisBackend.from_url`); `options` go to redis-py, but the backend's own."""
    backend_options: dict[str, Any] = {k: options.pop(k) for k in _DURABLE if k in options}
    client_options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        # Retry once, at once, on a dropped connection (a restarted server leaves stale
        # pooled sockets); never on a timeout, which would double the time to answer 503.
        "retry": Retry(
            ExponentialBackoff(cap=0.05, base=0.01), retries=1, supported_errors=(redis_errors.ConnectionError,)
        ),
        "decode_responses": False,
        **options,
    }
    if url.lower().startswith("redis+sentinel://"):
        from ._sentinel import durable_options, sentinel_client

        # Sentinel means replicas: claims are durable unless the URL or the caller says otherwise.
        url, backend_options = durable_options(url, backend_options)
        client, sentinel = sentinel_client(url, max_connections=max_connections, **client_options)
        return Opened(client, {"max_concurrency": max_connections, **backend_options}, sentinel=sentinel)
    if cluster:
        client = aioredis.RedisCluster.from_url(url, max_connections=max_connections, **client_options)
        return Opened(client, {"max_concurrency": max_connections, **backend_options})
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout, **client_options
    )
    check_options(pool)
    client = aioredis.Redis.from_pool(pool)
    # The lean pool reads redis-py's own parse of the URL: both use one server, one db, one user.
    lean = lean_pool(client, implementation, timeout=timeout, max_connections=max_connections)
    return Opened(client, backend_options, lean=lean)
