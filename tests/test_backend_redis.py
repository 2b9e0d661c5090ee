"""RedisBackend on real servers: script loading, key layout, bursts, unix sockets, ownership, outages.

Backend-only tests use the shared Redis (unique key prefixes, never a global command). Anything
that flushes scripts, pauses, stops or kills a server runs on a throwaway `redis-server` (the
`throwaway` fixture, `tests.support.servers.redis_process`) on a free port, killed (process group,
SIGKILL) on teardown even when the test fails.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy, backend_from_url
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.backends.redis._connect import Implementation
from idem_asgi.errors import BackendUnavailable, ConfigurationError
from idem_asgi.records import Claimed, Existing, RecordKey, StoredResponse, encode_response
from tests.support.pay import Answer, Payments, post
from tests.support.servers import REDIS_URL, RedisProcess, redis_process, require, wait_until
from tests.support.stores import make_backend

pytestmark = pytest.mark.redis

DAY = 86_400.0
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b'{"ok":true}')


@pytest.fixture
def prefix() -> str:
    return f"idem-test:{uuid.uuid4().hex}:"


@pytest.fixture
async def shared(prefix: str) -> AsyncIterator[RedisBackend]:
    """A backend on the shared Redis under a key prefix no other test uses."""
    backend = await make_backend("redis", prefix=prefix)
    try:
        yield backend
    finally:
        await backend.aclose()


def rk(key: str = "key-1", scope: str | None = None) -> RecordKey:
    return RecordKey.build("redis-tests", scope, key)


async def commandstats(client: Any) -> dict[str, int]:
    """Calls per command from INFO commandstats (`evalsha`, `script|load`, ...)."""
    info = await client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in info.items()}


# -- scripts ---------------------------------------------------------------------------------


async def test_scripts_are_registered_once_and_survive_script_flush(throwaway: RedisProcess) -> None:
    async with RedisBackend.from_url(throwaway.url, prefix="idem:") as backend:
        script = backend._claim
        first = await backend.claim(rk("a"), b"fp", lease=30, ttl=DAY)
        assert isinstance(first, Claimed)
        before = await commandstats(backend.client)
        for i in range(20):
            assert isinstance(await backend.claim(rk(f"b{i}"), b"fp", lease=30, ttl=DAY), Claimed)
        after = await commandstats(backend.client)
        assert after["evalsha"] - before["evalsha"] == 20
        assert after.get("script|load", 0) == before.get("script|load", 0)
        assert after.get("eval", 0) == before.get("eval", 0)

        await backend.client.script_flush()
        again = await backend.claim(rk("c"), b"fp", lease=30, ttl=DAY)
        assert isinstance(again, Claimed)
        assert await backend.complete(rk("c"), again.token, RESPONSE, ttl=DAY)
        replay = await backend.claim(rk("c"), b"fp", lease=30, ttl=DAY)
        assert isinstance(replay, Existing) and replay.record.response == RESPONSE
        flushed = await commandstats(backend.client)
        # NOSCRIPT once per script used after the flush (claim, complete), then EVALSHA again.
        assert flushed["script|load"] - after.get("script|load", 0) == 2
        assert backend._claim is script
        for i in range(10):
            await backend.claim(rk(f"d{i}"), b"fp", lease=30, ttl=DAY)
        final = await commandstats(backend.client)
        assert final["script|load"] == flushed["script|load"]
        assert final["evalsha"] - flushed["evalsha"] == 10


async def test_decode_responses_client_is_refused() -> None:
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=True)
    try:
        with pytest.raises(ConfigurationError, match="decode_responses"):
            RedisBackend(client)
    finally:
        await client.aclose()
    with pytest.raises(ConfigurationError, match="decode_responses"):
        RedisBackend.from_url(REDIS_URL, decode_responses=True)


async def test_key_is_prefix_and_sha256_and_never_client_characters(shared: RedisBackend, prefix: str) -> None:
    hostile = ["{tag}", "*", "a:b", "[x]", "?", "key with\\backslash", "}{", "x" * 255]
    expected = set()
    for key in hostile:
        record_key = RecordKey.build("redis-tests", "tenant{1}", key)
        claimed = await shared.claim(record_key, b"fp", lease=30, ttl=60)
        assert isinstance(claimed, Claimed), key
        expected.add(f"{prefix}{{{record_key.digest}}}")
    found = {k.decode() async for k in shared.client.scan_iter(match=f"{prefix}*", count=1000)}
    assert found == expected
    pattern = re.compile(re.escape(prefix) + r"\{[0-9a-f]{64}\}")
    for name in found:
        assert pattern.fullmatch(name), name
        tail = name[len(prefix) :]
        assert all(key not in tail for key in hostile if key not in ("x" * 255,)), name
    assert len(found) == len(hostile)


async def test_retried_claim_with_the_same_token_is_claimed_not_a_conflict(shared: RedisBackend) -> None:
    """A claim whose reply was lost and that the driver sends again must find its own claim."""
    name = shared._key(rk())
    token = 123_456_789
    args = (b"fp", token, 30_000, 60_000)
    first = await shared.client.evalsha(shared._claim.sha, 1, name, *args)
    second = await shared.client.evalsha(shared._claim.sha, 1, name, *args)
    assert first[0] == 1 and second[0] == 1
    other = await shared.claim(rk(), b"fp", lease=30, ttl=60)
    assert isinstance(other, Existing) and other.record.token == token
    # The same holds for a retried completion: still 1, and the record is the first answer.
    blob_args = (token, encode_response(RESPONSE), 60_000, b"", 0)
    names = shared._keys(rk())
    assert await shared._call(shared._complete, names, *blob_args) == 1
    assert await shared._call(shared._complete, names, *blob_args) == 1
    replay = await shared.claim(rk(), b"fp", lease=30, ttl=60)
    assert isinstance(replay, Existing) and replay.record.response == RESPONSE


async def test_from_url_waits_for_the_pool_in_a_burst_of_1000(prefix: str) -> None:
    require("redis", REDIS_URL)
    async with RedisBackend.from_url(REDIS_URL, prefix=prefix, max_connections=20) as backend:
        results = await asyncio.gather(*[backend.claim(rk(), b"fp", lease=30, ttl=60) for _ in range(1000)])
        pool = backend.client.connection_pool
        assert len(pool._in_use_connections) + len(pool._available_connections) <= 20
    winners = [r for r in results if isinstance(r, Claimed)]
    assert len(winners) == 1
    assert all(isinstance(r, Existing) and r.record.token == winners[0].token for r in results if r is not winners[0])


async def test_unix_socket_url(tmp_path: Path) -> None:
    path = str(tmp_path / "redis.sock")
    with redis_process(tmp_path / "redis", port=0, args=["--unixsocket", path, "--unixsocketperm", "700"]):
        for backend in (RedisBackend.from_url(f"unix://{path}"), backend_from_url(f"unix://{path}?db=0")):
            async with backend:  # type: ignore[attr-defined]
                claimed = await backend.claim(rk(), b"fp", lease=30, ttl=60)
                if isinstance(claimed, Claimed):
                    assert await backend.complete(rk(), claimed.token, RESPONSE, ttl=60)
                replay = await backend.claim(rk(), b"fp", lease=30, ttl=60)
                assert isinstance(replay, Existing) and replay.record.response == RESPONSE


async def test_aclose_leaves_a_given_client_usable(prefix: str) -> None:
    require("redis", REDIS_URL)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        async with RedisBackend(client, prefix=prefix) as backend:
            assert isinstance(await backend.claim(rk(), b"fp", lease=30, ttl=60), Claimed)
        assert await client.ping() is True
        again = RedisBackend(client, prefix=prefix)
        assert isinstance(await again.claim(rk(), b"fp", lease=30, ttl=60), Existing)
        await again.aclose()
        assert await client.ping() is True
    finally:
        await client.aclose()


async def test_aclose_closes_what_from_url_created(prefix: str) -> None:
    require("redis", REDIS_URL)
    backend = RedisBackend.from_url(REDIS_URL, prefix=prefix)
    assert isinstance(await backend.claim(rk(), b"fp", lease=30, ttl=60), Claimed)
    pool = backend.client.connection_pool
    await backend.aclose()
    assert all(not c.is_connected for c in pool._available_connections)
    assert not pool._in_use_connections


# -- outages, through the middleware ---------------------------------------------------------

TIMEOUT = 0.5  # the backend's timeout in outage tests; 503 must come within 2x this


def protect(app: Payments, backend: RedisBackend, *, lease: float = 30) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app,
        backend=backend,
        routes=[RoutePolicy("/pay", methods=["POST"], required=True, single_tenant=True, lease=lease)],
    )


def keys(n: int) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"{run}-{i}" for i in range(n)]


def assert_unavailable(answer: Answer) -> None:
    assert answer.status == 503, (answer.status, answer.body)
    assert answer.problem == "store-unavailable"
    assert answer.headers.get(b"retry-after") is not None
    assert answer.headers.get(b"cache-control") == b"no-store"
    assert answer.elapsed < 2 * TIMEOUT, answer.elapsed


async def settle(mw: IdempotencyMiddleware, key: str, *, within: float = 8.0) -> Answer:
    """Retry `key` like a client would after a 503/409 until it gets a 2xx (bounded)."""
    deadline = time.monotonic() + within
    while True:
        answer = await post(mw, key)
        if answer.status < 300 or time.monotonic() > deadline:
            return answer
        assert answer.status in (409, 503), (answer.status, answer.body)
        assert answer.problem != "outcome-unknown", "a request that got 503 must stay retryable"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_killed_server_answers_503_in_bounded_time_then_recovers(throwaway: RedisProcess) -> None:
    app = Payments()
    async with RedisBackend.from_url(throwaway.url, timeout=TIMEOUT) as backend:
        mw = protect(app, backend)
        warm = keys(10)
        assert [a.status for a in await asyncio.gather(*(post(mw, k) for k in warm))] == [201] * 10

        throwaway.kill()
        down = keys(20)
        answers = await asyncio.gather(*(post(mw, k) for k in down + warm[:5]))
        for answer in answers:
            assert_unavailable(answer)
        assert not any(app.runs[k] for k in down)

        throwaway.start()
        fresh = keys(10)
        assert [a.status for a in await asyncio.gather(*(post(mw, k) for k in fresh))] == [201] * 10
        # The keys refused while the store was down were never run, so a retry runs them now, once.
        retried = await asyncio.gather(*(settle(mw, k) for k in down))
        assert [a.status for a in retried] == [201] * len(down)
        assert all(app.runs[k] == 1 for k in down + fresh + warm)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["client-pause-write", "sigstop"])
async def test_stalled_server_answers_503_in_bounded_time_then_recovers(throwaway: RedisProcess, how: str) -> None:
    app = Payments()
    async with RedisBackend.from_url(throwaway.url, timeout=TIMEOUT) as backend:
        mw = protect(app, backend)
        assert (await post(mw, "warm-" + uuid.uuid4().hex)).status == 201
        stalled = keys(10)
        admin = aioredis.Redis(port=throwaway.port)
        try:
            if how == "sigstop":
                throwaway.signal(signal.SIGSTOP)
            else:
                await admin.execute_command("CLIENT", "PAUSE", 2500, "WRITE")  # type: ignore[no-untyped-call]  # untyped in redis-py
            try:
                answers = await asyncio.gather(*(post(mw, k) for k in stalled))
                for answer in answers:
                    assert_unavailable(answer)
                assert not any(app.runs[k] for k in stalled)
            finally:
                if how == "sigstop":
                    throwaway.signal(signal.SIGCONT)
                else:
                    await admin.execute_command("CLIENT", "UNPAUSE")  # type: ignore[no-untyped-call]  # untyped in redis-py
        finally:
            await admin.aclose()
        retried = await asyncio.gather(*(settle(mw, k) for k in stalled))
        assert [a.status for a in retried] == [201] * len(stalled)
        assert all(app.runs[k] == 1 for k in stalled)
        await wait_until(lambda: backend.pending_orphans == 0, 5)
        assert backend.pending_orphans == 0


@pytest.mark.slow
async def test_storm_across_kill_and_restart_never_500s_nor_runs_twice(tmp_path: Path) -> None:
    """50 keys x 5 duplicates in flight while a durable Redis (appendfsync always) is killed and restarted."""
    app = Payments(delay=0.02)
    durable = ["--appendonly", "yes", "--appendfsync", "always"]
    with redis_process(tmp_path / "redis", args=durable) as server:
        async with RedisBackend.from_url(server.url, timeout=TIMEOUT) as backend:
            mw = protect(app, backend)
            storm = keys(50)

            async def one(key: str, delay: float) -> Answer:
                await asyncio.sleep(delay)
                return await post(mw, key)

            async def outage() -> None:
                await asyncio.sleep(0.25)
                server.kill()
                await asyncio.sleep(0.3)
                await asyncio.to_thread(server.start)

            # Each key's 5 duplicates start together at a random moment of a 0.8 s window.
            starts = {k: (i % 40) * 0.02 for i, k in enumerate(storm)}
            tasks = [one(k, starts[k]) for k in storm for _ in range(5)]
            answers, _ = await asyncio.gather(asyncio.gather(*tasks), outage())
            statuses = Counter(a.status for a in answers)
            assert set(statuses) <= {201, 409, 503}, statuses
            assert statuses[503] > 0 and statuses[201] > 0, statuses  # the outage really hit the storm
            assert max(app.runs.values()) == 1, app.runs
            by_key: dict[str, list[Answer]] = {}
            for key, answer in zip([k for k in storm for _ in range(5)], answers, strict=True):
                by_key.setdefault(key, []).append(answer)
            for key, group in by_key.items():
                bodies = {a.body for a in group if a.status == 201}
                assert len(bodies) <= 1, key  # every 2xx of one key is the same answer
                for answer in group:
                    if answer.status == 409:
                        assert answer.problem == "request-in-progress"

            # Afterwards: a key that never ran runs now, once. A key that ran replays, or, when its
            # completion was lost in the outage, stays in progress (409) until its lease ends; it
            # never runs again.
            ran = {k for k in storm if app.runs[k]}
            for key in storm:
                if key in ran:
                    answer = await post(mw, key)
                    assert answer.replayed or answer.problem == "request-in-progress", (answer.status, answer.body)
                else:
                    assert (await settle(mw, key)).status == 201
            assert all(app.runs[k] == 1 for k in storm), app.runs


@pytest.mark.slow
async def test_restart_without_persistence_forgets_completed_keys(throwaway: RedisProcess) -> None:
    """The documented limit: a Redis that loses its data (no AOF, failover) lets a completed key run again."""
    app = Payments()
    async with RedisBackend.from_url(throwaway.url, timeout=TIMEOUT) as backend:
        mw = protect(app, backend)
        key = keys(1)[0]
        assert (await post(mw, key)).status == 201
        assert (await post(mw, key)).replayed
        throwaway.kill()
        throwaway.start()
        again = await post(mw, key)
        assert again.status == 201 and not again.replayed
        assert app.runs[key] == 2


@pytest.mark.slow
async def test_unanswered_claim_that_lands_late_is_removed(throwaway: RedisProcess) -> None:
    """SIGSTOP: the claim sits in the server's socket buffer and runs on SIGCONT, after its caller
    answered 503. The backend removes it (fenced by its token), so the client's retry runs."""
    async with RedisBackend.from_url(throwaway.url, timeout=TIMEOUT) as backend:
        probe = aioredis.Redis(port=throwaway.port)
        try:
            assert isinstance(await backend.claim(rk("warm"), b"fp", lease=30, ttl=60), Claimed)
            throwaway.signal(signal.SIGSTOP)
            try:
                with pytest.raises(BackendUnavailable):
                    await backend.claim(rk("late"), b"fp", lease=30, ttl=60)
                assert backend.pending_orphans == 1
            finally:
                throwaway.signal(signal.SIGCONT)
            await wait_until(lambda: backend.pending_orphans == 0, 8)
            assert backend.pending_orphans == 0
            assert await probe.exists(backend._key(rk("late"))) == 0
            assert isinstance(await backend.claim(rk("late"), b"fp", lease=30, ttl=60), Claimed)
        finally:
            await probe.aclose()


