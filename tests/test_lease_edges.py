"""The edges of a claim's life under the lease rule (issue #35), on every store.

Each test pins one behaviour that a plausible wrong change to the package broke without any other
test noticing: renewal every third of the lease (not every whole lease); a renewal the store
refuses (the claim is let go and held repeats told); recovery against a holder that renewed after
it was read, and against a record that vanished meanwhile; renewal keeping a record past its TTL;
a late completion fenced out by a takeover; held repeats backing off on a store without notices;
and the lease rule itself (a claim this process holds is never recovered, an expired lease from
elsewhere only after its grace, a failed renewal retried at once).

Times are judged by the store's clock where it matters: a claim attempt under another fingerprint
returns the record and the store's `now` in one reading, and never changes a live record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.claims.recovery import resolve
from idem_asgi.errors import BackendUnavailable
from idem_asgi.jobs import InProgress, claim, idempotent, stored_result
from idem_asgi.observe import Event
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from tests.support.pay import Payments, post
from tests.support.stores import Delegating


class Events:
    """An observer: every event's name, with when it came (monotonic)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def __call__(self, event: Event) -> None:
        self.seen.append((event.name, time.monotonic()))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.seen]

    def when(self, name: str) -> float | None:
        return next((at for n, at in self.seen if n == name), None)


async def seen(backend: Backend, rkey: RecordKey) -> Existing:
    """The record and the store's clock, read at once: a claim attempt under another fingerprint,
    which never changes a live record."""
    result = await backend.claim(rkey, b"\x00sampler", lease=1, ttl=60)
    assert isinstance(result, Existing), "the record had vanished: the sampler claimed the key itself"
    return result


async def expired(backend: Backend, rkey: RecordKey, within: float = 5.0) -> Existing:
    """Wait until the record's lease is over by the store's clock; that reading."""
    deadline = time.monotonic() + within
    while True:
        now = await seen(backend, rkey)
        if now.record.lease_until <= now.now:
            return now
        assert time.monotonic() < deadline, f"the lease did not end within {within} s"
        await asyncio.sleep(0.05)


