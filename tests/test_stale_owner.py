"""Stale owner (issue #8, item 5): a worker frozen past its lease is fenced out by the token.

Per backend (Redis, Postgres), under the `reclaim` recovery policy with a 1 s lease:

1. Worker A (`uvicorn tests.crash_app:app`, a real process) gets KEYS keys at once; its handler
   writes the ledger, then sleeps A_DELAY s. As soon as the ledger shows every key running, A is
   SIGSTOPped (the whole process: its lease renewal is frozen too).
2. Worker B (the same stack, in this process, on the same store and namespace) retries every key:
   409 `request-in-progress` while A's lease lasts, then B takes the expired claim over with a new
   fencing token, runs its own handler and stores ITS answer (201, first, not a replay).
3. A is resumed (SIGCONT) while its handler still sleeps. Its renewal timer fires first: the
   `extend` carries A's old token and is refused, and A logs that it lost the lease. Then its
   handler answers: `complete` (201 keys) or `release` (the keys A's handler answers 500) carry A's
   token and are refused, so the record stays B's.

Asserted (every fenced write is seen in the store-call trace both workers write, `crash_app.Tracer`):
- B's takeover token differs from A's claim token; B's `complete` succeeded;
- after SIGCONT, A's `extend`, `complete` and `release` all returned False (none returned True);
- the stored record is B's: completed, B's token, B's body bytes; replays through A (over HTTP)
  and through B are byte-identical to B's first answer;
- A's own client gets A's own answer, as the middleware does when its completion is refused: the
  response was already streaming, so the client gets the app's status and body (201 with A's body
  for the complete keys, the app's 500 for the release keys), never a replay and never a 5xx from
  the middleware; the refusal is logged (`was no longer held by this request; this answer was not stored`);
- the ledger: under `reclaim` the handler ran twice per key BY DESIGN, once per fencing epoch
  (A's ledger and B's ledger are separate runs: exactly 1 each).

The scorecard counts `double_executions` per (key, fencing epoch), the issue's invariant for a
re-run with a new token; the raw total is in `executions`. A's own answers are not in the
replay comparison (they are the stale owner's, not the store's); they are reported as
`stale_owner_answers`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from idem_asgi.records import COMPLETED, RecordKey
from tests.crash_app import build, launch, make_store, read_trace
from tests.support.scorecard import (
    Answer,
    Ledger,
    PostgresLedger,
    RedisLedger,
    Scorecard,
    asgi_post,
    cleanup_store,
    http_post,
)
from tests.support.servers import POSTGRES_DSN, REDIS_URL, UvicornProcess

pytestmark = pytest.mark.slow

TABLE = "idem_stale_owner_records"
LEASE = 1.0
A_DELAY = 4.0  # A's handler sleep: long enough that A is still in it when resumed
B_DELAY = 0.05
COMPLETE_KEYS = 3  # A's handler answers 201: its `complete` is fenced out
RELEASE_KEYS = 2  # A's handler answers 500: its `release` is fenced out


def make_ledger(kind: str, run: str) -> Ledger:
    return RedisLedger(REDIS_URL, run) if kind == "redis" else PostgresLedger(POSTGRES_DSN, run)


async def poll(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within}s: {what}")
        await asyncio.sleep(0.02)


async def take_over(app: Any, key: str) -> list[Answer]:
    """B retries `key` like a client: again while it is 409 request-in-progress (bounded)."""
    answers: list[Answer] = []
    deadline = time.monotonic() + 4 * LEASE + 3
    while True:
        answer = await asgi_post(app, key)
        answers.append(answer)
        if answer.outcome != "409:request-in-progress" or time.monotonic() > deadline:
            return answers
        await asyncio.sleep(0.1)


def body_pid(answer: Answer) -> int:
    return int(json.loads(answer.body)["pid"])


async def test_stale_owner_is_fenced_out_and_the_stored_answer_is_the_takers(shared_store: str, tmp_path: Path) -> None:
    kind = shared_store
    run = uuid.uuid4().hex[:12]
    namespace = f"stale-{run}"
    url = REDIS_URL if kind == "redis" else POSTGRES_DSN
    complete_keys = [f"{run}-ok-{i}" for i in range(COMPLETE_KEYS)]
    release_keys = [f"{run}-rel-{i}" for i in range(RELEASE_KEYS)]
    keys = complete_keys + release_keys
    ledger_a, ledger_b = make_ledger(kind, f"{run}-A"), make_ledger(kind, f"{run}-B")
    trace_a = tmp_path / "a-trace.jsonl"
    trace_b: list[dict[str, Any]] = []
    env = {
        **os.environ,
        "IDEM_CRASH_BACKEND": url,
        "IDEM_CRASH_NAMESPACE": namespace,
        "IDEM_CRASH_TABLE": TABLE,
        "IDEM_CRASH_LEDGER": url,
        "IDEM_CRASH_RUN": f"{run}-A",
        "IDEM_CRASH_LEASE": str(LEASE),
        "IDEM_CRASH_TTL": "120",
        "IDEM_CRASH_DELAY": str(A_DELAY),
        "IDEM_CRASH_POOL": "4",
        "IDEM_CRASH_ON_EXPIRED": "reclaim",
        "IDEM_CRASH_FAIL_KEYS": f"{run}-rel-",
        "IDEM_CRASH_TRACE": str(trace_a),
    }
    card = Scorecard("stale_owner_reclaim", kind, keys=len(keys))
    server: UvicornProcess | None = None
    store_b = make_store(url, namespace=namespace, table=TABLE, pool=8)
    app_b, backend_b = build(
        store_b, ledger_b, namespace=namespace, lease=LEASE, ttl=120, delay=B_DELAY, on_expired="reclaim",
        trace=trace_b.append,
    )  # fmt: skip
    try:
        # setup() also makes each ledger's pool now: PostgresLedger makes it lazily without a lock,
        # so B's five concurrent first writes would each make (and leak) a pool.
        await ledger_a.setup()
        await ledger_b.setup()
        await backend_b.setup()  # the Postgres table exists before A starts
        server = launch(env, tmp_path / "a.log")
        (a_pid,) = await server.wait_ready(timeout=30)
        group = server.proc.pid

        # 1. A claims every key and is frozen mid-handler.
        a_requests = [asyncio.create_task(http_post(server.port, k, timeout=60)) for k in keys]

        async def all_running() -> bool:
            return all(n == 1 for n in (await ledger_a.counts(keys)).values())

        await poll(all_running, 15, "A's handler running for every key")
        os.killpg(group, signal.SIGSTOP)
        stopped_at = time.time()
        card.fault("owner_sigstop_past_lease")
        try:
            # 2. B retries: refused while A's lease lasts, then takes over and stores its answer.
            b_runs = await asyncio.gather(*(take_over(app_b, k) for k in keys))
            b_first = {runs[-1].key: runs[-1] for runs in b_runs}
            for runs in b_runs:
                card.add(*runs)
            b_replays = await asyncio.gather(*(asgi_post(app_b, k) for k in keys))
            card.add(*b_replays)
            frozen_for = time.time() - stopped_at
        finally:
            resumed_at = time.time()  # before SIGCONT: A may run its first store call before we read the clock
            os.killpg(group, signal.SIGCONT)

        # 3. A resumes, finishes its handler, and is fenced out.
        a_answers = await asyncio.gather(*a_requests)
        a_done = time.time()
        replays_a = [await http_post(server.port, k, timeout=10) for k in keys]
        replays_b = await asyncio.gather(*(asgi_post(app_b, k) for k in keys))
        card.add(*replays_a, *replays_b)
        counts_a, counts_b = await ledger_a.counts(keys), await ledger_b.counts(keys)
        records = {k: await backend_b.get(RecordKey.build(namespace, None, k)) for k in keys}
        traced_a = read_trace(trace_a)
        log = server.tail()
    finally:
        if server is not None:
            if server.proc.poll() is None:
                os.killpg(server.proc.pid, signal.SIGCONT)  # never leave a stopped process behind
            await asyncio.to_thread(server.stop)
        await backend_b.aclose()
        try:
            for ledger in (ledger_a, ledger_b):
                await ledger.cleanup()
            await cleanup_store(kind, namespace, TABLE)
        finally:
            await ledger_a.aclose()
            await ledger_b.aclose()

    # -- what happened, per key ---------------------------------------------------------------
    assert frozen_for < A_DELAY - 0.5, f"B took {frozen_for:.2f}s: A's handler was over before SIGCONT"
    refused: Counter[str] = Counter()
    for key in keys:
        runs = next(r for r in b_runs if r[-1].key == key)
        assert {a.outcome for a in runs[:-1]} <= {"409:request-in-progress"}, [a.outcome for a in runs]
        first = b_first[key]
        assert first.outcome == "first" and first.status == 201, (key, first.outcome, first.body)
        assert body_pid(first) == os.getpid()

        # Tokens: A claimed with token tA; B found tA's expired record and took over with tB != tA.
        a_calls = [e for e in traced_a if e["key"] == key]
        b_calls = [e for e in trace_b if e["key"] == key]
        (a_claim,) = [e for e in a_calls if e["op"] == "claim" and e["result"] == "claimed"]
        token_a = a_claim["token"]
        (b_take,) = [e for e in b_calls if e["op"] == "takeover" and e["result"] == "claimed"]
        token_b = b_take["token"]
        assert token_a != token_b
        assert any(e["op"] == "claim" and e["result"] == "existing" and e["token"] == token_a for e in b_calls)
        assert [e["result"] for e in b_calls if e["op"] == "complete"] == [True]

        # A after SIGCONT: every fenced write it made carried tA and was refused.
        late = [e for e in a_calls if e["sent"] >= resumed_at and e["op"] in ("extend", "complete", "release")]
        assert all(e["token"] == token_a and e["result"] is False for e in late), late
        ops = [e["op"] for e in late]
        assert "extend" in ops, f"{key}: A never tried to renew after SIGCONT: {a_calls}"
        final_op = "complete" if key in complete_keys else "release"
        assert ops.count(final_op) == 1 and ops[-1] == final_op, (key, ops)
        refused.update(ops)
        assert f"lease of key {key!r} was lost while its work ran" in log, log[-2000:]

        # A's client got A's own answer (the app's status and body), not the stored one.
        mine = next(a for a in a_answers if a.key == key)
        assert mine.error is None and not mine.replayed, (key, mine.status, mine.error)
        assert mine.status == (201 if key in complete_keys else 500), (key, mine.status, mine.body)
        assert body_pid(mine) == a_pid and mine.body != first.body
        if key in complete_keys:
            assert f"key {key!r} was no longer held by this request; this answer was not stored" in log, log[-2000:]

        # The store keeps B's answer: record, and replays through both workers.
        record = records[key]
        assert record is not None and record.state == COMPLETED and record.token == token_b, record
        assert record.response is not None and record.response.body == first.body
        for replay in (
            next(a for a in b_replays if a.key == key),
            next(a for a in replays_a if a.key == key),
            next(a for a in replays_b if a.key == key),
        ):
            assert replay.outcome == "replay" and replay.canonical() == first.canonical(), (key, replay.body)

        # The ledger: once per fencing epoch, by design of `reclaim`.
        assert (counts_a[key], counts_b[key]) == (1, 1), (key, counts_a[key], counts_b[key])

    per_epoch = {k: max(counts_a[k], counts_b[k]) for k in keys}
    result = card.finish(
        per_epoch,
        extra={
            "policy": "reclaim",
            "executions": sum(counts_a.values()) + sum(counts_b.values()),
            "executions_by_owner": {"stale_A": sum(counts_a.values()), "taker_B": sum(counts_b.values())},
            "double_executions_rule": "per (key, fencing epoch)",
            "stale_writes_refused": dict(refused),
            "stale_owner_answers": dict(Counter(a.outcome for a in a_answers)),
            "stored_answer_is_takers": sum(
                r is not None and r.response is not None and r.response.body == b_first[k].body
                for k, r in records.items()
            ),
            "frozen_s": round(frozen_for, 3),
            "stale_owner_finished_s_after_resume": round(a_done - resumed_at, 3),
            "max_latency_ms": round(max(a.latency for a in card.answers) * 1000, 1),
        },
    )
    assert result["double_executions"] == 0 and result["replay_mismatches"] == 0, result
    assert result["unaccounted_keys"] == 0 and result["5xx"] == 0 and result["503"] == 0, result
    assert result["final"] == {"completed": len(keys)}, result
