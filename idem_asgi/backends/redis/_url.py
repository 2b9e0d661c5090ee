"""What a redis-py connection pool was configured with, as the lean pool (`_resp.RespPool`) reads it.

A URL and `from_url`'s options are parsed once, by redis-py itself (`ConnectionPool.from_url`), and
the lean pool takes its host, port, socket path, db and credentials from that pool's
`connection_kwargs`: so the request path (lean pool) and the ops tools (the redis-py client) never
disagree on which server or database they use (`redis://h/8?db=`, `redis://h/9/`, a `?db=` with a
path, ...: redis-py's rules, whatever its version). The lean pool serves only connections it can
make exactly as asked; anything else it does not do (TLS, RESP3, a client name, a credential
provider, health checks, retry on timeout, an option it does not know) leaves every call to
redis-py. An option redis-py's connections do not take at all is refused up front
(`ConfigurationError`), not at the first request.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from redis.asyncio.connection import Connection, UnixDomainSocketConnection

from ...errors import ConfigurationError

HONOURED: Final = frozenset(
    {"host", "port", "path", "db", "username", "password", "socket_timeout", "socket_connect_timeout"}
)
"""Connection options the lean pool applies itself."""

NEUTRAL: Final = frozenset(
    {
        "retry",  # the backend's own rule: once, at once, on a dropped connection (RedisBackend._call)
        "retry_on_error",
        "socket_keepalive",  # every call is bounded by its timeout; a dead idle socket fails the next call
        "socket_keepalive_options",
        "socket_read_size",
        "parser_class",
        "encoder_class",
        "legacy_responses",
        "lib_name",  # CLIENT SETINFO: informational only
        "lib_version",
        "driver_info",
        "event_dispatcher",
        "himport_registry",
        "maint_notifications_config",  # redis-py 7+: server maintenance notices (RESP3 only)
        "maint_notifications_pool_handler",
        "maintenance_state",
        "maintenance_notification_hash",
        "orig_host_address",
        "orig_socket_timeout",
        "orig_socket_connect_timeout",
        "oss_cluster_maint_notifications_handler",
    }
)
"""Connection options that change nothing the lean pool's calls send or mean."""

_UTF8: Final = ("utf-8", "utf8")
_AT_DEFAULT: Final[dict[str, Callable[[Any], bool]]] = {
    "decode_responses": lambda v: not v,
    "credential_provider": lambda v: v is None,
    "client_name": lambda v: v is None,
    "redis_connect_func": lambda v: v is None,
    "protocol": lambda v: v in (None, 2, "2"),
    "retry_on_timeout": lambda v: not v,
    "health_check_interval": lambda v: not v,
    "encoding": lambda v: str(v).lower() in _UTF8,
    "encoding_errors": lambda v: v == "strict",
    "socket_type": lambda v: not v,
}
"""Options the lean pool serves only at their default value (it does not do what another asks)."""


def lean_settings(pool: Any) -> dict[str, Any] | None:
    """The address, db and credentials of `pool`'s connections, or None when they ask for more than
    the lean pool does (redis-py then serves every call)."""
    if pool.connection_class not in (Connection, UnixDomainSocketConnection):
        return None  # TLS (SSLConnection), a custom class, Sentinel's
    kwargs: dict[str, Any] = pool.connection_kwargs
    for name, value in kwargs.items():
        if name in HONOURED or name in NEUTRAL:
            continue
        at_default = _AT_DEFAULT.get(name)
        if at_default is None or not at_default(value):
            return None
    settings: dict[str, Any] = {
        "username": kwargs.get("username"),
        "password": kwargs.get("password"),
        "db": int(kwargs.get("db") or 0),
    }
    if pool.connection_class is UnixDomainSocketConnection:
        if not kwargs.get("path"):
            return None
        settings["path"] = kwargs["path"]
    else:  # redis-py's own defaults for a URL without them
        settings["host"] = kwargs.get("host") or "localhost"
        settings["port"] = int(kwargs.get("port") or 6379)
    return settings


def check_options(pool: Any) -> None:
    """Refuse (`ConfigurationError`) options that `pool`'s connections would reject at their first
    connect (`redis://h?sockettimeout=3`): redis-py only finds out on the first request."""
    accepted: set[str] = set()
    for cls in pool.connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        accepted.update(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    unknown = sorted(set(pool.connection_kwargs) - accepted)
    if unknown:
        raise ConfigurationError(
            f"redis: unsupported connection option(s) {', '.join(map(repr, unknown))} in the URL or options "
            f"(redis-py's {pool.connection_class.__name__} takes none of them)"
        )


@dataclass(frozen=True, slots=True)
class Address:
    """Where the pool connects, and as whom (from redis-py's parse of the URL or client)."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None  # a unix socket
    username: str | None = None
    password: str | None = None
    db: int = 0
