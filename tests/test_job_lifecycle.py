"""A job's claim is never released while its effect may have happened, and never taken over while
its holder lives (issue #35, the jobs side), on Redis and Postgres:

- a caller's timeout around a job, after its effect, keeps the claim to its lease like a crash;
  the expired lease is first answered `InProgress` and only seen over after its grace, then
  `OutcomeUnknown` or the `recover=` hook's answer, never a second run;
- a holder in another process that outlives a store stall stores its result before its process
  ends, so callers waiting in other processes get that result;
- `aclose()` drains the completion writes still being retried;
- a holder SIGKILLed mid-run is recovered by `recover=`, and one killed inside a Postgres
  `transaction()` before COMMIT runs again once by itself (after COMMIT: never);
- answers of the wrong kind or type (an HTTP response for a job, a dict for a `-> Receipt` job, a
  job result for an HTTP route) are refused, not stored to fail every later call;
- a deploy that adds a parameter with a default keeps earlier calls' retries replaying.

The processes are tests/job_process.py; effects are counted outside the job's store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis

from idem_asgi.backends import Backend, Maintenance
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import BackendUnavailable, ConfigurationError
from idem_asgi.jobs import InProgress, KeyReused, OutcomeUnknown, current_job, idempotent, stored_result
from idem_asgi.ops.reconcile import ReconcilableBackend, reconcile
from idem_asgi.records import COMPLETED, IN_PROGRESS, Record, RecordKey, StoredResponse
from tests import job_deferred_types
from tests.support.charges import KEY, Payments, crash_first_request, post, protect, rk
from tests.support.charges import LEASE as HTTP_LEASE
from tests.support.servers import POSTGRES_DSN, REDIS_URL, ROOT, RedisProcess, require
from tests.support.stores import SHARED, TEST_TABLE, make_backend

T = TypeVar("T")

LEASE = 1.0
GRACE = 1.0
"""`idem_asgi.claims.leases.grace(LEASE)` (a third of the lease, at least 1 s): how long an expired
lease must be seen unchanged before it counts as over."""


@dataclass
class Receipt:
    order_id: str
    charge: str
    amount: int


def fresh() -> str:
    return f"jobs-{uuid.uuid4().hex}"


def order(namespace: str, order_id: str = "o1") -> RecordKey:
    """The record key of an `args=["order_id"]` job's call."""
    return RecordKey.build(namespace, None, f"order_id={order_id}")


async def answer(call: Awaitable[T]) -> T | type[Exception]:
    """What a call gave: its value, or the type of the exception it raised."""
    try:
        return await call
    except Exception as exc:
        return type(exc)


