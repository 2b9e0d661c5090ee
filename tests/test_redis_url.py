"""`RedisBackend.from_url` reads a URL exactly as redis-py does: the lean pool (the request path) and the
redis-py client (the ops tools) use the same server, db and credentials for every form redis-py
documents, and an option nobody takes is refused at once instead of failing the first request."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.records import Claimed, RecordKey
from tests.support.servers import REDIS_URL, require

pytestmark = pytest.mark.redis

# The forms of redis-py's `Redis.from_url` docstring (redis://, rediss://, unix://; the db in the
# path or in `?db=`, which wins; user and password, percent-encoded), and its edge cases.
LEAN_FORMS = [
    "redis://localhost",
    "redis://h",
    "redis://h:7000",
    "redis://h/8",
    "redis://h/8?db=",  # a blank ?db= is no db: the path's 8 (claims went to db 0 here)
    "redis://h/9/",  # redis-py drops the slashes: db 9 (refused as invalid here)
    "redis://h/8?db=3",
    "redis://h?db=4",
    "redis://h/3?db=5&db=6",  # the first value
    "redis://h/not-a-number",  # ignored: db 0
    "redis://h/0/1",
    "redis://:s3cret@h/2",
    "redis://alice:s%40cret@h:7000/5",
    "redis://alice@h",
    "redis://[::1]:7000/1",
    "redis://h/1?socket_timeout=3&socket_connect_timeout=0.5",
    "redis://h?max_connections=5",
    "unix:///run/redis.sock",
    "unix:///run/redis.sock?db=3",
    "unix://:pw@/run/redis.sock?db=3",
    "unix://alice:pw@/run/redis.sock",
]
REDIS_PY_ONLY = [  # what the lean pool does not do: redis-py serves every call, as configured
    "rediss://h:6380/1",
    "rediss://alice:pw@h/2?ssl_cert_reqs=none&ssl_check_hostname=false",
    "redis://h?protocol=3",
    "redis://h/2?client_name=billing",
    "redis://h?retry_on_timeout=true",
    "redis://h?health_check_interval=30",
]
ADDRESS = ("host", "port", "path", "db", "username", "password")


def address(pool: Any) -> dict[str, Any]:
    """host, port, path, db, username and password a redis-py pool's connections use."""
    kwargs = pool.connection_kwargs
    unix = "path" in kwargs
    defaults: dict[str, Any] = {"host": None if unix else "localhost", "port": None if unix else 6379, "db": 0}
    return {name: kwargs.get(name, defaults.get(name)) for name in ADDRESS}


def redis_py(url: str) -> dict[str, Any]:
    """Where redis-py's own client would connect for `url`."""
    return address(aioredis.Redis.from_url(url).connection_pool)


def chosen(backend: RedisBackend) -> dict[str, Any]:
    lean = backend._lean
    assert lean is not None
    address = {name: getattr(lean, name) for name in ADDRESS}
    if lean.path is not None:
        address["host"] = address["port"] = None
    return address


@pytest.mark.parametrize("url", LEAN_FORMS)
async def test_the_lean_pool_connects_where_redis_py_does(url: str) -> None:
    async with RedisBackend.from_url(url) as backend:
        assert chosen(backend) == redis_py(url)
        assert address(backend.client.connection_pool) == redis_py(url)  # the ops tools' client: the same place


def test_redis_py_timeouts_and_pool_size_from_the_url_hold_for_the_lean_pool() -> None:
    backend = RedisBackend.from_url("redis://h/1?socket_timeout=3&socket_connect_timeout=0.5&max_connections=5")
    lean = backend._lean
    assert lean is not None
    assert (lean.timeout, lean.connect_timeout, lean.max_connections) == (3, 0.5, 5)
    assert backend.client.connection_pool.max_connections == 5


@pytest.mark.parametrize("url", REDIS_PY_ONLY)
async def test_what_the_lean_pool_does_not_do_is_left_to_redis_py(url: str) -> None:
    async with RedisBackend.from_url(url) as backend:
        assert backend._lean is None
        ours = backend.client.connection_pool
        theirs = aioredis.Redis.from_url(url).connection_pool
        assert ours.connection_class is theirs.connection_class
        if url.startswith("rediss://"):
            assert ours.connection_class is SSLConnection
        for name, value in theirs.connection_kwargs.items():
            if name in ADDRESS or name.startswith(("ssl_", "protocol", "client_name", "retry_on", "health")):
                assert ours.connection_kwargs[name] == value, name


@pytest.mark.parametrize(
    ("url", "options", "named"),
    [
        ("redis://h?foo=bar", {}, "foo"),
        ("redis://h/1?sockettimeout=3", {}, "sockettimeout"),
        ("redis://h/1", {"ssl_ca_certs": "/etc/ca.pem"}, "ssl_ca_certs"),  # TLS options on a plain connection
        ("unix:///run/redis.sock?host=h", {}, "host"),
    ],
)
def test_an_option_redis_py_connections_do_not_take_is_refused_up_front(
    url: str, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named):
        RedisBackend.from_url(url, **options)


@pytest.mark.parametrize("path", ["/8?db=", "/9/"])
async def test_claims_and_the_ops_tools_use_the_db_redis_py_chooses(path: str) -> None:
    """A claim made through the lean pool is where the redis-py client (stale, migrate) looks for it."""
    require("redis", REDIS_URL)
    base = REDIS_URL.rsplit("/", 1)[0] if REDIS_URL.count("/") > 2 else REDIS_URL
    url = base + path
    db = int(path.strip("/").partition("?")[0])
    prefix = f"idem-test:{uuid.uuid4().hex}:"
    key = RecordKey.build("url-tests", None, "pay-1")
    admin = aioredis.Redis.from_url(base + f"/{db}")
    other = aioredis.Redis.from_url(base + "/0")
    try:
        async with RedisBackend.from_url(url, prefix=prefix) as backend:
            assert isinstance(await backend.claim(key, b"fp", lease=0.001, ttl=60), Claimed)
            listed = await backend.stale(older_than=-3600)
        assert [s.key.digest for s in listed] == [key.digest]
        assert await admin.exists(f"{prefix}{{{key.digest}}}") == 1
        assert db == 0 or await other.exists(f"{prefix}{{{key.digest}}}") == 0
    finally:
        await admin.delete(f"{prefix}{{{key.digest}}}")
        await admin.aclose()
        await other.aclose()