async def test_the_client_serving_script_calls_is_the_one_implementation_names(prefix: str) -> None:
    """`implementation=`: "auto" takes the lean pool where it can, "redis-py" never builds it,
    "lean" refuses a client it cannot serve instead of falling back to redis-py."""
    require("redis", REDIS_URL)
    key = RecordKey.build("impl", None, uuid.uuid4().hex)
    choices: list[tuple[Implementation, bool]] = [("auto", True), ("lean", True), ("redis-py", False)]
    for implementation, lean in choices:
        async with RedisBackend.from_url(REDIS_URL, prefix=prefix, implementation=implementation) as backend:
            assert (backend._lean is not None) is lean
            claimed = await backend.claim(key, b"f", lease=5, ttl=5)
            assert isinstance(claimed, Claimed) and await backend.release(key, claimed.token)
    async with RedisBackend.from_url(REDIS_URL, prefix=prefix, client_name="ops") as backend:
        assert backend._lean is None  # "auto": the lean pool sends no CLIENT SETNAME, so redis-py serves
    with pytest.raises(ConfigurationError, match="implementation='lean' needs hiredis and a plain"):
        RedisBackend.from_url(REDIS_URL, prefix=prefix, implementation="lean", client_name="ops")
    with pytest.raises(ConfigurationError, match="implementation must be one of auto, lean, redis-py"):
        RedisBackend.from_url(REDIS_URL, implementation="hiredis")  # type: ignore[arg-type]
    client = aioredis.Redis.from_url(REDIS_URL, decode_responses=False)
    try:
        async with RedisBackend(client, implementation="redis-py") as backend:
            assert backend._lean is None
        async with RedisBackend(client) as backend:
            assert backend._lean is not None
            claimed = await backend.claim(key, b"f", lease=5, ttl=5)
            assert isinstance(claimed, Claimed) and await backend.release(key, claimed.token)
            # The calls went through the lean pool: the user's client never opened a connection.
            pool = client.connection_pool
            assert not pool._available_connections and not pool._in_use_connections
    finally:
        await client.aclose()


@pytest.mark.parametrize("implementation", ["lean", "redis-py"])
async def test_a_closed_backend_fails_every_call_and_opens_no_connection(
    throwaway: RedisProcess, implementation: Implementation
) -> None:
    """A late write or a renewal still running after `aclose()` must not reconnect (redis-py's
    client would, lazily, and nothing would close those connections)."""
    store = RedisBackend.from_url(throwaway.url, prefix="idem-closed:", implementation=implementation)
    admin = aioredis.Redis(port=throwaway.port)
    try:
        key = RecordKey.build("closed", None, "k-1")
        claimed = await store.claim(key, b"f", lease=10, ttl=60)
        assert isinstance(claimed, Claimed)
        await store.aclose()
        before = len(await admin.client_list())
        for call in (
            store.claim(key, b"f", lease=10, ttl=60),
            store.complete(key, claimed.token, StoredResponse(201, [], b"{}"), ttl=60),
            store.release(key, claimed.token),
            store.get(key),
            store.stale(0),
        ):
            with pytest.raises(BackendUnavailable, match="closed"):
                await call
        assert len(await admin.client_list()) == before, "nothing reconnected"
    finally:
        await admin.aclose()
