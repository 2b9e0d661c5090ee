"""Two independent uvicorn processes on one shared store, hit by a retry storm.

200 keys x 10 concurrent duplicates, split over both instances, at most 100 requests in flight.
The app counts executions per key in Redis (INCR), the ground truth across processes. Every key
must execute exactly once, every 2xx of one key must be byte-identical, and nothing may be 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from idem_asgi.http import problems
from tests.support.servers import POSTGRES_DSN, REDIS_URL, UvicornProcess, require
from tests.support.stores import SHARED

pytestmark = pytest.mark.slow

KEYS = 200
DUPLICATES = 10
IN_FLIGHT = 100


@contextlib.asynccontextmanager
async def two_instances(env: dict[str, str], tmp: Path) -> AsyncIterator[list[UvicornProcess]]:
    """Two `uvicorn tests.storm_app:app --workers 1`, each in its own process group."""
    instances: list[UvicornProcess] = []
    try:
        for i in range(2):
            instances.append(
                UvicornProcess("tests.storm_app:app", env, tmp / f"uvicorn-{i}.log", args=["--lifespan", "on"])
            )
        for instance in instances:
            await instance.wait_ready(timeout=20)
        yield instances
    finally:
        for instance in instances:
            await asyncio.to_thread(instance.stop)


def build(method: bytes, path: str, key: str | None = None, body: bytes = b"") -> bytes:
    head = [method + b" " + path.encode() + b" HTTP/1.1", b"host: 127.0.0.1", b"content-length: %d" % len(body)]
    if key is not None:
        head += [b"idempotency-key: " + key.encode(), b"content-type: application/json"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 answer framed by Content-Length (every answer of this app and of the middleware)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return status, headers, body


async def storm(
    ports: list[int], keys: list[str], duplicates: int
) -> dict[str, list[tuple[int, dict[bytes, bytes], bytes]]]:
    """Key-major queue (a key's duplicates sit next to each other), IN_FLIGHT kept-alive connections,
    worker i on instance i % 2: each key's duplicates are in flight together on both instances."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for key in keys:
        for _ in range(duplicates):
            queue.put_nowait(key)
    answers: dict[str, list[tuple[int, dict[bytes, bytes], bytes]]] = {k: [] for k in keys}
    body = json.dumps({"amount": 1999, "currency": "EUR"}).encode()

    async def worker(i: int) -> None:
        port = ports[i % len(ports)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while not queue.empty():
                key = queue.get_nowait()
                writer.write(build(b"POST", "/pay", key, body))
                await writer.drain()
                status, headers, data = await asyncio.wait_for(read_answer(reader), 15)
                answers[key].append((status, headers, data))
                if headers.get(b"connection") == b"close":
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(IN_FLIGHT))), 60)
    return answers


@pytest.fixture(params=SHARED)
def store(request: pytest.FixtureRequest) -> str:
    require("redis", REDIS_URL)  # the execution counter lives in Redis either way
    if request.param == "postgres":
        require("postgres", POSTGRES_DSN)
        return POSTGRES_DSN
    return REDIS_URL


async def cleanup(store: str, namespace: str, counter: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for pattern in (f"{counter}*", f"idem-storm:{namespace}:*"):
            names = [k async for k in client.scan_iter(match=pattern, count=1000)]
            for i in range(0, len(names), 500):
                await client.delete(*names[i : i + 500])
    finally:
        await client.aclose()
    if store.startswith("postgres"):
        import asyncpg

        conn = await asyncpg.connect(store)
        try:
            await conn.execute("DELETE FROM idem_storm_records WHERE namespace = $1", namespace)
        finally:
            await conn.close()


async def test_two_instances_storm_executes_each_key_exactly_once(store: str, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:12]
    namespace = f"storm-{run}"
    counter = f"idem-storm-count:{run}:"
    env = {
        **os.environ,
        "IDEM_STORM_BACKEND": store,
        "IDEM_STORM_NAMESPACE": namespace,
        "IDEM_STORM_COUNTER_URL": REDIS_URL,
        "IDEM_STORM_COUNTER": counter,
    }
    keys = [f"{run}-{i:03d}" for i in range(KEYS)]
    try:
        async with two_instances(env, tmp_path) as instances:
            started = time.monotonic()
            answers = await storm([i.port for i in instances], keys, DUPLICATES)
            elapsed = time.monotonic() - started
            late = await storm([i.port for i in instances], keys, 2)

        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            counts = [int(c or 0) for c in await client.mget([counter + k for k in keys])]
        finally:
            await client.aclose()

        executions = dict(zip(keys, counts, strict=True))
        assert sum(counts) == KEYS, {k: c for k, c in executions.items() if c != 1}
        assert all(c == 1 for c in counts), {k: c for k, c in executions.items() if c != 1}

        statuses: Counter[int] = Counter()
        replays = 0
        pids = set()
        for key, group in answers.items():
            assert len(group) == DUPLICATES, key
            ok = [body for status, _, body in group if 200 <= status < 300]
            assert ok, f"{key}: no 2xx at all"
            assert len(set(ok)) == 1, f"{key}: 2xx answers differ"
            pids.add(json.loads(ok[0])["pid"])
            for status, headers, body in group:
                statuses[status] += 1
                replays += headers.get(b"idempotent-replayed") == b"true"
                if status == 409:
                    assert json.loads(body)["type"] == problems.IN_PROGRESS.type, body
        assert set(statuses) <= {201, 409}, statuses
        assert len(pids) == 2, "both instances executed requests"
        # The late wave: every retry of a finished key, on either instance, replays the first answer.
        for key, group in late.items():
            first = next(body for status, _, body in answers[key] if status == 201)
            assert len(group) == 2, key
            for status, headers, body in group:
                assert (status, headers.get(b"idempotent-replayed"), body) == (201, b"true", first), key
        kind = store.split(":")[0]
        total = sum(statuses.values())
        print(f"\n{kind}: {total} requests in {elapsed:.1f}s, {dict(statuses)}, {replays} replays in the storm")
    finally:
        await cleanup(store, namespace, counter)
