"""Jobs and consumers on the claim core, on every store: what a hand-made mutation run found no test
for (a job's lease renewal, its `scope=`, a consumer duplicate whose `wait` runs out, a memory
claim right after the TTL), and the refusals and memory-store outcomes issue 26 asked for."""

from __future__ import annotations

import asyncio
import functools
import uuid

import pytest

from idem_asgi import current_idempotency
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.jobs.consumers import Settle, apply_once
from idem_asgi.jobs.decorator import InProgress, OutcomeUnknown, claim, current_job, idempotent, stored_result
from idem_asgi.observe import Counters
from idem_asgi.ops.reconcile import reconcile
from idem_asgi.records import Claimed, Existing, RecordKey, StaleRecord
from tests.support.stores import Counting, Delegating


def fresh() -> str:
    return f"jobs-{uuid.uuid4().hex}"


# --- a job run past its lease keeps its claim (renewal) -----------------------------------------


async def test_a_job_running_past_its_lease_keeps_its_claim_while_a_repeat_arrives(backend: Backend) -> None:
    """Four leases long: only renewals keep the claim live. A repeat meanwhile finds it running
    (InProgress, never OutcomeUnknown, never a second run); one that waits gets its result."""
    namespace, runs = fresh(), []
    started = asyncio.Event()

    @idempotent(backend, args=["order_id"], namespace=namespace, lease=0.3)
    async def charge(order_id: str) -> str:
        runs.append(order_id)
        started.set()
        await asyncio.sleep(1.2)
        return f"ch_{order_id}"

    @idempotent(backend, args=["order_id"], namespace=namespace, lease=0.3, wait=5)
    async def charge_waiting(order_id: str) -> str:
        raise AssertionError("a repeat never runs")

    first = asyncio.create_task(charge("o1"))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.9)  # three leases in: without renewal the claim would be over
    with pytest.raises(InProgress):
        await charge("o1")
    waited = asyncio.create_task(charge_waiting("o1"))
    assert await first == "ch_o1"
    assert await waited == "ch_o1"
    assert runs == ["o1"]


async def test_repeats_of_a_job_running_in_this_process_are_handed_its_result(backend: Backend) -> None:
    """Held 1 s, five waiting repeats make one claim each and no more (no polling): the running
    call hands them its result. Its lease renewal is observed as the middleware's is."""
    store, namespace, runs, events = Counting(backend), fresh(), [], Counters()
    gate, entered = asyncio.Event(), asyncio.Event()

    @idempotent(store, args=["order_id"], namespace=namespace, lease=0.3, wait=10, observer=events)
    async def charge(order_id: str) -> str:
        runs.append(order_id)
        entered.set()
        await gate.wait()
        return f"ch_{order_id}"

    first = asyncio.create_task(charge("o1"))
    await asyncio.wait_for(entered.wait(), 5)
    repeats = [asyncio.create_task(charge("o1")) for _ in range(5)]
    await asyncio.sleep(1.0)
    assert store.calls["claim"] == 6 and store.calls["get"] == 0, store.calls
    gate.set()
    assert await first == "ch_o1"
    assert await asyncio.gather(*repeats) == ["ch_o1"] * 5
    assert runs == ["o1"]
    assert store.calls["claim"] == 6, "handed over: nobody asked the store again"
    assert events["lease_extended"] >= 2 and events["replayed"] == 5
    assert events["claimed"] == 1 and events["completed"] == 1


async def test_a_consumer_handler_runs_inside_its_claim(backend: Backend) -> None:
    namespace, seen = fresh(), []

    async def run() -> None:
        info = current_idempotency()
        held = current_job()
        seen.append((info is not None and info.claim is held and held is not None and held.active, info and info.key))

    assert await apply_once(backend, "m7", b"{}", run, namespace=namespace, ttl=60, lease=5, wait=0) is Settle.ACK
    assert seen == [(True, "m7")]
    assert current_idempotency() is None


# --- a job's scope is part of its key -----------------------------------------------------------


async def test_a_jobs_scope_separates_keys_and_is_stored_with_the_record(backend: Backend) -> None:
    namespace, runs = fresh(), []

    @idempotent(backend, args=["order_id"], namespace=namespace, scope=lambda order_id, tenant: tenant)
    async def charge(order_id: str, tenant: str) -> str:
        runs.append((order_id, tenant))
        return f"{tenant}:{order_id}"

    assert await charge("o1", "acme") == "acme:o1"
    assert await charge("o1", "globex") == "globex:o1", "another tenant's key: it runs"
    assert await charge("o1", "acme") == "acme:o1"
    assert runs == [("o1", "acme"), ("o1", "globex")]
    for tenant in ("acme", "globex"):
        record = await backend.get(RecordKey.build(namespace, tenant, "order_id=o1"))
        assert record is not None and record.state == "completed"
    assert await backend.get(RecordKey.build(namespace, None, "order_id=o1")) is None


