"""The lean pipelined RESP connection (idem_asgi.backends.redis._resp) against real Redis servers.

Ordering uses the shared Redis (unique key prefix); anything that flushes scripts, stops, kills
or configures a server runs on a throwaway `redis-server` (the `throwaway` fixture, or
`tests.support.servers.redis_process`).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.credentials import UsernamePasswordCredentialProvider

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.backends.redis._resp import RespPool, _pack
from idem_asgi.records import Claimed, Existing, RecordKey
from tests.support.faultproxy import StoreProxy
from tests.support.servers import REDIS_URL, RedisProcess, redis_process, require, wait_until

pytestmark = pytest.mark.redis

ECHO = "return {KEYS[1], ARGV[1]}"


def rk(key: str = "key-1") -> RecordKey:
    return RecordKey.build("redis-tests", None, key)


def lean(url: str, timeout: float = 2.0, **options: object) -> RespPool:
    conn = RespPool.from_url(url, timeout=timeout, options=dict(options))
    assert conn is not None
    return conn


async def test_1000_concurrent_calls_each_get_their_own_reply_from_a_bounded_pool() -> None:
    require("redis", REDIS_URL)
    conn = RespPool.from_url(REDIS_URL, timeout=2.0, max_connections=8)
    assert conn is not None
    prefix = f"idem-test:{uuid.uuid4().hex}:"
    try:
        echo = conn.script(ECHO)
        replies = await asyncio.gather(*(echo(keys=[f"{prefix}{i}"], args=[i]) for i in range(1000)))
        assert replies == [[f"{prefix}{i}".encode(), str(i).encode()] for i in range(1000)]
        assert conn.connections == 1, "every single command shares one connection"
        # Mixed commands on the same connection, also with an error reply in the middle.
        results = await asyncio.gather(
            conn.execute("PING"), conn.execute("NOSUCHCOMMAND"), conn.execute("ECHO", b"x"), return_exceptions=True
        )
        assert results[0] == b"PONG" and results[2] == b"x"
        assert isinstance(results[1], redis_errors.ResponseError)
    finally:
        await conn.aclose()


async def test_one_connection_pipelines_replies_in_order() -> None:
    """The protocol under the pool: many calls written back to back resolve in FIFO order."""
    require("redis", REDIS_URL)
    conn = RespPool.from_url(REDIS_URL, timeout=2.0, max_connections=1)
    assert conn is not None
    try:
        await conn.execute("PING")
        proto = conn._shared
        assert proto is not None
        futures = [proto.send(_pack(("ECHO", i))) for i in range(1000)]
        futures.insert(500, proto.send(_pack(("NOSUCHCOMMAND",))))
        results = await asyncio.gather(*futures, return_exceptions=True)
        assert isinstance(results.pop(500), redis_errors.ResponseError)
        assert results == [str(i).encode() for i in range(1000)]
    finally:
        await conn.aclose()


async def test_calls_of_one_event_loop_turn_go_out_in_one_write_and_a_cancelled_one_keeps_the_connection(
    throwaway: RedisProcess,
) -> None:
    """Auto-pipelining: 100 calls made in one turn are one write on the shared connection; a caller
    cancelled while its reply is on the way leaves the connection (and the others' replies) be."""
    conn = RespPool.from_url(throwaway.url, timeout=2.0)
    assert conn is not None
    try:
        assert await conn.execute("PING") == b"PONG"
        proto = conn._shared
        assert proto is not None
        writes: list[int] = []
        real_write = proto.transport.write

        def counted(data: bytes) -> None:
            writes.append(len(data))
            real_write(data)

        proto.transport.write = counted
        blocker = asyncio.ensure_future(conn.execute("DEBUG", "SLEEP", "0.2"))
        calls = [asyncio.ensure_future(conn.execute("ECHO", i)) for i in range(100)]
        await asyncio.sleep(0.05)
        assert len(writes) == 1, writes
        calls[50].cancel()
        assert await blocker == b"OK"
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results.pop(50), asyncio.CancelledError)
        assert results == [str(i).encode() for i in range(100) if i != 50]
        assert conn._shared is proto and not proto.closed and conn.connections == 1
    finally:
        await conn.aclose()


