"""Big stored answers never stall the small calls of other requests (Redis).

A route with `max_stored_body` raised to 64 MiB stores a 32 MiB answer; 12 repeats of it at once,
and 100 new keys on another route of the same worker meanwhile. Before: each repeat's claim reply
carried the whole answer down the one connection every call shares, the small replies queued
behind 384 MiB, and the watchdog dropped the connection with every call on it once the oldest
reply was 2 s late: 100 of 100 small requests got 503. Now a script leaves an answer above
`APART` out of its reply (giving its size), the caller reads it alone on a connection of its own,
and a connection is judged stalled only when no bytes arrived for `timeout`.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from idem_asgi.backends import RedisBackend
from idem_asgi.backends.redis._scripts import APART
from idem_asgi.records import Claimed, Existing, RecordKey, StoredResponse
from tests.support.scorecard import build_post, read_response
from tests.support.servers import REDIS_URL, UvicornProcess, require

pytestmark = pytest.mark.redis
SIZE = 32 << 20


async def post(port: int, path: str, key: str) -> tuple[int | str, dict[bytes, bytes], bytes, float]:
    began = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 26)
    try:
        writer.write(build_post(key, b"{}", path=path))
        await writer.drain()
        status, headers, body = await asyncio.wait_for(read_response(reader), 60)
        return status, dict(headers), body, time.monotonic() - began
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        return repr(exc), {}, b"", time.monotonic() - began
    finally:
        writer.close()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[UvicornProcess, str]]:
    require("redis", REDIS_URL)
    prefix = f"idem-big-{uuid.uuid4().hex[:10]}:"
    env = {**os.environ, "IDEM_BIG_PREFIX": prefix, "IDEM_BIG_SIZE": str(SIZE)}
    proc = UvicornProcess("tests.big_answer_app:app", env, tmp_path / "uvicorn.log")
    counters = aioredis.Redis.from_url(REDIS_URL)
    try:
        await proc.wait_ready()
        yield proc, prefix
    finally:
        proc.stop()
        keys = [k async for k in counters.scan_iter(match=f"{prefix}*")]
        if keys:
            await counters.delete(*keys)
        await counters.aclose()


async def test_twelve_repeats_of_a_32_mib_answer_leave_every_small_request_served(
    server: tuple[UvicornProcess, str],
) -> None:
    proc, prefix = server
    first = await post(proc.port, "/big", "big")
    assert first[0] == 201 and len(first[2]) == SIZE, first[:2]

    async def small(i: int) -> tuple[int | str, dict[bytes, bytes], bytes, float]:
        await asyncio.sleep(i * 0.01)  # spread over the ~1 s the repeats take
        return await post(proc.port, "/small", f"small-{i}")

    repeats = [post(proc.port, "/big", "big") for _ in range(12)]
    answers = await asyncio.gather(*repeats, *(small(i) for i in range(100)))
    bigs, smalls = answers[:12], answers[12:]
    assert Counter(a[0] for a in smalls) == {201: 100}, Counter(a[0] for a in smalls)
    for status, headers, body, _ in bigs:
        assert status == 201 and headers.get(b"idempotent-replayed") == b"true", (status, headers)
        assert body == first[2]
    counters = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert int(await counters.get(f"{prefix}runs") or 0) == 1
    finally:
        await counters.aclose()


@pytest.mark.parametrize("size", [APART, APART + 1, 5 << 20])
async def test_an_answer_on_either_side_of_apart_comes_back_whole_from_claim_takeover_and_get(size: int) -> None:
    """The reply carries the blob up to APART bytes, its size above: every path reads it whole."""
    require("redis", REDIS_URL)
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-big-{uuid.uuid4().hex[:10]}:")
    key = RecordKey.build("big", None, "k")
    # The blob holds the headers and more; the body is sized so the blob lands around `size`.
    answer = StoredResponse(200, [(b"content-type", b"application/octet-stream")], os.urandom(size - 64))
    try:
        won = await store.claim(key, b"fp", lease=30, ttl=60)
        assert isinstance(won, Claimed)
        assert await store.complete(key, won.token, answer, ttl=60)
        again = await store.claim(key, b"fp", lease=30, ttl=60)
        assert isinstance(again, Existing) and again.record.response == answer
        record = await store.get(key)
        assert record is not None and record.response == answer
        taken = await store.takeover(key, won.token, b"fp", lease=30, ttl=60)  # completed: not taken over
        assert isinstance(taken, Existing) and taken.record.response == answer
    finally:
        await store.aclose()  # the record expires with its 60 s TTL, under a prefix of its own
