"""`@idempotent` and `claim`: background jobs run once per key in the same stores and records as
HTTP requests, on every store; concurrency claims proven with many tasks."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from idem_asgi.backends import Backend
from idem_asgi.claims import late_writes as _late_writes
from idem_asgi.claims import runtime
from idem_asgi.errors import BackendUnavailable, ConfigurationError
from idem_asgi.jobs.consumers import Settle, apply_once
from idem_asgi.jobs.decorator import InProgress, KeyReused, OutcomeUnknown, claim, current_job, idempotent
from idem_asgi.observe import Event, fan_out
from idem_asgi.records import COMPLETED, IN_PROGRESS, RecordKey, StoredResponse
from tests.support.stores import Delegating


@dataclass
class Receipt:
    order_id: str
    amount: int
    charge: int


async def test_once_per_key_under_concurrency_and_the_stored_result_is_returned(backend: Backend) -> None:
    runs: list[str] = []
    namespace = f"jobs-{uuid.uuid4().hex}"

    @idempotent(backend, key=lambda order_id, amount: f"charge:{order_id}", namespace=namespace, wait=5)
    async def charge(order_id: str, amount: int) -> Receipt:
        runs.append(order_id)
        await asyncio.sleep(0.05)
        return Receipt(order_id, amount, len(runs))

    orders = [uuid.uuid4().hex for _ in range(20)]
    results = await asyncio.gather(*(charge(o, 100) for o in orders for _ in range(10)))  # 200 calls
    assert sorted(runs) == sorted(orders), "each order charged exactly once"
    by_order: dict[str, set[int]] = {}
    for r in results:
        assert isinstance(r, Receipt)  # decoded to the return annotation
        by_order.setdefault(r.order_id, set()).add(r.charge)
    assert all(len(charges) == 1 for charges in by_order.values()), "every repeat got the first result"
    record = await backend.get(RecordKey.build(namespace, None, f"charge:{orders[0]}"))
    assert record is not None and record.state == COMPLETED  # an ordinary record: stale/reconcile/CLI see it


async def test_other_arguments_same_key_and_a_running_repeat_raise_typed_errors(backend: Backend) -> None:
    namespace = f"jobs-{uuid.uuid4().hex}"
    gate = asyncio.Event()

    running = asyncio.Event()

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge(order_id: str, amount: int) -> int:
        running.set()
        await gate.wait()
        return amount

    first = asyncio.create_task(charge("o1", 100))
    await asyncio.wait_for(running.wait(), 10)  # claimed and running (a cold pool may take a while)
    with pytest.raises(InProgress):
        await charge("o1", 100)  # wait=0: at once
    gate.set()
    assert await first == 100
    assert await charge("o1", 100) == 100
    with pytest.raises(KeyReused):
        await charge("o1", 999)


async def test_an_exception_releases_unless_an_effect_was_marked(backend: Backend) -> None:
    namespace = f"jobs-{uuid.uuid4().hex}"
    calls = 0

    @idempotent(backend, args=["n"], namespace=namespace)
    async def flaky(n: int, effect: bool) -> int:
        nonlocal calls
        calls += 1
        job = current_job()
        assert job is not None and job.key.key == f"n={n}"
        if effect:
            job.mark_effect()  # the provider was called: never run again on its own
        if calls in (1, 3):
            raise RuntimeError("boom")
        return n

    with pytest.raises(RuntimeError):
        await flaky(1, False)
    assert await flaky(1, False) == 1 and calls == 2  # released: ran again
    with pytest.raises(RuntimeError):
        await flaky(2, True)
    record = await backend.get(RecordKey.build(namespace, None, "n=2"))
    assert record is not None and record.state == IN_PROGRESS and record.holder_failed
    with pytest.raises(OutcomeUnknown):
        await flaky(2, True)
    assert calls == 3


async def test_the_context_manager_form(backend: Backend) -> None:
    key = uuid.uuid4().hex
    async with claim(backend, key, namespace="jobs-cm") as job:
        assert not job.done
        await job.store({"sent": True})
    async with claim(backend, key, namespace="jobs-cm") as again:
        assert again.done and again.result is not None
    async with claim(backend, key + "-nothing", namespace="jobs-cm") as job:
        pass  # ended without storing: released, the next one runs
    async with claim(backend, key + "-nothing", namespace="jobs-cm") as job:
        assert not job.done


def test_configuration_is_checked() -> None:
    from idem_asgi.backends import MemoryBackend

    with pytest.raises(ConfigurationError, match="exactly one of key"):
        idempotent(MemoryBackend())


async def test_observers_see_each_decision_with_the_namespace_as_route(backend: Backend) -> None:
    namespace = f"jobs-{uuid.uuid4().hex}"
    events: list[tuple[str, str, str | None]] = []

    def observer(event: Event) -> None:
        events.append((event.name, event.route, event.key))

    def broken(event: Event) -> None:
        raise RuntimeError("observability never fails a job")

    gate = asyncio.Event()
    running = asyncio.Event()

    @idempotent(backend, args=["order_id"], namespace=namespace, observer=fan_out(observer, broken))
    async def charge(order_id: str, amount: int) -> int:
        running.set()
        await gate.wait()
        if amount < 0:
            raise ValueError("refused")
        if amount == 0:
            current_job().mark_effect()  # type: ignore[union-attr]
            raise ValueError("after the effect")
        return amount

    first = asyncio.create_task(charge("o1", 100))
    await asyncio.wait_for(running.wait(), 10)
    with pytest.raises(InProgress):
        await charge("o1", 100)
    gate.set()
    assert await first == 100
    assert await charge("o1", 100) == 100
    with pytest.raises(KeyReused):
        await charge("o1", 5)
    with pytest.raises(ValueError):
        await charge("o2", -1)
    with pytest.raises(ValueError):
        await charge("o3", 0)
    with pytest.raises(OutcomeUnknown):
        await charge("o3", 0)
    assert [(n, r) for n, r, _ in events] == [
        ("claimed", namespace),
        ("conflict", namespace),
        ("completed", namespace),
        ("replayed", namespace),
        ("mismatch", namespace),
        ("claimed", namespace),
        ("released", namespace),
        ("claimed", namespace),
        ("unresolved", namespace),
        ("expired", namespace),  # as on HTTP: the lease is over, then its outcome is unknown
        ("outcome_unknown", namespace),
    ]
    assert {k for *_, k in events} == {"order_id=o1", "order_id=o2", "order_id=o3"}
    assert Event("completed", namespace).answer == "stored"

    @idempotent(backend, args=["order_id"], namespace=namespace, observer=broken)
    async def refund(order_id: str) -> str:
        return "refunded"

    assert await refund("o9") == "refunded", "an observer that raises never fails the job"
    assert await refund("o9") == "refunded"


class FailingComplete(Delegating):
    """A store that takes the claim but cannot write the outcome (or finds the claim fenced)."""

    def __init__(self, inner: Backend, *, fenced: bool) -> None:
        super().__init__(inner)
        self.fenced = fenced

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        if self.fenced:
            return False
        raise BackendUnavailable("redis unavailable: the answer to COMPLETE was lost")


async def settled(store: Backend) -> None:
    """Wait until the jobs' background writes to `store` are done."""
    shared = runtime._by_store.get(store)
    late = shared.late if shared is not None else None
    tasks = set(late._tasks) if late is not None else set()
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    assert late is None or late.pending == 0