async def test_a_full_pool_waits_then_times_out(throwaway: RedisProcess) -> None:
    """`execute_many` (a pipeline with a connection to itself) waits for a pooled one."""
    conn = RespPool.from_url(throwaway.url, timeout=0.3, max_connections=1)
    assert conn is not None
    try:
        slow = asyncio.ensure_future(conn.execute_many(("DEBUG", "SLEEP", "0.1")))
        assert await conn.execute_many(("PING",)) == [b"PONG"]  # waited for the only connection
        assert await slow == [b"OK"]
        held = conn._idle.pop()  # as a call does: it holds the only connection
        started = time.monotonic()
        with pytest.raises(redis_errors.TimeoutError, match="no free redis connection"):
            await conn.execute_many(("PING",))
        assert 0.25 < time.monotonic() - started < 0.5
        conn._release(held)
        assert await conn.execute_many(("PING",)) == [b"PONG"]
        assert conn.connections == 1
    finally:
        await conn.aclose()


def test_from_url_refuses_what_it_does_not_support() -> None:
    assert RespPool.from_url("rediss://h:6380/0", timeout=1, options={}) is None
    assert RespPool.from_url("redis://h/0?protocol=3", timeout=1, options={}) is None
    assert RespPool.from_url("redis://h/0", timeout=1, options={"ssl_ca_certs": "x"}) is None
    timed = lean("redis://h/0?socket_timeout=3&socket_connect_timeout=0.5", timeout=1)
    assert (timed.timeout, timed.connect_timeout) == (3, 0.5)  # redis-py's socket timeouts, as it reads them
    conn = lean("redis://alice:s%40cret@example:7000/5")
    assert (conn.host, conn.port, conn.username, conn.password, conn.db) == ("example", 7000, "alice", "s@cret", 5)
    conn = lean("unix:///run/redis.sock?db=3", password="pw")
    assert (conn.path, conn.db, conn.password) == ("/run/redis.sock", 3, "pw")
    assert lean("redis://localhost").db == 0


async def test_noscript_falls_back_and_the_script_is_cached_again(throwaway: RedisProcess) -> None:
    conn = lean(throwaway.url)
    admin = aioredis.Redis(port=throwaway.port)
    try:
        echo = conn.script(ECHO)
        assert await echo(keys=["k"], args=[1]) == [b"k", b"1"]
        await admin.script_flush()
        assert await echo(keys=["k"], args=[2]) == [b"k", b"2"]
        assert await admin.script_exists(echo.sha) == [True]
    finally:
        await admin.aclose()
        await conn.aclose()