async def until(condition: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        await asyncio.sleep(0.01)


def _unpacked(body: bytes) -> Any:
    return msgspec.msgpack.decode(body)


# -- 1. renewal every third of the lease -------------------------------------------------------------


async def test_a_long_job_is_renewed_every_third_of_its_lease_by_the_store_clock(
    backend: Backend, namespace: str
) -> None:
    """A 0.9 s lease on a 3 s run is renewed every 0.3 s: by the store's clock, what is left of it
    never drops below a fifth of the lease (renewing only once a whole lease has passed lets it
    run out between renewals, and another process could take the key over from a live holder).
    (A fifth, not the third renewal keeps: room for a loaded event loop.)"""
    lease, key = 0.9, uuid.uuid4().hex
    rkey = RecordKey.build(namespace, None, key)
    margins: list[float] = []
    async with claim(backend, key, namespace=namespace, lease=lease, ttl=60) as job:
        assert not job.done
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            now = await seen(backend, rkey)
            margins.append(now.record.lease_until - now.now)
            await asyncio.sleep(0.03)
        await job.store("done")
    assert len(margins) > 30
    assert min(margins) >= lease / 5, f"lease left fell to {min(margins):.3f} s of {lease} s"


# -- 2. a refused renewal ----------------------------------------------------------------------------


class RefusesRenewal(Delegating):
    """A store whose `extend` answers False (the claim is no longer this holder's); claims timed."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.claims: list[float] = []
        self.extends = 0

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        self.claims.append(time.monotonic())
        return await super().claim(key, fingerprint, lease=lease, ttl=ttl)

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        self.extends += 1
        return False


async def test_a_refused_renewal_lets_the_claim_go_and_wakes_the_repeats_held_on_it(
    backend: Backend, namespace: str
) -> None:
    """The store refuses the first renewal (0.2 s into a 0.6 s lease): the holder stops holding the
    claim, its observer gets `lease_lost`, and a repeat held on it in the same process (wait=5) is
    woken to read the record again at once, not left waiting on a claim nobody holds."""
    store = RefusesRenewal(backend)
    events, gate, entered = Events(), asyncio.Event(), asyncio.Event()
    key = uuid.uuid4().hex
    sessions: list[Any] = []

    async def holder() -> None:
        async with claim(store, key, namespace=namespace, lease=0.6, ttl=60, observer=events) as job:
            sessions.append(job.claim)
            entered.set()
            await gate.wait()
            await job.store("first")

    async def repeat() -> Any:
        async with claim(store, key, namespace=namespace, lease=0.6, ttl=60, wait=5) as job:
            return job.result

    first = asyncio.create_task(holder())
    await asyncio.wait_for(entered.wait(), 5)
    second = asyncio.create_task(repeat())
    try:
        await until(lambda: len(store.claims) == 2, 2, "the repeat's claim")
        await until(lambda: events.when("lease_lost") is not None, 2, "lease_lost after the refused renewal")
        lost_at = events.when("lease_lost")
        assert lost_at is not None and store.claims[1] < lost_at, "the repeat was not held before the claim was lost"
        session = sessions[0]
        assert not session.rt.leases.holds(session), "a claim whose renewal was refused is still renewed"
        await asyncio.sleep(0.3)
        again = [at for at in store.claims[2:] if at >= lost_at]
        assert again and again[0] - lost_at < 0.15, (
            f"the held repeat read the record again {[round(at - lost_at, 3) for at in again]} s after lease_lost"
        )
        assert store.extends == 1, "a lost claim is not renewed again"
    finally:
        gate.set()
        await asyncio.gather(first, second, return_exceptions=True)


# -- 3. recovery against a holder that renewed since it was read -------------------------------------


@pytest.mark.parametrize("outcome", ["answer", "run"])
async def test_recovery_never_overwrites_a_paused_holder_that_renewed_since_it_was_read(
    backend: Backend, namespace: str, outcome: str
) -> None:
    """The holder's lease ran out (it was paused) and recovery read that expired record; then the
    holder woke and renewed. The takeover is refused (the lease is live again): the verdict is
    `changed`, and the record is still the holder's, with its new lease."""
    rkey = RecordKey.build(namespace, None, uuid.uuid4().hex)
    claimed = await backend.claim(rkey, b"http-fingerprint", lease=0.2, ttl=60)
    assert isinstance(claimed, Claimed)
    await expired(backend, rkey)
    record = await backend.get(rkey)  # recovery's read: the expired view
    assert record is not None and record.token == claimed.token
    assert await backend.extend(rkey, claimed.token, lease=30), "the paused holder renews"
    answer: StoredResponse | Literal["run"] = (
        StoredResponse(201, [(b"content-type", b"application/json")], b'{"recovered": true}')
        if outcome == "answer"
        else "run"
    )
    verdict, _ = await resolve(backend, rkey, record, answer, lease=30, ttl=60)
    assert verdict == "changed"
    now = await seen(backend, rkey)
    assert now.record.state == IN_PROGRESS and now.record.response is None
    assert now.record.token == claimed.token
    assert now.record.lease_until - now.now > 25, "the holder's renewed lease was replaced"


# -- 4. renewal keeps the record past its TTL --------------------------------------------------------


async def test_a_job_running_past_its_ttl_keeps_its_record_and_runs_once(backend: Backend, namespace: str) -> None:
    """TTL 1 s, lease 0.6 s, a 2.5 s run: each renewal pushes the record's expiry too, so past its
    TTL the record is still there and a repeat is told `InProgress` (not run a second time); once
    it is done, a repeat gets its result."""
    runs: list[str] = []

    @idempotent(backend, key=lambda order: order, namespace=namespace, ttl=1, lease=0.6)
    async def fulfil(order: str) -> str:
        runs.append(order)
        if len(runs) == 1:
            await asyncio.sleep(2.5)
        return f"run-{len(runs)}"

    key = uuid.uuid4().hex
    rkey = RecordKey.build(namespace, None, key)
    first = asyncio.create_task(fulfil(key))
    try:
        await asyncio.sleep(1.5)  # past the TTL
        record = await backend.get(rkey)
        assert record is not None, "the record of a job still running expired at its TTL"
        now = await seen(backend, rkey)
        assert now.record.state == IN_PROGRESS and now.record.expires_at > now.now
        with pytest.raises(InProgress):
            await fulfil(key)
        assert await first == "run-1"
        assert await fulfil(key) == "run-1"
        assert runs == [key]
    finally:
        first.cancel()
        with contextlib.suppress(BaseException):
            await first


# -- 5. a late completion fenced out by a takeover ---------------------------------------------------


class LosesFirstCompletion(Delegating):
    """`complete` fails once before writing (the request never reached the store); the retries
    wait for `proceed` before going through."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.failed = asyncio.Event()
        self.proceed = asyncio.Event()
        self.completes = 0

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        self.completes += 1
        if self.completes == 1:
            self.failed.set()
            raise BackendUnavailable("injected: the completion never reached the store")
        await self.proceed.wait()
        return await super().complete(key, token, response, ttl=ttl)


async def test_a_late_completion_fenced_out_by_a_takeover_is_lost_not_landed(backend: Backend, namespace: str) -> None:
    """A's completion fails and is retried in the background; meanwhile A's lease ends and B takes
    the claim over and stores its own result. A's retry is fenced out: A's observer gets
    `lease_lost` (never `completed`: B's completed record carries B's token, not A's), A's job
    knows its result was not stored, and B's result is what every repeat gets."""
    store_a = LosesFirstCompletion(backend)
    events, key = Events(), uuid.uuid4().hex
    rkey = RecordKey.build(namespace, None, key)
    jobs: list[Any] = []

    async def holder_a() -> None:
        async with claim(store_a, key, namespace=namespace, lease=0.5, ttl=60, observer=events) as job:
            jobs.append(job)
            await job.store("A")

    a = asyncio.create_task(holder_a())
    try:
        await asyncio.wait_for(store_a.failed.wait(), 5)
        now = await expired(backend, rkey)
        taken = await backend.takeover(rkey, now.record.token, now.record.fingerprint, lease=30, ttl=60)
        assert isinstance(taken, Claimed)
        assert await backend.complete(rkey, taken.token, stored_result("B"), ttl=60)
    finally:
        store_a.proceed.set()
    await asyncio.wait_for(a, 10)
    assert "lease_lost" in events.names and "completed" not in events.names, events.names
    assert getattr(jobs[0], "late", True) is True, "A's job believes its result was stored"
    record = await backend.get(rkey)
    assert record is not None and record.state == COMPLETED and record.token == taken.token
    async with claim(backend, key, namespace=namespace) as repeat:
        assert repeat.done and repeat.result is not None
        assert _unpacked(repeat.result) == "B"


# -- 6. held repeats back off on a store without notices ---------------------------------------------


class Unwatched(Delegating):
    """No notices (`watch` hidden, so held repeats poll); claims counted."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.claims = 0

    def __getattr__(self, name: str) -> Any:
        if name == "watch":
            raise AttributeError(name)
        return super().__getattr__(name)

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        self.claims += 1
        return await super().claim(key, fingerprint, lease=lease, ttl=ttl)


class ChangedAlready(Unwatched):
    """A `watch` that always answers False: "it changed already, read it again" (after yielding to
    the event loop, as a store's round trip does)."""

    watches = 0

    async def watch(self, key: RecordKey, token: int, on_change: Callable[[str | None], None]) -> bool | None:
        self.watches += 1
        await asyncio.sleep(0)
        return False


@pytest.mark.parametrize("notices", ["none", "changed_already"])
async def test_a_repeat_held_on_a_holder_elsewhere_polls_with_backoff(
    backend: Backend, namespace: str, notices: str
) -> None:
    """A holder in another runtime runs 1.5 s; a repeat held on it (wait=5) with no notice to wake
    it re-claims with backoff (10 ms doubling to 250 ms: about 11 claims), never in a busy loop,
    also when the store's `watch` keeps answering "it changed already"; it then replays."""
    store = Unwatched(backend) if notices == "none" else ChangedAlready(backend)
    entered, key = asyncio.Event(), uuid.uuid4().hex

    async def holder() -> None:
        async with claim(backend, key, namespace=namespace, lease=30, ttl=60) as job:
            entered.set()
            await asyncio.sleep(1.5)
            await job.store("first")

    first = asyncio.create_task(holder())
    try:
        await asyncio.wait_for(entered.wait(), 5)
        async with claim(store, key, namespace=namespace, lease=30, ttl=60, wait=5) as repeat:
            assert repeat.done and repeat.result is not None
            assert _unpacked(repeat.result) == "first"
    finally:
        await asyncio.wait_for(first, 10)
    assert store.claims <= 20, f"{store.claims} claims while held 1.5 s"


# -- 7. recovery when the record vanished meanwhile --------------------------------------------------


class Hangs:
    """An app that never answers: cancelling its request leaves the claim to its lease, like a crash."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.entered.set()
        await asyncio.Event().wait()


async def dead_holder(backend: Backend, namespace: str, key: str, lease: float) -> None:
    """A request in another runtime (its own store wrapper: its own machinery) claims `key` and
    dies (cancelled mid-run): its claim is left in progress until its lease ends."""
    app = Hangs()
    mw = IdempotencyMiddleware(
        app,
        backend=Delegating(backend),
        routes=[RoutePolicy("/pay", single_tenant=True, lease=lease)],
        namespace=namespace,
    )
    request = asyncio.create_task(post(mw, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    request.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await request


async def test_recovery_of_a_record_that_vanished_meanwhile_claims_the_key_anew(
    backend: Backend, namespace: str
) -> None:
    """The recover hook finds the dead holder's record gone by the time it answers `"run"` (here
    it deletes it itself): the takeover finds nothing, so the request claims the key anew and runs
    once, answering its 201, not `outcome-unknown`."""
    key = uuid.uuid4().hex
    await dead_holder(backend, namespace, key, lease=0.5)
    asked: list[Record] = []

    async def recover(rkey: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
        asked.append(record)
        assert await backend.release(rkey, record.token), "the record is deleted under recovery's feet"
        return "run"

    app = Payments()
    live = IdempotencyMiddleware(
        app,
        backend=backend,
        routes=[RoutePolicy("/pay", single_tenant=True, lease=0.5, recover=recover)],
        namespace=namespace,
    )
    deadline = time.monotonic() + 6
    while True:
        answer = await post(live, key)
        if answer.problem != "request-in-progress" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert len(asked) == 1
    assert (answer.status, answer.problem, answer.replayed) == (201, None, False), answer.body
    assert app.runs[key] == 1
    replay = await post(live, key)
    assert replay.replayed and replay.body == answer.body


# -- 8. the lease rule ------------------------------------------------------------------------------


class FlakyRenewal(Delegating):
    """`extend` raises while `down` (the store is unreachable); each attempt is timed."""

    def __init__(self, inner: Backend, *, down: bool = False) -> None:
        super().__init__(inner)
        self.down = down
        self.attempts: list[tuple[float, bool]] = []

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        if self.down:
            self.attempts.append((time.monotonic(), False))
            raise BackendUnavailable("injected: extend failed")
        extended = await super().extend(key, token, lease=lease)
        self.attempts.append((time.monotonic(), extended))
        return extended


class FirstRunHeld:
    """Answers 201 with its run number; the first run is held until `gate` opens."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.runs = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        self.runs += 1
        if self.runs == 1:
            self.entered.set()
            await self.gate.wait()
        body = json.dumps({"run": self.runs}).encode()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


async def test_a_claim_this_process_holds_is_in_progress_even_when_its_lease_ran_out_in_the_store(
    backend: Backend, namespace: str
) -> None:
    """The holder's renewals fail (store unreachable for `extend`), so its lease runs out in the
    store, past its grace too; repeats in its own process are answered `request-in-progress`
    and the route's recover hook is never asked (its holder is alive: it is this process). Once the
    store answers again, the holder renews, stores its answer, and that is what replays."""
    store = FlakyRenewal(backend, down=True)
    asked: list[Record] = []

    async def recover(rkey: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
        asked.append(record)
        return "run"

    app, key = FirstRunHeld(), uuid.uuid4().hex
    rkey = RecordKey.build(namespace, None, key)
    mw = IdempotencyMiddleware(
        app,
        backend=store,
        routes=[RoutePolicy("/pay", single_tenant=True, lease=0.5, recover=recover)],
        namespace=namespace,
    )
    first = asyncio.create_task(post(mw, key))
    try:
        await asyncio.wait_for(app.entered.wait(), 5)
        await expired(backend, rkey)
        early = await post(mw, key)
        await asyncio.sleep(1.3)  # past the grace (1 s) of a lease seen expired
        late = await post(mw, key)
        assert [a.problem for a in (early, late)] == ["request-in-progress"] * 2, (early.body, late.body)
        assert asked == [] and app.runs == 1
        assert any(not ok for _, ok in store.attempts), "no renewal was attempted while the store failed"
        store.down = False
        await until(lambda: any(ok for _, ok in store.attempts), 2, "a renewal once the store answers")
    finally:
        store.down = False
        app.gate.set()
    original = await first
    assert original.status == 201 and not original.replayed
    replay = await post(mw, key)
    assert replay.replayed and replay.body == original.body and app.runs == 1 and asked == []


async def test_an_expired_lease_from_elsewhere_is_in_progress_until_its_grace_then_recovered(
    backend: Backend, namespace: str
) -> None:
    """A holder in another runtime died (lease 0.5 s): the first sightings of its expired lease are
    answered 409 `request-in-progress` with Retry-After, and the recover hook is not asked; once
    the same lease has stayed expired for its grace (1 s by the store's clock), it is recovered."""
    key = uuid.uuid4().hex
    rkey = RecordKey.build(namespace, None, key)
    await dead_holder(backend, namespace, key, lease=0.5)
    asked: list[Record] = []
    recovered = StoredResponse(201, [(b"content-type", b"application/json")], b'{"recovered": true}')

    async def recover(rkey: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
        asked.append(record)
        return recovered

    app = Payments()
    live = IdempotencyMiddleware(
        app,
        backend=backend,
        routes=[RoutePolicy("/pay", single_tenant=True, lease=0.5, recover=recover)],
        namespace=namespace,
    )
    await expired(backend, rkey)
    first = await post(live, key)
    second = await post(live, key)
    assert [a.problem for a in (first, second)] == ["request-in-progress"] * 2, (first.body, second.body)
    assert first.headers.get(b"retry-after") is not None
    assert asked == []
    await asyncio.sleep(1.2)
    after = await post(live, key)
    assert len(asked) == 1
    assert (after.status, after.body) == (201, recovered.body)
    assert app.runs[key] == 0


async def test_a_failed_renewal_is_retried_as_soon_as_the_store_answers_again(backend: Backend, namespace: str) -> None:
    """A 6 s lease is renewed every 2 s. The store fails `extend` from 1.5 s to 2.5 s, so the
    renewal due at 2 s fails: it is retried at once with backoff (at most 250 ms apart) and
    lands within half a second of the store answering again, not at the next tick 2 s later."""
    store = FlakyRenewal(backend)
    key = uuid.uuid4().hex
    rkey = RecordKey.build(namespace, None, key)
    async with claim(store, key, namespace=namespace, lease=6, ttl=60) as job:
        await asyncio.sleep(1.5)
        store.down = True
        await asyncio.sleep(1.0)
        store.down = False
        up = time.monotonic()
        await until(lambda: any(ok for _, ok in store.attempts), 3, "a renewal after the store came back")
        now = await seen(backend, rkey)
        await job.store("done")
    failed = [at for at, ok in store.attempts if not ok]
    landed = next(at for at, ok in store.attempts if ok)
    assert failed, "no renewal was attempted while the store failed"
    assert landed - up < 0.5, f"renewed {landed - up:.2f} s after the store answered again"
    assert now.record.lease_until - now.now > 5, "the lease in the store was not extended"