async def test_the_claim_block_honours_its_scope(backend: Backend) -> None:
    namespace = fresh()
    for tenant in ("acme", "globex"):
        async with claim(backend, "k1", namespace=namespace, scope=tenant) as job:
            assert not job.done, f"{tenant} has a key of its own"
            assert job.key == RecordKey.build(namespace, tenant, "k1")
            await job.store(tenant)
    async with claim(backend, "k1", namespace=namespace, scope="acme") as job:
        assert job.done and job.result == stored_result("acme").body


# --- a consumer duplicate whose wait runs out is handed back, not dead-lettered ------------------


async def test_a_duplicate_whose_short_wait_runs_out_is_retried_not_dead_lettered(backend: Backend) -> None:
    namespace, gate, entered = fresh(), asyncio.Event(), asyncio.Event()
    applied: list[str] = []

    async def run() -> None:
        applied.append("m1")
        entered.set()
        await gate.wait()

    # The first delivery runs in another consumer (a store object of its own: another process's view).
    elsewhere = Delegating(backend)
    first = asyncio.create_task(apply_once(elsewhere, "m1", b"{}", run, namespace=namespace, ttl=60, lease=5, wait=0))
    await asyncio.wait_for(entered.wait(), 5)
    loop = asyncio.get_running_loop()
    began = loop.time()
    duplicate = await apply_once(backend, "m1", b"{}", run, namespace=namespace, ttl=60, lease=5, wait=0.3)
    assert duplicate is Settle.RETRY
    assert loop.time() - began >= 0.25, "it waited its (non-default) wait first"
    gate.set()
    assert await first is Settle.ACK
    assert await apply_once(backend, "m1", b"{}", run, namespace=namespace, ttl=60, lease=5, wait=0.3) is Settle.ACK
    assert applied == ["m1"]


# --- refusals at decoration ---------------------------------------------------------------------


async def _charge(order_id: str, amount: int) -> int:
    return amount


def test_a_partial_without_a_namespace_is_refused_and_with_one_accepted() -> None:
    store = MemoryBackend()
    with pytest.raises(ConfigurationError, match=r"functools\.partial.*namespace="):
        idempotent(store, args=["order_id"])(functools.partial(_charge, amount=5))
    named = idempotent(store, args=["order_id"], namespace=fresh())(functools.partial(_charge, amount=5))
    assert asyncio.run(named("o1")) == 5


def test_functions_decorated_in_a_loop_are_refused_without_a_namespace() -> None:
    """What a module-level `for` loop around a `def` does: one code, a new function each time."""
    store = MemoryBackend()
    eur = idempotent(store, args=["order_id"])(_convert_for("eur"))
    with pytest.raises(ConfigurationError, match=r"loop.*namespace="):
        idempotent(store, args=["order_id"])(_convert_for("usd"))
    again = idempotent(store, args=["order_id"])(eur.__wrapped__)  # type: ignore[attr-defined]
    assert again.namespace == eur.namespace  # type: ignore[attr-defined]  # the same function: one space
    usd = idempotent(store, args=["order_id"], namespace=fresh())(_convert_for("usd"))
    assert asyncio.run(usd("o1")) == "usd"


def _convert_for(currency: str):  # type: ignore[no-untyped-def]
    async def convert(order_id: str) -> str:
        return currency

    convert.__qualname__ = "convert"  # as a module-level `def` is named
    return convert


# --- the memory store ---------------------------------------------------------------------------


async def test_a_job_result_over_the_memory_budget_is_listed_by_stale_and_reconciled() -> None:
    store, namespace, runs = MemoryBackend(max_bytes=128), fresh(), []

    @idempotent(store, args=["order_id"], namespace=namespace)
    async def export(order_id: str) -> str:
        runs.append(order_id)
        return "x" * 1000  # over max_bytes

    assert await export("o1") == "x" * 1000, "the first caller has its result"
    with pytest.raises(OutcomeUnknown, match="reconcile"):
        await export("o1")
    stale = await store.stale(0, namespace=namespace)
    assert [s.key.key for s in stale] == ["order_id=o1"], "what the error says to reconcile is listed"

    def resolve(s: StaleRecord) -> object:
        return stored_result("small")

    report = await reconcile(store, resolve, older_than=0, namespace=namespace)  # type: ignore[arg-type]
    assert report.completed == 1
    assert await export("o1") == "small"
    assert runs == ["o1"]


async def test_a_memory_claim_right_after_the_ttl_is_new_without_a_get_between() -> None:
    now = [1000.0]
    store = MemoryBackend(clock=lambda: now[0])
    key = RecordKey.build(fresh(), None, "k")
    first = await store.claim(key, b"f", lease=1, ttl=10)
    assert isinstance(first, Claimed)
    assert await store.complete(key, first.token, stored_result(1), ttl=10)
    now[0] += 9.999
    assert isinstance(await store.claim(key, b"f", lease=1, ttl=10), Existing)
    now[0] += 0.002  # just past the TTL, and nothing read the record since
    again = await store.claim(key, b"f", lease=1, ttl=10)
    assert isinstance(again, Claimed) and again.token != first.token