async def test_a_call_on_a_stalled_server_waits_out_the_timeout_once_pool_wait_included(
    throwaway: RedisProcess,
) -> None:
    """A call that first waits for a pooled connection (the one connection is stuck on the stalled
    server), then gets a slot and connects, still fails `timeout` after it began: one deadline for
    the pool wait, the connect and the reply (with two, it took 2 x timeout)."""
    conn = RespPool.from_url(throwaway.url, timeout=0.4, max_connections=1)
    assert conn is not None
    try:
        assert await conn.execute_many(("PING",)) == [b"PONG"]
        throwaway.signal(signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(conn.execute_many(("INCR", "n")))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            with pytest.raises(redis_errors.TimeoutError):
                await conn.execute_many(("INCR", "n"))  # waits for the slot, gets it at 0.3 s, connects, sends
            elapsed = time.monotonic() - started
            with pytest.raises(redis_errors.TimeoutError):
                await first
        finally:
            throwaway.signal(signal.SIGCONT)
        assert 0.35 < elapsed < 0.55, elapsed
        assert await conn.execute_many(("PING",)) == [b"PONG"]
    finally:
        await conn.aclose()


async def test_stalled_server_times_out_aborts_and_reconnects(throwaway: RedisProcess) -> None:
    conn = lean(throwaway.url, timeout=0.3)
    admin = aioredis.Redis(port=throwaway.port)
    try:
        assert await conn.execute("PING") == b"PONG"
        throwaway.signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            results = await asyncio.gather(*(conn.execute("INCR", "n") for _ in range(5)), return_exceptions=True)
            elapsed = time.monotonic() - started
            assert all(isinstance(r, redis_errors.TimeoutError) for r in results), results
            assert 0.25 < elapsed < 0.6, elapsed
        finally:
            throwaway.signal(signal.SIGCONT)
        # The stuck connection was aborted: a new one answers, and the old one is gone.
        assert await conn.execute("PING") == b"PONG"
        clients = await admin.client_list()
        assert len(clients) == 2, clients  # admin + the lean connection
    finally:
        await admin.aclose()
        await conn.aclose()


async def test_killed_server_fails_pending_calls_then_reconnects(throwaway: RedisProcess) -> None:
    conn = lean(throwaway.url, timeout=1.0)
    try:
        assert await conn.execute("PING") == b"PONG"
        slow = asyncio.ensure_future(conn.execute("DEBUG", "SLEEP", "0.5"))
        await asyncio.sleep(0.1)
        throwaway.kill()
        with pytest.raises(redis_errors.ConnectionError):
            await slow
        with pytest.raises(redis_errors.ConnectionError):
            await conn.execute("PING")  # refused at once, not after the timeout
        throwaway.start()
        assert await conn.execute("PING") == b"PONG"
    finally:
        await conn.aclose()


async def test_backend_survives_a_restart_with_one_retry(throwaway: RedisProcess) -> None:
    async with RedisBackend.from_url(throwaway.url, timeout=1.0) as backend:
        assert backend._lean is not None
        assert isinstance(await backend.claim(rk("a"), b"fp", lease=30, ttl=60), Claimed)
        throwaway.kill()
        throwaway.start()
        # The pooled connection is dead; the first call after the restart retries on a new one.
        assert isinstance(await backend.claim(rk("b"), b"fp", lease=30, ttl=60), Claimed)


def test_from_client_takes_a_plain_clients_address_and_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    def pool(client: object) -> RespPool | None:
        return RespPool.from_client(client, timeout=1.5)

    given = aioredis.Redis(host="example", port=7000, db=5, username="alice", password="pw", socket_timeout=3)
    tcp = pool(given)
    assert tcp is not None
    assert (tcp.host, tcp.port, tcp.db, tcp.username, tcp.password) == ("example", 7000, 5, "alice", "pw")
    assert tcp.timeout == 3
    assert tcp.max_connections == min(256, given.connection_pool.max_connections)
    unix = pool(aioredis.Redis(unix_socket_path="/run/r.sock", db=2, socket_timeout=None))
    assert unix is not None and (unix.path, unix.db, unix.timeout) == ("/run/r.sock", 2, 1.5)
    blocking = aioredis.BlockingConnectionPool(host="h", max_connections=12)
    bounded = pool(aioredis.Redis(connection_pool=blocking))
    assert bounded is not None and bounded.max_connections == 12
    refused = [
        aioredis.Redis(host="h", ssl=True),
        aioredis.Redis(host="h", protocol=3),
        aioredis.Redis(host="h", client_name="billing"),
        aioredis.Redis(host="h", decode_responses=True),
        aioredis.Redis(host="h", credential_provider=UsernamePasswordCredentialProvider("u", "p")),
        aioredis.Sentinel([("h", 26379)]).master_for("mymaster"),  # type: ignore[no-untyped-call]  # untyped in redis-py
        aioredis.RedisCluster(host="h", port=7000),
    ]
    assert [pool(c) for c in refused] == [None] * len(refused)


async def test_a_users_own_client_serves_the_ops_tools_and_the_lean_pool_the_requests(tmp_path: Path) -> None:
    with redis_process(tmp_path / "redis") as server:
        async with aioredis.Redis(port=server.port) as setup:
            await setup.config_set("requirepass", "s3cret")
        client = aioredis.Redis(port=server.port, password="s3cret", db=3, socket_timeout=2)
        try:
            async with RedisBackend(client, prefix="own:") as backend:
                assert backend._lean is not None and (backend._lean.db, backend._lean.password) == (3, "s3cret")
                claimed = await backend.claim(rk(), b"fp", lease=30, ttl=60)
                assert isinstance(claimed, Claimed)
                assert isinstance(await backend.claim(rk(), b"fp", lease=30, ttl=60), Existing)
                assert [s.key.digest for s in await backend.stale(older_than=-3600)] == [rk().digest]
                assert await client.ping()  # still the user's, and still open after aclose below
            assert await client.dbsize() == 1
            listed = await client.client_list()
            assert len(listed) == 1, "the lean pool's connections close with the backend"
        finally:
            await client.aclose()


async def test_auth_and_select_from_the_url(tmp_path: Path) -> None:
    with redis_process(tmp_path / "redis") as server:
        admin = aioredis.Redis(port=server.port, password="s3cret")
        try:
            async with aioredis.Redis(port=server.port) as setup:
                await setup.execute_command("ACL", "SETUSER", "app", "on", ">apppw", "~*", "+@all")  # type: ignore[no-untyped-call]  # untyped in redis-py
                await setup.config_set("requirepass", "s3cret")
            for url in (f"redis://:s3cret@127.0.0.1:{server.port}/4", f"redis://app:apppw@127.0.0.1:{server.port}/4"):
                conn = lean(url)
                try:
                    assert await conn.execute("SET", "where", url) == b"OK"
                finally:
                    await conn.aclose()
                assert await admin.execute_command("SELECT", 4) and await admin.get("where") == url.encode()  # type: ignore[no-untyped-call]  # untyped in redis-py
                await admin.execute_command("SELECT", 0)  # type: ignore[no-untyped-call]  # untyped in redis-py
            bad = lean(f"redis://:wrong@127.0.0.1:{server.port}/0")
            try:
                with pytest.raises(redis_errors.AuthenticationError):
                    await bad.execute("PING")
            finally:
                await bad.aclose()
            async with RedisBackend.from_url(f"redis://:s3cret@127.0.0.1:{server.port}/4") as backend:
                assert backend._lean is not None and backend._lean.db == 4
                claimed = await backend.claim(rk(), b"fp", lease=30, ttl=60)
                assert isinstance(claimed, Claimed)
                assert isinstance(await backend.claim(rk(), b"fp", lease=30, ttl=60), Existing)
                assert [s.key.digest for s in await backend.stale(older_than=-3600)] == [rk().digest]
        finally:
            await admin.aclose()


async def test_unix_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "redis.sock")
    with redis_process(tmp_path / "redis", port=0, args=["--unixsocket", path, "--unixsocketperm", "700"]):
        conn = lean(f"unix://{path}?db=2")
        try:
            assert conn.path == path and conn.db == 2
            assert sorted(await asyncio.gather(*(conn.execute("INCR", "n") for _ in range(100)))) == list(range(1, 101))
        finally:
            await conn.aclose()


