"""Store faults under a RUNNING storm (issue #8, item 3), Redis: the fault hits requests in flight.

Each fault runs against a throwaway `redis-server` this test starts (AOF with `appendfsync always`,
so an acknowledged write survives SIGKILL), never the shared one:

| fault             | injected                                                                 |
|-------------------|--------------------------------------------------------------------------|
| `sigstop`         | SIGSTOP for HOLD s, then SIGCONT (a silent hang: sockets open, no reply) |
| `sigkill_restart` | SIGKILL, DOWN s later a restart on the same port (AOF reloaded)          |
| `client_pause`    | `CLIENT PAUSE <HOLD> WRITE` (scripts block until the pause ends)         |
| `debug_sleep`     | `DEBUG SLEEP <HOLD>` (the server blocks inside a command)                |

The storm: KEYS keys x DUPS duplicates through `IdempotencyMiddleware` (the `tests/crash_app.py`
stack, in process) on that server with a TIMEOUT s backend timeout and a handler that sleeps
DELAY s. Each key starts at a seeded random moment of a WINDOW s window, its duplicates within
JITTER s of it; the fault starts FAULT_AT s in, so it lands on claims, running handlers and
completions alike, and keys keep arriving after it ended. Executions are counted by an in-process
ledger (`MemoryLedger`), outside the middleware and not on the faulty server.

Asserted, for every fault:
- every request gets a definitive answer: 2xx, 409 (problem + `Retry-After`) or 503
  `store-unavailable` (+ `Retry-After`); never a 500, another 5xx or no answer;
- within the backend timeout plus slack: each request's latency is measured, and the maximum must
  stay under LATENCY_BOUND = the handler's sleep + TIMEOUT + SLACK. A request waits out the
  timeout at most once: a claim that hangs answers 503 after it, and a completion that hangs is
  given up after it (the client still gets the app's answer; the record stays in progress);
- the fault really hit the storm (some 503s) and nothing ran twice (ledger <= 1 per key);
- every 2xx of a key is the same answer (the scorecard's `replay_mismatches` is 0);
- the system recovers by itself, with the same middleware object: new keys run at once, and every
  storm key settles when retried like a client would (503 and 409 `request-in-progress` are
  retried, bounded): a key that ran replays its answer, a key that never ran runs now, once, and a
  key whose completion was lost in the fault ends `outcome-unknown` (ledger 1) once its lease is
  over, as the contract's default `block` policy says. No key stays blocked without its effect
  having happened: claims whose reply was lost (they may land when the server resumes) are
  removed by the backend's background sweep, which must have finished (nothing pending) within
  ORPHAN_DRAIN s.

One scorecard line per fault. The Postgres faults mid-storm (pg_terminate_backend, restart
-m immediate) are in tests/test_postgres_faults.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from idem_asgi.backends.redis import RedisBackend
from tests.crash_app import build
from tests.support.scorecard import Answer, MemoryLedger, Scorecard, asgi_post, assert_zero_tolerance
from tests.support.servers import RedisProcess, redis_process, wait_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]

SEED = int(os.environ.get("IDEM_STORM_SEED", "20240601"))
KEYS = 50
DUPS = 5
DELAY = 0.05  # handler sleep
WINDOW = 1.6  # keys start over this many seconds
JITTER = 0.15  # a key's duplicates start within this of each other
FAULT_AT = 0.3
HOLD = 1.0  # how long a stall lasts
DOWN = 0.3  # how long a killed server stays down before its restart
TIMEOUT = 0.5  # the backend's timeout
LEASE = 1.5
SLACK = 0.5
LATENCY_BOUND = DELAY + TIMEOUT + SLACK
ORPHAN_DRAIN = 8.0
DURABLE = ("--appendonly", "yes", "--appendfsync", "always")


# -- the faults ---------------------------------------------------------------------------------


async def sigstop(server: RedisProcess) -> None:
    server.signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(HOLD)
    finally:
        server.signal(signal.SIGCONT)


async def sigkill_restart(server: RedisProcess) -> None:
    server.kill()
    await asyncio.sleep(DOWN)
    await asyncio.to_thread(server.start)


async def client_pause(server: RedisProcess) -> None:
    admin = aioredis.Redis(port=server.port, socket_timeout=5)
    try:
        await admin.execute_command("CLIENT", "PAUSE", int(HOLD * 1000), "WRITE")  # type: ignore[no-untyped-call]
        await asyncio.sleep(HOLD)  # the pause ends by itself
    finally:
        await admin.aclose()


async def debug_sleep(server: RedisProcess) -> None:
    admin = aioredis.Redis(port=server.port, socket_timeout=HOLD + 5)
    try:
        # answers when the server wakes up
        await admin.execute_command("DEBUG", "SLEEP", HOLD)  # type: ignore[no-untyped-call]
    finally:
        await admin.aclose()


FAULTS: dict[str, Callable[[RedisProcess], Awaitable[None]]] = {
    "sigstop": sigstop,
    "sigkill_restart": sigkill_restart,
    "client_pause": client_pause,
    "debug_sleep": debug_sleep,
}


# -- checks -------------------------------------------------------------------------------------


def check_answer(answer: Answer) -> str | None:
    """Why `answer` is not a definitive answer the contract allows, or None."""
    if 200 <= answer.status < 300:
        return None
    if answer.header(b"cache-control") != b"no-store":
        return "refusal without Cache-Control: no-store"
    if answer.status == 503:
        if answer.problem != "store-unavailable" or answer.header(b"retry-after") is None:
            return f"503 {answer.problem} retry-after={answer.header(b'retry-after')!r}"
        return None
    if answer.status == 409:
        if answer.problem == "request-in-progress" and answer.header(b"retry-after") is not None:
            return None
        if answer.problem == "outcome-unknown":
            return None
        return f"409 {answer.problem} retry-after={answer.header(b'retry-after')!r}"
    return f"status {answer.status} {answer.error or answer.body[:200]!r}"


async def settle(app: Any, key: str, *, within: float) -> list[Answer]:
    """Retry `key` like a client: after 503 or 409 request-in-progress, again (bounded by `within`)."""
    answers: list[Answer] = []
    deadline = time.monotonic() + within
    while True:
        answer = await asgi_post(app, key, timeout=10)
        answers.append(answer)
        if answer.status != 503 and answer.outcome != "409:request-in-progress":
            return answers
        if time.monotonic() > deadline:
            return answers
        await asyncio.sleep(0.1)


# -- the test -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_redis_fault_under_a_running_storm(fault: str, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    rng = random.Random(f"{SEED}-{fault}")
    keys = [f"{run}-{i}" for i in range(KEYS)]
    starts = {k: rng.uniform(0, WINDOW) for k in keys}
    schedule = [(k, starts[k] + rng.uniform(0, JITTER)) for k in keys for _ in range(DUPS)]
    rng.shuffle(schedule)
    ledger = MemoryLedger()
    card = Scorecard(f"storm_fault_redis_{fault}", "redis", seed=SEED, keys=KEYS, dup_per_key=DUPS)
    card.fault(f"redis_{fault}")

    with redis_process(tmp_path / "redis", args=DURABLE) as server:
        store = RedisBackend.from_url(server.url, prefix=f"idem-fault:{run}:", timeout=TIMEOUT)
        app, backend = build(store, ledger, namespace=f"fault-{run}", lease=LEASE, ttl=600, delay=DELAY)
        try:
            # warm: connections open, scripts loaded (a restart must reload them on NOSCRIPT)
            warm = await asyncio.gather(*(asgi_post(app, f"{run}-warm-{i}") for i in range(10)))
            assert [a.status for a in warm] == [201] * 10

            fault_window: list[float] = []

            async def one(key: str, at: float) -> Answer:
                await asyncio.sleep(at)
                return await asgi_post(app, key, timeout=10)

            async def inject() -> None:
                await asyncio.sleep(FAULT_AT)
                fault_window.append(time.monotonic())
                await FAULTS[fault](server)
                fault_window.append(time.monotonic())

            began = time.monotonic()
            storm, _ = await asyncio.gather(asyncio.gather(*(one(k, at) for k, at in schedule)), inject())
            storm_s = time.monotonic() - began
            card.add(*storm)

            # Recovery, by itself: new keys run at once; every storm key settles.
            fresh = await asyncio.gather(*(asgi_post(app, f"{run}-after-{i}") for i in range(10)))
            settled = await asyncio.gather(*(settle(app, k, within=LEASE + 4) for k in keys))
            for answers in settled:
                card.add(*answers)
            counts = await ledger.counts(keys)
            fresh_counts = await ledger.counts(f"{run}-after-{i}" for i in range(10))
            orphans = store.pending_orphans
            drained = time.monotonic()
            await wait_until(lambda: store.pending_orphans == 0, ORPHAN_DRAIN)
            drained = time.monotonic() - drained
            pending = store.pending_orphans
        finally:
            await backend.aclose()

    statuses = Counter(a.status for a in storm)
    latencies = sorted(a.latency for a in storm)
    result = card.finish(
        counts,
        extra={
            "fault_s": round(fault_window[1] - fault_window[0], 3),
            "storm_s": round(storm_s, 3),
            "backend_timeout_s": TIMEOUT,
            "lease_s": LEASE,
            "storm_statuses": {str(s): n for s, n in sorted(statuses.items())},
            "max_latency_ms": round(latencies[-1] * 1000, 1),
            "latency_bound_ms": round(LATENCY_BOUND * 1000),
            "orphans_pending_after_settle": orphans,
            "orphans_drained_s": round(drained, 2),
        },
    )

    bad = [(a.key, why) for a in card.answers if (why := check_answer(a)) is not None]
    assert not bad, bad[:10]
    assert latencies[-1] < LATENCY_BOUND, f"slowest answer {latencies[-1]:.3f}s > {LATENCY_BOUND:.3f}s"
    assert statuses[503] > 0, f"the {fault} never reached the storm: {statuses}"
    assert_zero_tolerance(result)
    assert result["5xx"] == result["503"], result  # no 5xx but the store-unavailable 503
    assert max(counts.values()) <= 1, {k: n for k, n in counts.items() if n > 1}

    assert [a.status for a in fresh] == [201] * 10 and not any(a.replayed for a in fresh)
    assert list(fresh_counts.values()) == [1] * 10
    for key, answers in zip(keys, settled, strict=True):
        last = answers[-1]
        if counts[key] == 0:
            raise AssertionError(f"{key} never ran and never settled: {[a.outcome for a in answers]}")
        # Ran once: its answer replays, or its completion was lost and it is outcome-unknown now.
        assert last.outcome in ("first", "replay", "409:outcome-unknown"), (key, [a.outcome for a in answers])
    assert result["final"].keys() <= {"completed", "outcome_unknown"}, result["final"]
    assert result["blocked_without_effect"] == 0, result
    assert pending == 0, f"{pending} unanswered claims still not removed {ORPHAN_DRAIN}s after the storm settled"