@pytest.mark.parametrize("fenced", [False, True], ids=["store-fails", "claim-taken-over"])
async def test_a_result_that_cannot_be_stored_never_runs_the_work_again(
    backend: Backend, fenced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_late_writes, "WINDOW", 0.3)
    namespace = f"jobs-{uuid.uuid4().hex}"
    runs: list[str] = []
    failing = FailingComplete(backend, fenced=fenced)

    @idempotent(failing, args=["order_id"], namespace=namespace)
    async def charge(order_id: str) -> str:
        runs.append(order_id)
        return "charged"

    if fenced:
        with pytest.raises(OutcomeUnknown):
            await charge("o1")
    else:
        assert await charge("o1") == "charged"  # the write is retried in the background
        await settled(failing)  # and given up on after the window

    @idempotent(backend, args=["order_id"], namespace=namespace)
    async def charge_again(order_id: str) -> str:
        runs.append(order_id)
        return "charged"

    if not fenced:  # the claim is kept (its lease runs out into outcome unknown), not released
        with pytest.raises(InProgress):
            await charge_again("o1")
        assert runs == ["o1"]


class FailsOnce(Delegating):
    """A store whose first completion write fails (a blip): later ones land."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.failures = 0

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        if not self.failures:
            self.failures += 1
            raise BackendUnavailable("redis unavailable: COMPLETE not written")
        return await self.inner.complete(key, token, response, ttl=ttl)


async def test_a_failed_completion_write_in_a_job_is_retried_and_the_result_returned(backend: Backend) -> None:
    namespace = f"jobs-{uuid.uuid4().hex}"
    runs: list[str] = []
    events: list[str] = []
    store = FailsOnce(backend)

    @idempotent(store, args=["order_id"], namespace=namespace, wait=5, observer=lambda e: events.append(e.name))
    async def charge(order_id: str) -> str:
        runs.append(order_id)
        return "charged"

    assert await charge("o1") == "charged", "the caller gets its result, not the store's error"
    assert await charge("o1") == "charged"  # waits for the late write, then returns the stored result
    assert runs == ["o1"] and store.failures == 1
    await settled(store)
    record = await backend.get(RecordKey.build(namespace, None, "order_id=o1"))
    assert record is not None and record.state == COMPLETED
    assert events[:2] == ["claimed", "store_error"] and events.count("completed") == 1

    ran: list[int] = []

    async def handler() -> str:
        ran.append(1)
        return "applied"

    common: dict[str, Any] = {"namespace": namespace + "-c", "ttl": 60.0, "lease": 5.0, "wait": 5.0}
    blip = FailsOnce(backend)
    assert await apply_once(blip, "m-1", b"{}", handler, **common) is Settle.ACK, "applied: never dead-lettered"
    assert await apply_once(blip, "m-1", b"{}", handler, **common) is Settle.ACK
    assert ran == [1]
    await settled(blip)


async def test_a_consumer_never_takes_a_nested_jobs_refusal_for_its_own(backend: Backend) -> None:
    """A handler that fails because a job it calls raised KeyReused is an ordinary handler failure
    (released, handed back), not a dead letter for the message's own key."""
    namespace = f"consumer-{uuid.uuid4().hex}"
    attempts: list[int] = []

    async def handler() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise KeyReused("an inner job's key was used with other arguments")

    common: dict[str, Any] = {"namespace": namespace, "ttl": 60.0, "lease": 5.0, "wait": 0.0}
    first = await apply_once(backend, "m-1", b"{}", handler, **common)
    second = await apply_once(backend, "m-1", b"{}", handler, **common)
    assert (first, second, len(attempts)) == (Settle.RETRY, Settle.ACK, 2)
    assert await apply_once(backend, "m-1", b"{}", handler, **common) is Settle.ACK and len(attempts) == 2


async def test_a_consumer_whose_completion_write_fails_acks_it_and_never_runs_it_again(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_late_writes, "WINDOW", 0.3)
    namespace = f"consumer-{uuid.uuid4().hex}"
    ran: list[int] = []

    async def handler() -> str:
        ran.append(1)
        return "applied"

    common: dict[str, Any] = {"namespace": namespace, "ttl": 60.0, "lease": 5.0, "wait": 0.0}
    failing = FailingComplete(backend, fenced=False)
    assert await apply_once(failing, "m-2", b"{}", handler, **common) is Settle.ACK  # applied; written later
    await settled(failing)
    assert await apply_once(backend, "m-2", b"{}", handler, **common) is Settle.RETRY  # still held
    assert ran == [1], "never run a second time"