async def test_aclose_fails_pending_calls_and_refuses_new_ones(throwaway: RedisProcess) -> None:
    conn = lean(throwaway.url)
    slow = asyncio.ensure_future(conn.execute("DEBUG", "SLEEP", "0.3"))
    await asyncio.sleep(0.05)
    await conn.aclose()
    with pytest.raises(redis_errors.ConnectionError):
        await slow
    with pytest.raises(redis_errors.ConnectionError):
        await conn.execute("PING")


async def _parked(conn: RespPool, call: asyncio.Future[Any]) -> None:
    """Until `call` waits in the queue of a pool whose connections are all taken."""
    for _ in range(1000):
        if conn._waiters:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the call never waited for a connection: {call!r}")


async def test_a_waiter_cancelled_in_an_exhausted_pool_is_cancelled_not_timed_out() -> None:
    """Cancellation propagates as redis-py's pool lets it (it was reported as `no free redis connection`)."""
    require("redis", REDIS_URL)
    conn = RespPool.from_url(REDIS_URL, timeout=5.0, max_connections=1)
    assert conn is not None
    try:
        assert await conn.execute_many(("PING",)) == [b"PONG"]
        held = conn._idle.pop()  # as a call does: it holds the only connection
        waiter = asyncio.ensure_future(conn.execute_many(("PING",)))
        await _parked(conn, waiter)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert waiter.cancelled()
        conn._release(held)  # nobody waits any more: it goes back to the idle list, and serves
        assert not conn._waiters and conn._idle == [held]
        assert await conn.execute_many(("PING",)) == [b"PONG"] and conn.connections == 1
    finally:
        await conn.aclose()


