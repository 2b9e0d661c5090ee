"""The stall scenario of issue #35: the store stops answering for two leases while live handlers
run, under a real uvicorn; no live operation is run twice, answered `outcome-unknown`, or asked
about.

The reported failure (old code): Redis SIGSTOPped for 18 s (lease 9 s) while 30 handlers ran.
Every lease looked expired when Redis resumed, so the retries of those LIVE keys ran the docs'
recover hook (19-21 calls), which answered "run": 3-4 operations ran a second time, in the very
process that held and renewed them; without a hook, 59 retries got `409 outcome-unknown`.

Here, smaller: a throwaway store (a redis-server, or a PostgreSQL cluster) with a LEASE s lease,
and the app of `tests/stall_app.py` (route `/hook`: the counting recover hook that answers "run";
route `/plain`: no hook), at 1 and 2 uvicorn workers. KEYS_PER_ROUTE keys per route are sent at
once; the handlers count their execution in the shared Redis (never stopped) and run DELAY s. Once
every handler has started, the store is stopped (SIGSTOP) for STALL s (two leases). Retries of
every key are fired in rounds: while the store is stopped (every second; the late ones are answered
only at SIGCONT, the worst moment: every lease is past its deadline), then back to back from the
very start of the resume until every first request has finished, then one final retry per key.

Asserted per store and worker count, the lease rule of issue #35 (idem_asgi/claims/leases.py):
- every handler ran exactly once (effect counter 1 per key);
- the recover hook was never called (a live operation is not asked about);
- no retry was answered `outcome-unknown` (nor anything but in-progress, 503 while the store is
  stopped, or a replay once its first request finished); retries did meet the live operations
  after the resume (request-in-progress on both routes), so the scenario really happened;
- every first request finished after the resume, 201, not a replay; the final retries replay
  it byte for byte (`Idempotent-Replayed: true`).

With 2 workers a retry can land on the worker that does not hold the key: there the expired lease
counts as over only when seen unchanged twice, a grace apart (1 s here), while the holder retries
its renewal every 250 ms at most once the store answers. The requests of a round are sent a few ms
apart so both workers get some, and every answer names its worker (`x-worker`): at 2 workers some
retries after the resume must have met a live operation on the worker that does not hold it.

One `STALL` line per run: answers by kind per phase, effects, hook calls, timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import redis.asyncio as aioredis

from tests.stall_app import counter, launch, make_store
from tests.support.scorecard import Answer, TruncatedBody, build_post, read_response, report
from tests.support.servers import REDIS_URL, PostgresCluster, postgres_cluster, redis_process, require

pytestmark = pytest.mark.slow

LEASE = 2.0
STALL = 2 * LEASE
AFTER = 3.0
"""Seconds the handlers still run after the store resumed (at least, less the spread of their
starts): the window where retries meet live operations, three times the grace."""
DELAY = STALL + AFTER + 0.5
STARTED_WITHIN = 5.0
"""Every handler must have started this soon after the first requests were sent."""
KEYS_PER_ROUTE = 15
ROUTES = ("/hook", "/plain")
TIMEOUT = 2.0
"""The store's per-call timeout (the Redis default): a call made early in the stall fails (503)."""
SPACING = 0.005
"""Seconds between the requests of one round: connections a burst apart go to both workers, not
all to the one that wakes first."""
BODY = b'{"amount":1999,"currency":"EUR"}'
RETRIED = {"409:request-in-progress", "503", "replay"}
"""What a retry may be answered before the final round (503 only while the store cannot answer)."""


async def post(port: int, path: str, key: str, *, timeout: float = 30.0) -> Answer:
    """One POST of `key` to `path` on a fresh connection (so a 2-worker server spreads them)."""
    began = time.monotonic()
    writer: asyncio.StreamWriter | None = None
    try:
        reader, opened = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        writer = opened
        opened.write(build_post(key, BODY, path=path))
        await opened.drain()
        status, headers, body = await asyncio.wait_for(read_response(reader), timeout)
    except (OSError, TruncatedBody, asyncio.IncompleteReadError, ValueError, TimeoutError) as exc:
        return Answer(key, 0, [], b"", time.monotonic() - began, error=f"{type(exc).__name__}: {exc}")
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2)
    return Answer(key, status, headers, body, time.monotonic() - began)


def route_of(key: str) -> str:
    return "/hook" if "-hook-" in key else "/plain"


@dataclass
class Run:
    """Everything one run saw: answers per phase (the phase a request was SENT in), counters, times."""

    keys: list[str]
    firsts: dict[str, Answer] = field(default_factory=dict)
    phases: dict[str, list[Answer]] = field(default_factory=lambda: {"stopped": [], "resumed": [], "final": []})
    effects: dict[str, int] = field(default_factory=dict)
    hooks: dict[str, int] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)


