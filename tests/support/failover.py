"""A retry storm through uvicorn while the store fails over, and what it cost: shared by the Redis
(Sentinel) and Postgres (synchronous standby) failover tests.

`run_storm` starts `tests/storm_app.py` under uvicorn on the given store URL (executions counted
in the shared Redis, never in the store that fails), sends KEYS x DUPS requests whose keys start
over WINDOW s, calls `fail_over()` KILL_AT s in, and retries 503 and 409 `request-in-progress`
like a client honouring Retry-After (bounded). Then every key once more (a completed record that
was lost would run again instead of replaying), and fresh keys (full service after). The result is
one dict: duplicates, keys never run, completed records lost, statuses, when refusals ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tests.support.servers import REDIS_URL, UvicornProcess
from tests.test_multiprocess_storm import build, read_answer

KEYS = 100
DUPS = 8
WINDOW = 4.0
KILL_AT = 1.0
IN_FLIGHT = 100
SETTLE = 30.0  # a request's retries end by then
FRESH = 10

Answer = tuple[float, int, dict[bytes, bytes], bytes]  # (time since start, status, headers, body)


async def _send(port: int, key: str, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(build(b"POST", "/pay", key, body))
        await writer.drain()
        return await asyncio.wait_for(read_answer(reader), 15)
    finally:
        writer.close()


async def _client(port: int, key: str, at: float, began: float, gate: asyncio.Semaphore) -> list[Answer]:
    """One request, retried after 503 or 409 in-progress (status 0: the connection failed)."""
    await asyncio.sleep(at)
    body = json.dumps({"amount": 1999, "currency": "EUR"}).encode()
    answers: list[Answer] = []
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        try:
            async with gate:
                status, headers, data = await _send(port, key, body)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            answers.append((time.monotonic() - began, 0, {}, repr(exc).encode()))
            await asyncio.sleep(0.2)
            continue
        answers.append((time.monotonic() - began, status, headers, data))
        in_progress = status == 409 and json.loads(data)["type"].endswith("request-in-progress")
        if status != 503 and not in_progress:
            break
        await asyncio.sleep(0.1 + random.uniform(0, 0.1))
    return answers


async def _executions(counter: str, keys: list[str]) -> dict[str, int]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        values = await client.mget([counter + k for k in keys])
        await client.delete(*[counter + k for k in keys])
    finally:
        await client.aclose()
    return {k: int(v or 0) for k, v in zip(keys, values, strict=True)}


async def run_storm(
    name: str, store_url: str, env: dict[str, str], log: Path, fail_over: Callable[[], Awaitable[None]], *, seed: str
) -> dict[str, Any]:
    """The storm and its figures (see the module docstring); `env` adds to the app's environment."""
    run = f"{name}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    counter = f"idem-failover-count:{run}:"
    rng = random.Random(seed)
    keys = [f"{run}-{i:03d}" for i in range(KEYS)]
    starts = {k: rng.uniform(0, WINDOW) for k in keys}
    schedule = [(k, starts[k] + rng.uniform(0, 0.1)) for k in keys for _ in range(DUPS)]
    fresh_keys = [f"{run}-fresh-{i}" for i in range(FRESH)]
    environment = {
        **os.environ,
        "IDEM_STORM_BACKEND": store_url,
        "IDEM_STORM_NAMESPACE": f"failover-{run}",
        "IDEM_STORM_COUNTER_URL": REDIS_URL,
        "IDEM_STORM_COUNTER": counter,
        **env,
    }
    server = UvicornProcess("tests.storm_app:app", environment, log, args=["--lifespan", "on"])
    try:
        await server.wait_ready(timeout=30)
        gate = asyncio.Semaphore(IN_FLIGHT)
        began = time.monotonic()

        async def inject() -> float:
            await asyncio.sleep(KILL_AT)
            at = time.monotonic() - began
            await fail_over()
            return at

        injecting = asyncio.create_task(inject())
        storm = await asyncio.gather(*(_client(server.port, k, at, began, gate) for k, at in schedule))
        killed_at = await injecting
        storm_s = time.monotonic() - began
        late = await asyncio.gather(*(_client(server.port, k, 0, began, gate) for k in keys))
        fresh = await asyncio.gather(*(_client(server.port, k, 0, began, gate) for k in fresh_keys))
    finally:
        await asyncio.to_thread(server.stop)

    counts = await _executions(counter, keys)
    fresh_counts = await _executions(counter, fresh_keys)
    by_key: dict[str, list[Answer]] = {k: [] for k in keys}
    for (key, _), answers in zip(schedule, storm, strict=True):
        by_key[key].extend(answers)
    statuses = Counter(a[1] for answers in storm for a in answers)
    first_2xx = {k: next((a[3] for a in sorted(v) if 200 <= a[1] < 300), None) for k, v in by_key.items()}
    lost = [
        k
        for k, answers in zip(keys, late, strict=True)
        if first_2xx[k] is not None and (answers[-1][1] >= 300 or answers[-1][3] != first_2xx[k])
    ]
    refusals = [a[0] for answers in storm for a in answers if a[1] in (0, 503)]
    return {
        "test": name,
        "requests": KEYS * DUPS,
        "keys": KEYS,
        "duplicate_executions": sum(c - 1 for c in counts.values() if c > 1),
        "keys_never_run": sum(1 for c in counts.values() if c == 0),
        "completed_records_lost": len(lost),
        "keys_with_differing_2xx": sum(1 for v in by_key.values() if len({a[3] for a in v if 200 <= a[1] < 300}) > 1),
        "statuses": {str(s): n for s, n in sorted(statuses.items())},
        "late_statuses": {str(s): n for s, n in sorted(Counter(a[-1][1] for a in late).items())},
        "fresh_ok": sum(1 for a in fresh if a[-1][1] == 201) == FRESH and list(fresh_counts.values()) == [1] * FRESH,
        "failed_over_at_s": round(killed_at, 2),
        "refused_until_s": round(max(refusals), 2) if refusals else None,
        "recovery_s": round(max(refusals) - killed_at, 2) if refusals else 0.0,
        "storm_s": round(storm_s, 2),
    }


def assert_failover_kept_the_contract(result: dict[str, Any], *, durable: bool) -> None:
    """Always: only 201/409/503, nothing refused by uvicorn, full service after, every key answered.
    Durable setups: 0 duplicates, 0 completed records lost, every key ran."""
    statuses = {int(s) for s in result["statuses"]}
    assert statuses <= {201, 409, 503}, result["statuses"]
    assert result["fresh_ok"], "no full service after the failover"
    assert result["late_statuses"] == {"201": result["keys"]}, result["late_statuses"]
    if durable:
        assert result["duplicate_executions"] == 0, result
        assert result["completed_records_lost"] == 0, result
        assert result["keys_with_differing_2xx"] == 0, result
        assert result["keys_never_run"] == 0, result
