"""Crash matrix: a uvicorn worker SIGKILLs itself at each crash point, then a fresh worker settles every key.

Per backend (Redis, Postgres) and per crash point of `tests/crash_app.py` (before the claim, after
the claim, mid-handler, after the handler before the store write, after the store write, after the
store write before anything was sent, mid-send): one worker with that crash point gets 20 keys at
once; the 20 requests meet at the crash point (a barrier) and the worker kills itself with SIGKILL.
Lease 1 s. Once the lease is over, a worker that never crashes retries each key (3 times, plus
more while it still answers request-in-progress, bounded), and the ledger says what really ran.

Every key must end accounted for, under the default `block` policy and as the contract says:
- no effect and nothing claimed (crash before the claim): the retry runs it, exactly once;
- claimed, no effect: 409 `outcome-unknown`, ledger 0 (blocked until recovery or the TTL);
- effect happened, answer not stored (mid-handler, before the store write, mid-send): 409
  `outcome-unknown`, ledger 1 (a lost completion, never a second execution);
- answer stored (after the store write, before the first send): byte-identical replays, ledger 1.
One scorecard line per crash point and backend.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.crash_app import POINTS, launch, make_store
from tests.support.scorecard import (
    ZERO_TOLERANCE,
    Answer,
    Ledger,
    PostgresLedger,
    RedisLedger,
    Scorecard,
    cleanup_store,
    final_state,
    http_post,
)
from tests.support.servers import POSTGRES_DSN, REDIS_URL, UvicornProcess

pytestmark = pytest.mark.slow

TABLE = "idem_reliability_records"
KEYS_PER_POINT = 20
LEASE = 1.0
RETRIES = 3
PARALLEL_STARTS = 4  # worker start-ups at once (2 shared cores)

# What the client of the dying worker got: nothing, or the status, headers and first body chunk.
TRUNCATED = {"before_store", "after_store", "mid_send"}
# point -> (final state, executions per key)
EXPECTED = {
    "before_claim": ("completed", 1),
    "after_claim": ("outcome_unknown", 0),
    "mid_handler": ("outcome_unknown", 1),
    "before_store": ("outcome_unknown", 1),
    "after_store": ("completed", 1),
    "before_first_send": ("completed", 1),
    "mid_send": ("outcome_unknown", 1),
}
assert set(EXPECTED) == set(POINTS)


async def settle(port: int, key: str) -> list[Answer]:
    """RETRIES probes of `key`, then more (bounded, 4 s) while it still answers request-in-progress."""
    answers: list[Answer] = []
    deadline = time.monotonic() + 4
    for i in range(RETRIES + 40):
        answer = await http_post(port, key, timeout=10)
        answers.append(answer)
        if i + 1 >= RETRIES and answer.outcome != "409:request-in-progress" and answer.status != 503:
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    return answers


async def crash_one_point(server: UvicornProcess, keys: list[str]) -> tuple[list[Answer], int | None, float]:
    """Send every key at once to the crashing worker; (answers, its return code, when it died)."""
    answers = await asyncio.gather(*(http_post(server.port, k, timeout=10) for k in keys))
    code = await server.wait_dead(10)
    return list(answers), code, time.monotonic()


async def test_crash_matrix(shared_store: str, tmp_path: Path) -> None:
    kind = shared_store
    run = uuid.uuid4().hex[:12]
    namespace = f"crash-{run}"
    url = REDIS_URL if kind == "redis" else POSTGRES_DSN
    ledger: Ledger = RedisLedger(REDIS_URL, run) if kind == "redis" else PostgresLedger(POSTGRES_DSN, run)
    base_env = {
        **os.environ,
        "IDEM_CRASH_BACKEND": url,
        "IDEM_CRASH_NAMESPACE": namespace,
        "IDEM_CRASH_TABLE": TABLE,
        "IDEM_CRASH_LEDGER": url,
        "IDEM_CRASH_RUN": run,
        "IDEM_CRASH_LEASE": str(LEASE),
        "IDEM_CRASH_TTL": "120",
        "IDEM_CRASH_DELAY": "0.02",
        "IDEM_CRASH_POOL": "2",  # per worker, for the store and for the ledger: 8 workers share Postgres
        "IDEM_CRASH_AFTER": str(KEYS_PER_POINT),
        "IDEM_CRASH_WAIT": "3",
    }
    keys = {p: [f"{run}-{p}-{i}" for i in range(KEYS_PER_POINT)] for p in POINTS}
    servers: dict[str, UvicornProcess] = {}
    try:
        await ledger.setup()
        if kind == "postgres":
            store = make_store(url, namespace=namespace, table=TABLE, pool=1)
            try:
                await store.setup()  # type: ignore[attr-defined]
            finally:
                await store.aclose()
        gate = asyncio.Semaphore(PARALLEL_STARTS)

        async def start(name: str, point: str) -> None:
            async with gate:
                env = {**base_env, "IDEM_CRASH_POINT": point}
                servers[name] = server = launch(env, tmp_path / f"{name}.log")
                await server.wait_ready(timeout=30)

        started = time.monotonic()
        # Every start-up finishes (or fails) before we go on, so `finally` stops every server made.
        outcomes = await asyncio.gather(start("fresh", "none"), *(start(p, p) for p in POINTS), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        startup_s = time.monotonic() - started

        crash_started = time.monotonic()
        crashes = await asyncio.gather(*(crash_one_point(servers[p], keys[p]) for p in POINTS))
        crashed = dict(zip(POINTS, crashes, strict=True))
        last_death = max(died for _, _, died in crashes)
        await asyncio.sleep(max(0.0, last_death + LEASE + 0.3 - time.monotonic()))

        fresh = servers["fresh"].port
        probes = await asyncio.gather(*(settle(fresh, k) for p in POINTS for k in keys[p]))
        by_key = {a[0].key: a for a in probes}
        counts = await ledger.counts([k for p in POINTS for k in keys[p]])

        failures: list[str] = []
        for point in POINTS:
            answers, code, _ = crashed[point]
            card = Scorecard(
                f"crash_{point}", kind, keys=KEYS_PER_POINT, dup_per_key=1 + RETRIES, started=crash_started
            )
            card.fault(f"sigkill@{point}")
            card.add(*answers)
            final: dict[str, str] = {}
            for key in keys[point]:
                card.add(*by_key[key])
                final[key] = final_state(by_key[key])
            point_counts = {k: counts[k] for k in keys[point]}
            result = card.finish(
                point_counts,
                final=final,
                extra={"worker_exit": code, "client_saw": sorted({str(a.error).split(":")[0] for a in answers})},
            )
            failures += check_point(point, result, code, answers, {k: by_key[k] for k in keys[point]}, point_counts)
        print(f"\n[{kind}] {len(servers)} workers started in {startup_s:.1f}s")
        assert not failures, "\n".join(failures)
    finally:
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers.values()))
        try:
            await ledger.cleanup()
            await cleanup_store(kind, namespace, TABLE)
        finally:
            await ledger.aclose()


def check_point(
    point: str,
    result: dict[str, Any],
    code: int | None,
    crashed: list[Answer],
    probes: dict[str, list[Answer]],
    counts: dict[str, int],
) -> list[str]:
    """Every mismatch with the contract for one crash point, as messages (all points are checked)."""
    out: list[str] = []
    bad = {f: result[f] for f in ZERO_TOLERANCE if result[f]}
    if bad:
        out.append(f"{point}: zero-tolerance fields {bad}")
    want_final, want_runs = EXPECTED[point]
    if code != -9:
        out.append(f"{point}: worker exit code {code}, not SIGKILL (crash point not reached?)")
    seen = [a.error or a.outcome for a in crashed]
    if any(a.status != 0 or (a.error or "").startswith("truncated") != (point in TRUNCATED) for a in crashed):
        out.append(f"{point}: the crashing worker answered {seen}")
    if result["5xx"]:
        out.append(f"{point}: {result['5xx']} 5xx answers")
    for key, answers in probes.items():
        outcomes = [a.outcome for a in answers]
        if final_state(answers) != want_final or counts[key] != want_runs:
            out.append(f"{point}: {key} ended {final_state(answers)} with {counts[key]} runs {outcomes}")
        settled = [o for o in outcomes if o not in ("409:request-in-progress", "503")]
        if want_final == "completed":
            # Every retry got the stored answer; only a key never run before may run now, once.
            want = ["first"] + ["replay"] * (len(settled) - 1) if point == "before_claim" else ["replay"] * len(settled)
            if settled != want:
                out.append(f"{point}: {key} retries answered {outcomes}")
        elif set(settled) != {"409:outcome-unknown"}:
            out.append(f"{point}: {key} retries answered {outcomes}")
    return out
