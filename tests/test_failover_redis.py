"""A Redis failover under a retry storm: Sentinel promotes a replica while the primary is SIGKILLed.

The topology is started here on free ports (`tests.support.servers.redis_sentinel`): a primary, two
replicas, three sentinels (quorum 2, down after 1 s). `tests/storm_app.py` runs under uvicorn on
`redis+sentinel://` and counts its executions in the shared Redis (not in the one that fails).
KEYS keys x DUPS duplicates start over WINDOW s; the primary is SIGKILLed KILL_AT s in, so claims,
running handlers and completions are all in flight when it dies. Clients retry 503 and
409 `request-in-progress` (bounded), as a client honouring Retry-After would. Afterwards every key
is sent once more (it must replay its first 2xx byte for byte: a completed record was not lost),
and fresh keys must run at once (full service).

- `durable_replicas=1`: 0 duplicate executions, 0 completed records lost, only 201/409/503 during
  the failover, full service after. Asserted.
- `durable_replicas=0` (Redis' asynchronous replication): the same storm, measured and reported
  (a promoted replica may have missed acknowledged claims); only the answers' shapes are asserted.

Each run prints one `FAILOVER` line (and appends it to `IDEM_SCORECARD_FILE`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, UvicornProcess, redis_sentinel, require
from tests.test_multiprocess_storm import build, read_answer

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = 100
DUPS = 8
WINDOW = 4.0
KILL_AT = 1.0
IN_FLIGHT = 100
SETTLE = 30.0  # a request's retries end by then

Answer = tuple[float, int, dict[bytes, bytes], bytes]  # (time since start, status, headers, body)


async def send(port: int, key: str, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(build(b"POST", "/pay", key, body))
        await writer.drain()
        return await asyncio.wait_for(read_answer(reader), 15)
    finally:
        writer.close()


async def client(port: int, key: str, at: float, began: float, gate: asyncio.Semaphore) -> list[Answer]:
    """One request, retried like a client would after 503 or 409 in-progress (or a refused connection)."""
    await asyncio.sleep(at)
    body = json.dumps({"amount": 1999, "currency": "EUR"}).encode()
    answers: list[Answer] = []
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        try:
            async with gate:
                status, headers, data = await send(port, key, body)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            answers.append((time.monotonic() - began, 0, {}, repr(exc).encode()))
            await asyncio.sleep(0.2)
            continue
        answers.append((time.monotonic() - began, status, headers, data))
        in_progress = status == 409 and json.loads(data)["type"].endswith("request-in-progress")
        if status != 503 and not in_progress:
            break
        await asyncio.sleep(0.1 + random.uniform(0, 0.1))
    return answers


@pytest.mark.parametrize("durable", [1, 0], ids=["durable", "async-replication"])
async def test_sentinel_failover_under_a_storm(durable: int, tmp_path: Path) -> None:
    require("redis", REDIS_URL)  # the execution counter
    run = uuid.uuid4().hex[:10]
    counter = f"idem-failover-count:{run}:"
    rng = random.Random(f"failover-{durable}")
    keys = [f"{run}-{i:03d}" for i in range(KEYS)]
    starts = {k: rng.uniform(0, WINDOW) for k in keys}
    schedule = [(k, starts[k] + rng.uniform(0, 0.1)) for k in keys for _ in range(DUPS)]
    with redis_sentinel(tmp_path / "redis") as (primary, _replicas, sentinels):
        url = "redis+sentinel://" + ",".join(s.address for s in sentinels) + "/mymaster/0"
        env = {
            **os.environ,
            "IDEM_STORM_BACKEND": url,
            "IDEM_STORM_NAMESPACE": f"failover-{run}",
            "IDEM_STORM_COUNTER_URL": REDIS_URL,
            "IDEM_STORM_COUNTER": counter,
            "IDEM_STORM_DURABLE": str(durable),
        }
        server = UvicornProcess("tests.storm_app:app", env, tmp_path / "uvicorn.log", args=["--lifespan", "on"])
        try:
            await server.wait_ready(timeout=20)
            gate = asyncio.Semaphore(IN_FLIGHT)
            began = time.monotonic()

            async def kill() -> float:
                await asyncio.sleep(KILL_AT)
                primary.kill()
                return time.monotonic() - began

            killing = asyncio.create_task(kill())
            storm = await asyncio.gather(*(client(server.port, k, at, began, gate) for k, at in schedule))
            killed_at = await killing
            storm_s = time.monotonic() - began
            late = await asyncio.gather(*(client(server.port, k, 0, began, gate) for k in keys))
            fresh = await asyncio.gather(*(client(server.port, f"{run}-fresh-{i}", 0, began, gate) for i in range(10)))
        finally:
            await asyncio.to_thread(server.stop)
        promoted = await asyncio.to_thread(sentinels[0].log_tail)

    counts = await executions(counter, keys)
    fresh_counts = await executions(counter, [f"{run}-fresh-{i}" for i in range(10)])
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
    differing = [k for k, v in by_key.items() if len({a[3] for a in v if 200 <= a[1] < 300}) > 1]
    refusals = [a[0] for answers in storm for a in answers if a[1] == 503 or a[1] == 0]
    result = {
        "test": f"failover_redis_sentinel_{'durable' if durable else 'async'}",
        "durable_replicas": durable,
        "requests": KEYS * DUPS,
        "keys": KEYS,
        "duplicate_executions": sum(c - 1 for c in counts.values() if c > 1),
        "keys_never_run": sum(1 for c in counts.values() if c == 0),
        "completed_records_lost": len(lost),
        "keys_with_differing_2xx": len(differing),
        "statuses": {str(s): n for s, n in sorted(statuses.items())},
        "killed_at_s": round(killed_at, 2),
        "refused_until_s": round(max(refusals), 2) if refusals else None,
        "recovery_s": round(max(refusals) - killed_at, 2) if refusals else 0.0,
        "storm_s": round(storm_s, 2),
    }
    report(result, tag="FAILOVER")
    assert "+switch-master" in promoted or "+failover-end" in promoted, "no failover happened"
    assert set(statuses) <= {201, 409, 503, 0}, statuses  # 0: connection refused while restarting, never seen
    assert statuses[0] == 0, "uvicorn kept serving: no connection was refused"
    assert [a[-1][1] for a in fresh] == [201] * 10 and list(fresh_counts.values()) == [1] * 10, "full service after"
    assert all(answers[-1][1] == 201 for answers in late), Counter(answers[-1][1] for answers in late)
    if durable:
        assert result["duplicate_executions"] == 0, {k: c for k, c in counts.items() if c > 1}
        assert result["completed_records_lost"] == 0, lost[:10]
        assert result["keys_with_differing_2xx"] == 0, differing[:10]
        assert result["keys_never_run"] == 0


async def executions(counter: str, keys: list[str]) -> dict[str, int]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        values = await client.mget([counter + k for k in keys])
        await client.delete(*[counter + k for k in keys])
    finally:
        await client.aclose()
    return {k: int(v or 0) for k, v in zip(keys, values, strict=True)}