async def after_sightings(call: Callable[[], Awaitable[T]], within: float = 8.0) -> T | type[Exception]:
    """The first answer of `call()` that is not `InProgress` (a lease still running, or expired but
    not yet seen over), asking every 0.2 s for at most `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        got = await answer(call())
        if got is not InProgress or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


# --- processes -------------------------------------------------------------------------------------


@contextlib.contextmanager
def job_processes(configs: list[dict[str, Any]], log: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`python -m tests.job_process <config>` for each config (each its own process group, stdout
    piped, stderr to `log`); whatever is left is SIGKILLed on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log.open("ab") as err:
            for config in configs:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.job_process", json.dumps(config)],
                        cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": str(ROOT)},
                        stdout=subprocess.PIPE,
                        stderr=err,
                        start_new_session=True,
                    )
                )
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)


async def exit_code(proc: subprocess.Popen[bytes], log: Path, within: float = 30.0) -> int:
    try:
        return await asyncio.to_thread(proc.wait, within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"job process {proc.pid} still running after {within} s: {tail(log)}")


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


@contextlib.asynccontextmanager
async def shared_redis() -> AsyncIterator[aioredis.Redis]:
    require("redis", REDIS_URL)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        await client.aclose()


async def until(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(0.02)


# --- 1. a timeout around a job call, after its effect ------------------------------------------------


@pytest.mark.parametrize("backend", SHARED, indirect=True)
async def test_a_job_timed_out_after_its_effect_is_never_run_again(backend: Backend) -> None:
    """A caller's timeout cancels the job after it charged: like a crash, the claim is kept (not
    released), so the retry gets InProgress while the lease runs, InProgress again at the first
    sighting of the expired lease, then OutcomeUnknown: one effect, whatever the retries."""
    namespace = fresh()
    effects: list[str] = []

    @idempotent(backend, args=["order_id"], namespace=namespace, lease=LEASE)
    async def charge(order_id: str) -> str:
        effects.append(order_id)  # the provider charged
        if len(effects) == 1:
            await asyncio.sleep(30)  # its answer is slow: the caller gives up first
        return f"ch_{len(effects)}"

    await backend.get(order(namespace, "warm-up"))  # a warm pool: the timeout falls after the effect
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(charge("o1"), 0.5)
    assert effects == ["o1"]

    answers = [await answer(charge("o1"))]  # its lease still runs
    await asyncio.sleep(LEASE + 0.3)
    answers.append(await answer(charge("o1")))  # expired, seen once: its holder might be about to renew
    await asyncio.sleep(GRACE + 0.1)
    answers += [await answer(charge("o1")), await answer(charge("o1"))]  # seen over: outcome unknown
    assert (answers, len(effects)) == ([InProgress, InProgress, OutcomeUnknown, OutcomeUnknown], 1)
    record = await backend.get(order(namespace))
    assert record is not None and record.state == IN_PROGRESS


@pytest.mark.parametrize("backend", SHARED, indirect=True)
async def test_a_recover_hook_answers_a_timed_out_jobs_retry_with_its_stored_result(backend: Backend) -> None:
    """With `recover=`, the hook is asked once, only after both sightings, and its
    `<job>.stored_result(value)` is what the retry and every later call return."""
    namespace = fresh()
    effects: list[str] = []
    asked: list[str] = []

    async def recover(key: RecordKey, record: Record) -> StoredResponse:
        asked.append(key.key)
        return charge.stored_result("ch_at_provider")  # type: ignore[attr-defined, no-any-return]

    @idempotent(backend, args=["order_id"], namespace=namespace, lease=LEASE, recover=recover)
    async def charge(order_id: str) -> str:
        effects.append(order_id)
        if len(effects) == 1:
            await asyncio.sleep(30)
        return f"ch_{len(effects)}"

    await backend.get(order(namespace, "warm-up"))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(charge("o1"), 0.5)

    answers = [await answer(charge("o1"))]
    await asyncio.sleep(LEASE + 0.3)
    answers.append(await answer(charge("o1")))
    asked_before_grace = list(asked)
    await asyncio.sleep(GRACE + 0.1)
    answers += [await answer(charge("o1")), await answer(charge("o1"))]
    assert answers == [InProgress, InProgress, "ch_at_provider", "ch_at_provider"]
    assert (asked_before_grace, asked, effects) == ([], ["order_id=o1"], ["o1"])
    record = await backend.get(order(namespace))
    assert record is not None and record.state == COMPLETED


# --- 2. callers in four processes, the store stalled under the holder --------------------------------


@pytest.mark.redis
@pytest.mark.slow
async def test_callers_in_other_processes_get_the_holders_result_across_a_store_stall(
    throwaway: RedisProcess, tmp_path: Path
) -> None:
    """Four processes call one job key (wait=30). Right after the holder's effect the store is
    frozen (SIGSTOP) for 4 s, so its completion write fails and is retried. The holder's call
    returns (and its process ends, as a script's does) only once that write landed, after the
    thaw; the three others get its result, not OutcomeUnknown. One effect."""
    sig = f"idem-test-jobs:{uuid.uuid4().hex}"
    prefix = f"idem-test:{uuid.uuid4().hex}:"
    namespace = fresh()
    config = {
        "mode": "call",
        "url": throwaway.url,
        "prefix": prefix,
        "namespace": namespace,
        "sig": sig,
        "wait": 30,
        "lease": 10,
    }
    log = tmp_path / "jobs.log"
    async with shared_redis() as shared:
        try:
            with job_processes([config] * 4, log) as procs:

                async def all_claimed() -> bool:
                    return int(await shared.get(f"{sig}:claimed") or 0) >= 4 and bool(
                        await shared.exists(f"{sig}:holder")
                    )

                await until(all_claimed, 60, "four claims and the holder's effect")
                await asyncio.sleep(0.5)  # the repeats are held, watching for the claim's end
                throwaway.signal(signal.SIGSTOP)
                try:
                    await shared.set(f"{sig}:frozen", 1)  # the holder returns its result now
                    await asyncio.sleep(4)
                finally:
                    thawed_at = time.time()
                    throwaway.signal(signal.SIGCONT)
                outs = []
                for proc in procs:
                    assert await exit_code(proc, log, 60) == 0, tail(log)
                    assert proc.stdout is not None
                    outs.append(json.loads(proc.stdout.read()))
            holder = int(await shared.get(f"{sig}:holder") or 0)
            effects = int(await shared.get(f"{sig}:effects") or 0)
        finally:
            await shared.delete(*(f"{sig}:{name}" for name in ("claimed", "holder", "frozen", "effects")))

    by_pid = {out["pid"]: out for out in outs}
    mine = by_pid.pop(holder)
    assert mine.get("result") == f"ch_{holder}", mine
    late = mine["returned_at"] - thawed_at
    assert late > 0, f"the holder's call returned {-late:.1f} s before the store came back: its result unstored"
    assert mine["record"] == COMPLETED, f"the holder's call returned with its record {mine['record']}"
    assert [out.get("result", out.get("error")) for out in by_pid.values()] == [f"ch_{holder}"] * 3
    assert effects == 1
    reader = RedisBackend.from_url(throwaway.url, prefix=prefix)
    try:
        record = await reader.get(order(namespace))
    finally:
        await reader.aclose()
    assert record is not None and record.state == COMPLETED


# --- 3. aclose() drains the writes still being retried --------------------------------------------------

BLIP = 0.7
"""Seconds the store fails completion writes from the first one on: three retries fall inside."""


class _CompletionBlip:
    """A store whose completion writes fail for `BLIP` seconds from the first one (a store blip)."""

    blip_until: float | None = None

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        now = time.monotonic()
        if self.blip_until is None:
            self.blip_until = now + BLIP
        if now < self.blip_until:
            raise BackendUnavailable("injected: the store did not take the completion write")
        return await super().complete(key, token, response, ttl=ttl)  # type: ignore[misc, no-any-return]


class RedisWithBlip(_CompletionBlip, RedisBackend):
    pass


class PostgresWithBlip(_CompletionBlip, PostgresBackend):
    pass


async def blipping(name: str, prefix: str) -> Backend:
    """A store of its own (`from_url` / `from_dsn`: its `aclose()` closes what it made)."""
    if name == "redis":
        require("redis", REDIS_URL)
        return RedisWithBlip.from_url(REDIS_URL, prefix=prefix)
    require("postgres", POSTGRES_DSN)
    store = PostgresWithBlip.from_dsn(POSTGRES_DSN, table=TEST_TABLE, min_size=1, max_size=5)
    assert isinstance(store, PostgresBackend)
    await store.setup()
    return store


@pytest.mark.parametrize("surface", ["job", "http"])
@pytest.mark.parametrize("name", SHARED)
async def test_aclose_returns_only_once_the_pending_completion_write_landed(name: str, surface: str) -> None:
    """A completion the store failed is being retried when the caller is gone: a job whose caller
    timed out while it waited for the write, or an HTTP request already answered. `aclose()` of
    the store drains it first: right after it returns, the record is completed."""
    prefix, namespace = f"idem-test:{uuid.uuid4().hex}:", fresh()
    store = await blipping(name, prefix)
    reader = await make_backend(name, prefix=prefix)
    try:
        if surface == "job":
            key = order(namespace)

            @idempotent(store, args=["order_id"], namespace=namespace)
            async def charge(order_id: str) -> str:
                return "charged"

            with contextlib.suppress(asyncio.TimeoutError):  # the caller stops waiting for the write
                await asyncio.wait_for(charge("o1"), 0.3)
        else:
            key = rk(namespace)
            response = await post(protect(Payments(), store, namespace))
            assert response.status_code == 201
        pending = await reader.get(key)
        assert pending is not None and pending.state == IN_PROGRESS, "the completion write is still pending"
        started = time.monotonic()
        await store.aclose()
        took = time.monotonic() - started
        record = await reader.get(key)
        assert record is not None and record.state == COMPLETED, f"aclose() returned after {took:.2f} s"
    finally:
        await reader.aclose()
        await store.aclose()


# --- 4. recovery of a holder SIGKILLed mid-run ------------------------------------------------------------


async def test_a_job_whose_process_was_killed_mid_run_is_recovered_by_its_hook(
    shared_store: str, tmp_path: Path
) -> None:
    """The holder process charged o1 and o2, then was SIGKILLed. After the lease, the next call
    first gets InProgress (one sighting), then the hook is asked once: its `stored_result` for o1
    is returned (no run), its "run" for o2 runs it once more; later calls replay, not asked again."""
    namespace, prefix, counter = fresh(), f"idem-test:{uuid.uuid4().hex}:", f"idem-test-jobs:{uuid.uuid4().hex}"
    config = {
        "mode": "die",
        "store": shared_store,
        "prefix": prefix,
        "namespace": namespace,
        "keys": ["o1", "o2"],
        "counter": counter,
        "lease": LEASE,
    }
    log = tmp_path / "jobs.log"
    with job_processes([config], log) as (proc,):
        assert await exit_code(proc, log) == -signal.SIGKILL, tail(log)
    async with shared_redis() as shared:
        killed_effects = [int(await shared.get(f"{counter}:{k}") or 0) for k in ("o1", "o2")]
        await shared.delete(f"{counter}:o1", f"{counter}:o2")
    assert killed_effects == [1, 1]

    store = await make_backend(shared_store, prefix=prefix)
    asked: list[str] = []
    runs: list[str] = []

    async def recover(key: RecordKey, record: Record) -> StoredResponse | Literal["run"]:
        asked.append(key.key)
        if key.key == "order_id=o1":
            return charge.stored_result("ch_at_provider")  # type: ignore[attr-defined, no-any-return]
        return "run"  # the provider has no charge for o2

    @idempotent(store, args=["order_id"], namespace=namespace, lease=LEASE, recover=recover)
    async def charge(order_id: str) -> str:
        runs.append(order_id)
        return f"ch_rerun_{order_id}"

    try:
        await asyncio.sleep(LEASE + 0.3)  # the dead holder's lease is over
        first = [await answer(charge("o1")), await answer(charge("o2"))]
        assert (first, asked) == ([InProgress, InProgress], []), "one sighting: never asked yet"
        await asyncio.sleep(GRACE + 0.1)
        recovered = [await charge("o1"), await charge("o2")]
        again = [await charge("o1"), await charge("o2")]
        assert recovered == again == ["ch_at_provider", "ch_rerun_o2"]
        assert (asked, runs) == (["order_id=o1", "order_id=o2"], ["o2"])
    finally:
        await store.aclose()


# --- 5. a holder SIGKILLed inside its Postgres transaction ---------------------------------------------


@pytest.mark.postgres
async def test_a_job_killed_inside_its_transaction_runs_again_once_and_one_killed_after_commit_never(
    tmp_path: Path,
) -> None:
    """One process books o1 and o2, each in `transaction()`, and is SIGKILLed while o1's
    transaction is open (its row not committed) and after o2's COMMIT. With no hook, once the
    lease is over: o1 runs again, exactly once (one row in the end); o2 raises OutcomeUnknown."""
    require("postgres", POSTGRES_DSN)
    namespace, ledger = fresh(), f"idem_test_ledger_{uuid.uuid4().hex[:12]}"
    raw = await asyncpg.connect(POSTGRES_DSN)
    await raw.execute(f"CREATE TABLE {ledger} (order_id text NOT NULL)")
    store = await make_backend("postgres")
    runs: list[str] = []

    async def rows(order_id: str) -> int:
        return int(await raw.fetchval(f"SELECT count(*) FROM {ledger} WHERE order_id = $1", order_id))

    @idempotent(store, args=["order_id"], namespace=namespace, lease=LEASE)
    async def book(order_id: str) -> str:
        runs.append(order_id)
        async with store.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", order_id)
        return f"booked {order_id}"

    try:
        config = {"mode": "die-in-transaction", "namespace": namespace, "ledger": ledger, "lease": LEASE}
        log = tmp_path / "jobs.log"
        with job_processes([config], log) as (proc,):
            assert await exit_code(proc, log) == -signal.SIGKILL, tail(log)
        killed = [await store.get(order(namespace, k)) for k in ("o1", "o2")]
        assert [r is not None and r.state == IN_PROGRESS and r.effect_committed for r in killed] == [False, True]
        assert (await rows("o1"), await rows("o2")) == (0, 1)

        outcomes = [await after_sightings(lambda: book("o1")), await after_sightings(lambda: book("o2"))]
        later = [await answer(book("o1")), await answer(book("o2"))]
        assert outcomes == later == ["booked o1", OutcomeUnknown]
        assert runs == ["o1"], "o1 run again once, o2 never"
        assert (await rows("o1"), await rows("o2")) == (1, 1)
        assert [r is not None and r.uncommitted for r in killed] == [True, False], "o1 died in a transaction"
    finally:
        await raw.execute(f"DROP TABLE {ledger}")
        await raw.close()
        await store.aclose()


# --- 6. the ops tools refuse answers of the wrong kind or type ----------------------------------------


async def stuck_charge(backend: Backend, namespace: str) -> Callable[[str], Awaitable[Receipt]]:
    """A `-> Receipt` job whose call for o1 is stuck: it charged, then lost the provider's answer
    (its claim kept as outcome-unknown, its lease ended)."""
    runs: list[str] = []

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge(order_id: str) -> Receipt:
        runs.append(order_id)
        job = current_job()
        assert job is not None
        job.mark_effect()
        raise ConnectionResetError("the provider's answer was lost")

    with pytest.raises(ConnectionResetError):
        await charge("o1")
    assert runs == ["o1"]
    return charge


def reconcilable(backend: Backend) -> ReconcilableBackend:
    """The store, with its ops half (`stale`): every built-in one has it."""
    assert isinstance(backend, Maintenance)
    return backend


async def test_reconcile_refuses_an_http_answer_for_a_stuck_jobs_claim_and_leaves_it_untouched(
    backend: Backend,
) -> None:
    """A resolver that answers a job's claim with an HTTP response is reported as an error
    ("answer refused") and nothing is written: every later call still raises OutcomeUnknown, never
    a decoding error of the stored JSON."""
    namespace = fresh()
    charge = await stuck_charge(backend, namespace)
    stuck = await backend.get(order(namespace))
    http_answer = StoredResponse(200, [(b"content-type", b"application/json")], b'{"charge": "ch_1"}')

    report = await reconcile(reconcilable(backend), lambda s: http_answer, older_than=0, namespace=namespace)
    calls = [await answer(charge("o1")), await answer(charge("o1"))]

    assert calls == [OutcomeUnknown, OutcomeUnknown]
    assert [(item.action, item.detail.split(":")[0]) for item in report.items] == [("error", "answer refused")]
    assert report.completed == 0
    assert await backend.get(order(namespace)) == stuck, "the record is untouched"


async def test_a_result_not_of_the_jobs_return_type_is_refused_and_its_receipt_is_returned(backend: Backend) -> None:
    """`stored_result(..., returns=Receipt)` and `charge.stored_result(...)` refuse a dict for a
    `-> Receipt` job at once (WrongAnswer); `reconcile` refuses a plain `stored_result(dict)` for it
    too (the job registered its return type); `charge.stored_result(Receipt(...))` resolved through
    `reconcile` is what the next calls return."""
    from idem_asgi.errors import WrongAnswer  # new in #35

    namespace = fresh()
    charge = await stuck_charge(backend, namespace)
    found = {"order_id": "o1", "charge": "ch_1"}  # no amount: not a Receipt
    with pytest.raises(WrongAnswer, match="Receipt"):
        stored_result(found, returns=Receipt)
    with pytest.raises(WrongAnswer, match="Receipt"):
        charge.stored_result(found)  # type: ignore[attr-defined]

    untyped = await reconcile(reconcilable(backend), lambda s: stored_result(found), older_than=0, namespace=namespace)
    assert [(item.action, item.detail.split(":")[0]) for item in untyped.items] == [("error", "answer refused")]
    assert await answer(charge("o1")) is OutcomeUnknown

    receipt = Receipt("o1", "ch_1", 100)
    typed = await reconcile(
        reconcilable(backend),
        lambda s: charge.stored_result(receipt),  # type: ignore[attr-defined]
        older_than=0,
        namespace=namespace,
    )
    assert [item.action for item in typed.items] == ["completed"]
    assert await charge("o1") == await charge("o1") == receipt


async def test_an_http_routes_recover_hook_answering_with_a_job_result_gets_outcome_unknown(
    backend: Backend, namespace: str
) -> None:
    """A route's hook that returns `stored_result(...)` (a job's msgpack result) for a request is
    refused: the retry gets outcome-unknown, not a replay of msgpack bytes, and nothing is stored."""
    asked: list[str] = []

    async def recover(key: RecordKey, record: Record) -> StoredResponse:
        asked.append(key.key)
        return stored_result({"charge": "ch_1"})

    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=HTTP_LEASE, recover=recover)
    await crash_first_request(mw, app)

    async def retry() -> httpx.Response:
        deadline = time.monotonic() + 8
        while True:
            response = await post(mw)
            if b"request-in-progress" not in response.content or time.monotonic() > deadline:
                return response
            await asyncio.sleep(0.2)

    response = await retry()
    assert response.status_code == 409 and b"outcome-unknown" in response.content, response.content
    assert response.headers.get("idempotent-replayed") is None
    assert (asked, app.calls) == ([KEY], 1)
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == IN_PROGRESS


# --- 7. deploy-safe fingerprints -------------------------------------------------------------------------


async def test_a_deploy_that_adds_a_parameter_with_a_default_keeps_retries_replaying(backend: Backend) -> None:
    """Version 1 claimed the call; version 2 (same namespace) added `currency="EUR"`. The retry
    replays, keywords in another order replay, the default passed explicitly is the same call;
    another value is another call (KeyReused)."""
    namespace = fresh()
    runs: list[str] = []

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge_v1(order_id: str, amount: int) -> str:
        runs.append("v1")
        return f"v1 {order_id} {amount}"

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge_v2(order_id: str, amount: int, currency: str = "EUR", note: str | None = None) -> str:
        runs.append("v2")
        return f"v2 {order_id} {amount} {currency}"

    assert await charge_v1("o1", 100) == "v1 o1 100"
    retries = [
        await answer(charge_v2("o1", 100)),
        await answer(charge_v2(amount=100, order_id="o1")),
        await answer(charge_v2("o1", 100, "EUR")),
        await answer(charge_v2("o1", 100, currency="EUR", note=None)),
    ]
    assert retries == ["v1 o1 100"] * 4
    assert await answer(charge_v2("o1", 100, currency="USD")) is KeyReused
    assert await answer(charge_v2("o1", 100, note="")) is KeyReused  # "" is not None
    assert await charge_v2("o2", 5, currency="EUR") == "v2 o2 5 EUR"
    assert await charge_v1("o2", 5) == "v2 o2 5 EUR", "the other way round too: a rollback replays"
    assert runs == ["v1", "v2"]


async def test_a_parameter_type_known_only_to_the_type_checker_decorates_and_a_bad_return_names_itself(
    backend: Backend,
) -> None:
    """Only the return annotation is resolved at decoration: a parameter typed with a name imported
    under `if TYPE_CHECKING:` is fine; a return annotation that cannot be resolved is refused with
    an error naming that annotation."""
    from decimal import Decimal

    namespace = fresh()
    charge = idempotent(backend, args=["order_id"], namespace=namespace)(job_deferred_types.charge)
    assert await charge("o1", Decimal("1.5")) == await charge("o1", Decimal("1.5")) == "charged o1 1.5"
    with pytest.raises(ConfigurationError, match=r"return annotation of quote \('list\[Decimal\]'\)"):
        idempotent(backend, args=["order_id"], namespace=namespace + "-quote")(job_deferred_types.quote)