async def test_a_cancelled_request_waiting_for_its_claim_s_reply_never_runs_fail_open(throwaway: RedisProcess) -> None:
    """Under `fail_open`, a request cancelled (client gone, server shutting down) while its claim waits
    for Redis's reply is cancelled: the app is never run unclaimed, and the claim, which may land
    later, is swept, so the retry runs it once."""
    from idem_asgi import IdempotencyMiddleware, RoutePolicy
    from tests.support.pay import Payments, post

    app = Payments()
    async with RedisBackend.from_url(throwaway.url, prefix=f"idem-test:{uuid.uuid4().hex}:") as backend:
        mw = IdempotencyMiddleware(
            app, backend=backend, routes=[RoutePolicy("/pay", single_tenant=True)], on_store_error="fail_open"
        )
        assert (await post(mw, "warm-up")).status == 201
        throwaway.signal(signal.SIGSTOP)
        try:
            request = asyncio.ensure_future(post(mw, "cancelled-while-waiting"))
            await asyncio.sleep(0.2)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        finally:
            throwaway.signal(signal.SIGCONT)
        assert app.runs["cancelled-while-waiting"] == 0
        await wait_until(lambda: backend.pending_orphans == 0, 10)
        retry = await post(mw, "cancelled-while-waiting")  # nothing ran, nothing is held: the retry runs it
        assert retry.status == 201 and app.runs["cancelled-while-waiting"] == 1


@pytest.mark.parametrize(
    "reply",
    [
        "NOSCRIPT No matching script. Please use EVAL.",
        "ERR max number of clients reached",
        "ERR invalid password",
        "ERR unknown command 'EVALSHA', with args beginning with: ",
        "WRONGPASS invalid username-password pair or user is disabled.",
        "NOAUTH Authentication required.",
        "NOPERM this user has no permissions to run the 'evalsha' command",
        "READONLY You can't write against a read only replica.",
        "LOADING Redis is loading the dataset in memory",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "BUSY Redis is busy running a script.",
    ],
)
def test_an_error_reply_becomes_the_exception_redis_py_raises(reply: str) -> None:
    """The lean pool's own table (no import of redis-py's private parser) agrees with redis-py's."""
    import hiredis
    from redis._parsers.base import BaseParser  # the test may look: it tells when redis-py changes

    from idem_asgi.backends.redis._replies import error

    ours, theirs = error(hiredis.ReplyError(reply)), BaseParser.parse_error(reply)  # type: ignore[no-untyped-call]
    assert (type(ours), str(ours)) == (type(theirs), str(theirs))


async def test_a_reply_still_arriving_is_late_not_stalled(throwaway: RedisProcess) -> None:
    """A 1 MiB reply that trickles in over about 0.8 s (a proxy holds each 64 KiB read 50 ms) on a
    0.3 s timeout: bytes keep arriving, so the call gets its whole reply instead of a timeout that
    drops the connection; a reply with no byte for 0.5 s still fails at the timeout."""
    admin = aioredis.Redis(port=throwaway.port)
    value = bytes(range(256)) * 4096
    await admin.set("big", value)
    async with StoreProxy(throwaway.port, protocol="raw") as proxy:
        conn = RespPool.from_url(f"redis://127.0.0.1:{proxy.port}/0", timeout=0.3)
        assert conn is not None
        try:
            assert await conn.execute("PING") == b"PONG"
            proxy.delay(0.05)
            started = time.monotonic()
            assert await conn.execute_alone("GET", "big") == value
            took = time.monotonic() - started
            assert took > 0.45, f"{took:.2f} s: the reply did not outlast the timeout, nothing was shown"
            proxy.delay(0.5)
            started = time.monotonic()
            with pytest.raises(redis_errors.TimeoutError):
                await conn.execute("PING")
            assert time.monotonic() - started < 0.45
        finally:
            await conn.aclose()
            await admin.aclose()