async def counts(shared: aioredis.Redis, run: str, what: Literal["effect", "hook"], keys: list[str]) -> dict[str, int]:
    values = await shared.mget([counter(run, what, k) for k in keys])
    return {k: int(v or 0) for k, v in zip(keys, values, strict=True)}


async def stall(
    port: int, shared: aioredis.Redis, run: str, freeze: Callable[[], None], thaw: Callable[[], None]
) -> Run:
    """The scenario on a started server whose store `freeze` stops and `thaw` resumes."""
    keys = [f"{run}-{r.strip('/')}-{i}" for r in ROUTES for i in range(KEYS_PER_ROUTE)]
    out = Run(keys)

    async def round_of(phase: str) -> None:
        out.phases[phase] += await asyncio.gather(*(spaced(i, k) for i, k in enumerate(keys)))

    async def spaced(i: int, key: str) -> Answer:
        await asyncio.sleep(i * SPACING)
        return await post(port, route_of(key), key)

    t0 = time.monotonic()
    firsts = {k: asyncio.create_task(spaced(i, k)) for i, k in enumerate(keys)}
    while min((await counts(shared, run, "effect", keys)).values()) < 1:
        assert time.monotonic() < t0 + STARTED_WITHIN, "not every handler started in time: nothing is stopped"
        await asyncio.sleep(0.02)
    out.times["handlers_started_s"] = time.monotonic() - t0

    stalled: list[asyncio.Task[None]] = []
    freeze()
    stopped = time.monotonic()
    try:
        at = 0.3
        while at < STALL:  # one round a second; the last ones hang until SIGCONT answers them
            await asyncio.sleep(max(0.0, stopped + at - time.monotonic()))
            stalled.append(asyncio.create_task(round_of("stopped")))
            at += 1.0
        await asyncio.sleep(max(0.0, stopped + STALL - time.monotonic()))
    finally:
        thaw()
    resumed = time.monotonic()
    out.times["stopped_s"] = resumed - stopped
    out.times["stop_after_first_sent_s"] = stopped - t0

    rounds = 0
    while not all(t.done() for t in firsts.values()):  # back to back from the very start of the resume
        await round_of("resumed")
        rounds += 1
        await asyncio.sleep(0.05)
    out.rounds = {"stopped": len(stalled), "resumed": rounds}
    await asyncio.gather(*stalled)
    out.firsts = {k: t.result() for k, t in firsts.items()}
    out.times["firsts_done_after_resume_s"] = max(a.done for a in out.firsts.values()) - resumed
    out.times["first_finished_after_resume_s"] = min(a.done for a in out.firsts.values()) - resumed
    await round_of("final")
    out.effects = await counts(shared, run, "effect", keys)
    out.hooks = await counts(shared, run, "hook", keys)
    out.times["total_s"] = time.monotonic() - t0
    return out


def worker(answer: Answer) -> str:
    return (answer.header(b"x-worker") or b"?").decode()


def where(out: Run, answer: Answer) -> str:
    """`holder` when the worker that answered runs the key's first request, else `other`."""
    return "holder" if worker(answer) == worker(out.firsts[answer.key]) else "other"


def canonical(answer: Answer) -> tuple[int, tuple[tuple[bytes, bytes], ...], bytes]:
    """Status, the app's headers and the body: what a replay must repeat byte for byte."""
    status, headers, body = answer.canonical()
    return status, tuple(h for h in headers if h[0] != b"x-worker"), body


def summary(out: Run, store: str, workers: int) -> dict[str, Any]:
    """The run's numbers: answers by kind (and by which worker: the key's holder or the other) per
    phase and route, effects, hook calls, timings."""
    by_phase: dict[str, dict[str, int]] = {}
    for phase, answers in out.phases.items():
        for route in ROUTES:
            seen = Counter(f"{a.outcome}@{where(out, a)}" for a in answers if route_of(a.key) == route)
            by_phase[f"{phase}{route}"] = dict(sorted(seen.items()))
    return {
        "test": "store_stall",
        "store": store,
        "workers": workers,
        "keys": len(out.keys),
        "lease_s": LEASE,
        "stall_s": STALL,
        "firsts": dict(Counter(a.outcome for a in out.firsts.values())),
        "firsts_per_worker": sorted(Counter(worker(a) for a in out.firsts.values()).values()),
        "answers": by_phase,
        "rounds": out.rounds,
        "effects": dict(sorted(Counter(out.effects.values()).items())),
        "hook_calls": sum(out.hooks.values()),
        "times": {k: round(v, 2) for k, v in out.times.items()},
    }


