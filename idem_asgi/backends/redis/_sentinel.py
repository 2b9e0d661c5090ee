"""`redis+sentinel://` URLs: a redis-py client whose connections ask the sentinels for the primary.

    redis+sentinel://[user:password@]host:26379[,host2:26379,...]/<service>[/<db>][?durable_replicas=N]

Claims through Sentinel are durable by default (`durable_replicas=1`): whoever runs Sentinel runs
replicas, and a failover to a replica that missed a claim hands the key to a retry (a primary
paused 4 s under a storm: 11 duplicate executions of 800 with asynchronous replication, none with
durable claims; tests/test_failover_redis.py). `?durable_replicas=0` or the keyword opts out.

User and password are the Redis servers' (the sentinels are asked without them unless
`sentinel_kwargs=` says otherwise). Every new connection asks the sentinels for the current
primary, and a connection to a primary demoted to a replica is dropped on its first `READONLY`
answer, so the client follows a failover; calls made while no primary answers fail (the backend
answers 503). The pool is redis-py's `SentinelConnectionPool`, which raises when full, so the
backend bounds its own concurrency instead (`max_concurrency`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from ...errors import ConfigurationError


def parse(url: str) -> tuple[list[tuple[str, int]], str, int, dict[str, Any]]:
    """(sentinel addresses, service name, database, credentials) of a `redis+sentinel://` URL."""
    parts = urlsplit(url)
    hosts: list[tuple[str, int]] = []
    for item in parts.netloc.rpartition("@")[2].split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep:
            host, port = port, "26379"
        if not host or not port.isdigit():
            raise ConfigurationError(f"redis+sentinel URL: bad sentinel address {item!r} (host:port)")
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigurationError(
            "redis+sentinel URL needs the service name and optionally a database: "
            "redis+sentinel://host:26379,host2:26379/mymaster/0"
        )
    credentials: dict[str, Any] = {}
    if parts.username:
        credentials["username"] = unquote(parts.username)
    if parts.password:
        credentials["password"] = unquote(parts.password)
    return hosts, unquote(path[0]), int(path[1]) if len(path) == 2 else 0, credentials


def durable_options(url: str, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the URL without its query, the backend's durable options): `given` (keywords) over the
    URL's `durable_replicas` / `durable_timeout` over the Sentinel default of 1 replica."""
    base, _, query = url.partition("?")
    options: dict[str, Any] = {"durable_replicas": 1}
    for name, value in parse_qsl(query, keep_blank_values=True):
        parse = {"durable_replicas": int, "durable_timeout": float}.get(name)
        if parse is None:
            raise ConfigurationError(f"redis+sentinel URL: unknown option {name!r} (durable_replicas, durable_timeout)")
        try:
            options[name] = parse(value)
        except ValueError:
            raise ConfigurationError(f"redis+sentinel URL: {name}={value!r} is not a number") from None
    return base, {**options, **given}


def sentinel_client(url: str, *, max_connections: int, **options: Any) -> tuple[Any, Any]:
    """(client of the service's primary, the `Sentinel` it asks): both closed by the backend."""
    from redis.asyncio.sentinel import Sentinel

    hosts, service, db, credentials = parse(url)
    sentinel_kwargs = options.pop("sentinel_kwargs", None)
    if sentinel_kwargs is None:
        # The same time limits and the same single retry for the sentinels as for the servers:
        # with redis-py's default (three retries, backing off) two sentinels that refuse took 15 s
        # to say so on a 2 s timeout.
        sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **options)  # type: ignore[no-untyped-call]
    client = sentinel.master_for(service, db=db, max_connections=max_connections, **credentials)
    return client, sentinel