def check(out: Run, workers: int) -> None:
    """The contract (see the module docstring); every violation is listed, with its keys."""
    problems: list[str] = []
    twice = {k: n for k, n in out.effects.items() if n != 1}
    if twice:
        problems.append(f"effects != 1 for {len(twice)} keys: {twice}")
    asked = {k: n for k, n in out.hooks.items() if n}
    if asked:
        problems.append(f"the recover hook was asked {sum(asked.values())} times about live keys: {asked}")
    for phase in ("stopped", "resumed"):
        unknown = Counter(a.key for a in out.phases[phase] if a.outcome == "409:outcome-unknown")
        if unknown:
            problems.append(f"{sum(unknown.values())} {phase} retries answered outcome-unknown: {dict(unknown)}")
        other = Counter(f"{a.key}:{a.error or a.outcome}" for a in out.phases[phase] if a.outcome not in RETRIED)
        if other:
            problems.append(f"{phase} retries answered {dict(other)}")
    for route in ROUTES:
        met = [a for a in out.phases["resumed"] if route_of(a.key) == route and a.outcome == "409:request-in-progress"]
        if not met:
            problems.append(f"no retry on {route} met a live operation after the resume: the scenario did not happen")
        if workers > 1 and not [a for a in met if where(out, a) == "other"]:
            problems.append(f"no retry on {route} met a live operation on a worker that does not hold it")
    bad_first = {k: a.error or a.outcome for k, a in out.firsts.items() if a.status != 201 or a.replayed}
    if bad_first:
        problems.append(f"first requests not answered 201 (first): {bad_first}")
    if out.times["first_finished_after_resume_s"] <= 0:
        problems.append("a first request finished before the store resumed: its handler did not outlive the stall")
    firsts = {k: canonical(a) for k, a in out.firsts.items()}
    bad_final = {
        a.key: a.error or a.outcome for a in out.phases["final"] if not a.replayed or canonical(a) != firsts[a.key]
    }
    if bad_final:
        problems.append(f"final retries not byte-identical replays: {bad_final}")
    assert not problems, "\n".join(problems)


async def serve_and_stall(
    tmp_path: Path, store_url: str, workers: int, freeze: Callable[[], None], thaw: Callable[[], None], store: str
) -> None:
    """Start the app on the store at `store_url`, run the scenario, report, check."""
    require("redis", REDIS_URL)
    run = uuid.uuid4().hex[:10]
    env = {
        **os.environ,
        "IDEM_STALL_STORE": store_url,
        "IDEM_STALL_SHARED": REDIS_URL,
        "IDEM_STALL_RUN": run,
        "IDEM_STALL_LEASE": str(LEASE),
        "IDEM_STALL_DELAY": str(DELAY),
        "IDEM_STALL_TIMEOUT": str(TIMEOUT),
    }
    shared = aioredis.Redis.from_url(REDIS_URL)
    server = launch(env, tmp_path / "uvicorn.log", workers=workers)
    try:
        await server.wait_ready(timeout=30)
        out = await stall(server.port, shared, run, freeze, thaw)
        line = summary(out, store, workers)
        report(line, "STALL")
        try:
            check(out, workers)
        except AssertionError:
            print(server.tail())
            raise
    finally:
        await asyncio.to_thread(server.stop)
        names = [k async for k in shared.scan_iter(match=f"idem-stall:{run}:*", count=1000)]
        if names:
            await shared.delete(*names)
        await shared.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("workers", [1, 2])
async def test_redis_stalled_for_two_leases_runs_every_live_operation_once_and_never_answers_outcome_unknown(
    tmp_path: Path, workers: int
) -> None:
    with redis_process(tmp_path / "store") as store:
        await serve_and_stall(
            tmp_path,
            store.url,
            workers,
            lambda: store.signal(signal.SIGSTOP),
            lambda: store.signal(signal.SIGCONT),
            "redis",
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    """One throwaway PostgreSQL cluster for both worker counts (each run has its own namespace)."""
    with postgres_cluster() as pg:
        yield pg


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("workers", [1, 2])
async def test_postgres_stalled_for_two_leases_runs_every_live_operation_once_and_never_answers_outcome_unknown(
    tmp_path: Path, workers: int, cluster: PostgresCluster
) -> None:
    backend = make_store(cluster.dsn, prefix="", timeout=10)
    try:
        await backend.setup()  # type: ignore[attr-defined]  # the table, before two workers race to make it
    finally:
        await backend.aclose()
    await serve_and_stall(tmp_path, cluster.dsn, workers, cluster.freeze, cluster.thaw, "postgres")
