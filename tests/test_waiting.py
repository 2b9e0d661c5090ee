"""`wait=` routes: repeats of a request in flight are held and answered with its stored answer.

In one process the holder hands its answer to the repeats it holds, so they make no store call
while it runs; a holder in another process (here: another middleware on the same store) is
told by the store when it ends (Redis pub/sub, Postgres LISTEN/NOTIFY), or else noticed by
polling with backoff. Counted through a store wrapper, on every real store. A held
repeat is woken once, by the end it waits for (counted: the futures it made), never by a timer of
its own, so holding 10,000 costs what adding them did (benchmarks/bench_held.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections import Counter
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.claims.waiting import Waiters
from tests.support.pay import Payments, post
from tests.support.servers import POSTGRES_DSN, RedisProcess, require, wait_until
from tests.support.stores import TEST_TABLE, Counting


class Gated(Payments):
    """Payments that answer `status` and hold each run until `gate` opens."""

    def __init__(self, status: int = 201) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.status = status

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.entered.set()
        await self.gate.wait()
        if self.status == 201:
            await super().__call__(scope, receive, send)
            return
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        self.runs[key] += 1
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b"busy"})


def protect(app: Any, store: Backend, namespace: str, wait: float = 5.0, lease: float = 30) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app,
        backend=store,
        routes=[RoutePolicy("/pay", single_tenant=True, wait=wait, lease=lease)],
        namespace=namespace,
    )


async def test_50_repeats_held_in_the_holders_process_make_no_store_call_while_it_runs(
    backend: Backend, namespace: str
) -> None:
    store = Counting(backend)
    app = Gated()
    mw = protect(app, store, namespace)
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(mw, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    repeats = [asyncio.create_task(post(mw, key)) for _ in range(50)]
    for _ in range(50):  # every repeat has made its one claim and is held
        if store.calls["claim"] == 51:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(1.5)  # longer than the poll backoff's whole ladder: nobody polls a local holder
    assert store.calls == Counter({"claim": 51})
    assert not any(r.done() for r in repeats)
    app.gate.set()
    original = await first
    answers = await asyncio.gather(*repeats)
    assert app.runs[key] == 1
    assert {(a.status, a.body, a.replayed) for a in answers} == {(201, original.body, True)}
    assert store.calls == Counter({"claim": 51, "complete": 1})


async def test_repeats_of_a_released_request_ask_the_store_again_and_one_of_them_runs(
    backend: Backend, namespace: str
) -> None:
    store = Counting(backend)
    app = Gated(status=503)  # transient: the claim is released, a retry must run
    mw = protect(app, store, namespace)
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(mw, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    repeats = [asyncio.create_task(post(mw, key)) for _ in range(10)]
    await asyncio.sleep(0.2)
    app.gate.set()
    assert (await first).status == 503
    answers = await asyncio.gather(*repeats)
    runs = app.runs[key]
    assert 2 <= runs <= 11, "each released run lets one held repeat run next, never two at once"
    assert sum(1 for a in answers if not a.replayed) == runs - 1
    assert all(a.status == 503 for a in answers)


async def test_a_repeat_held_on_a_holder_in_another_process_is_told_or_polls(backend: Backend, namespace: str) -> None:
    """The store tells the waiting process when the claim ends (claim, watch, claim: three calls
    however long the holder runs), Redis by pub/sub and Postgres by LISTEN/NOTIFY."""
    if type(backend).__name__ == "MemoryBackend":
        pytest.skip("two processes never share a memory store")
    app = Gated()
    holder = protect(app, backend, namespace)  # "worker 1"
    store = Counting(backend)
    other = protect(Payments(), store, namespace)  # "worker 2", same store, its own process state
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(holder, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    repeat = asyncio.create_task(post(other, key))
    await asyncio.sleep(0.9)  # only a notice (or a poll) wakes the repeat
    app.gate.set()
    original, replayed = await first, await repeat
    assert replayed.replayed and replayed.body == original.body
    assert store.calls == Counter({"claim": 2, "watch": 1})
    assert replayed.elapsed < 0.9 + 0.2, "told at once (a poll would wait up to 250 ms more)"


class CountingWaiters(Waiters):
    """Waiters that count the futures made: one per time a held repeat goes (back) to waiting."""

    __slots__ = ("made",)

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def watch(self, digest: str, token: int) -> asyncio.Future[Any]:
        self.made += 1
        return super().watch(digest, token)


async def test_repeats_held_on_a_holder_in_their_process_are_woken_once_by_its_answer(
    backend: Backend, namespace: str
) -> None:
    """Held for 2.5 s, each repeat waits on one future: its holder's answer resolves it (it used to
    wake every second to look again)."""
    store = Counting(backend)
    app = Gated()
    mw = protect(app, store, namespace, wait=10)
    waiters = CountingWaiters()
    mw.runtime = dataclasses.replace(mw.runtime, waiters=waiters)  # what each request is handed
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(mw, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    repeats = [asyncio.create_task(post(mw, key)) for _ in range(20)]
    await asyncio.sleep(2.5)  # what is measured: nothing may wake them, however long they are held
    assert waiters.made == 20 and store.calls == Counter({"claim": 21})
    app.gate.set()
    original = await first
    answers = await asyncio.gather(*repeats)
    assert {(a.status, a.body, a.replayed) for a in answers} == {(201, original.body, True)}
    assert waiters.made == 20 and not waiters
    assert app.runs[key] == 1


async def test_a_repeat_held_on_a_holder_in_another_process_is_woken_only_by_the_notice(
    backend: Backend, namespace: str
) -> None:
    if type(backend).__name__ == "MemoryBackend":
        pytest.skip("two processes never share a memory store")
    app = Gated()
    holder = protect(app, backend, namespace)
    store = Counting(backend)
    other = protect(Payments(), store, namespace, wait=10)
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(holder, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    repeat = asyncio.create_task(post(other, key))
    await asyncio.sleep(2.5)
    assert store.calls == Counter({"claim": 1, "watch": 1}), "no claim again before the notice"
    app.gate.set()
    original, replayed = await first, await repeat
    assert replayed.replayed and replayed.body == original.body
    assert store.calls == Counter({"claim": 2, "watch": 1})


async def test_a_repeat_held_on_a_holder_that_died_elsewhere_learns_when_its_lease_ends(
    backend: Backend, namespace: str
) -> None:
    """A holder that dies tells nobody: a repeat held on it is woken when the lease it saw ends,
    and answers `outcome-unknown` once that lease stayed over for its grace (1 s: a live holder
    would have renewed by then), not a 409 once its whole `wait` is over."""
    app = Gated()
    holder = IdempotencyMiddleware(
        app, backend=backend, routes=[RoutePolicy("/pay", single_tenant=True, lease=1.0)], namespace=namespace
    )
    other = protect(Payments(), backend, namespace, wait=8, lease=1.0)
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(holder, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    first.cancel()  # killed mid-run: the claim stays, nobody renews it
    with contextlib.suppress(asyncio.CancelledError):
        await first
    repeat = await post(other, key)
    assert repeat.problem == "outcome-unknown", repeat.body
    assert repeat.elapsed < 3.0


@pytest.mark.redis
async def test_repeats_watching_read_their_record_again_when_the_notices_are_cut(throwaway: RedisProcess) -> None:
    """A notice published while the subscription is down is never seen, so the cut itself wakes
    every watching repeat: it reads its record again (and polls until notices are back)."""
    namespace = f"t-{uuid.uuid4().hex}"
    holder_store = RedisBackend.from_url(throwaway.url)
    other_store = RedisBackend.from_url(throwaway.url)
    admin = aioredis.Redis.from_url(throwaway.url)
    try:
        app = Gated()
        holder = protect(app, holder_store, namespace)
        store = Counting(other_store)
        other = protect(Payments(), store, namespace, wait=10)
        key = uuid.uuid4().hex
        first = asyncio.create_task(post(holder, key))
        await asyncio.wait_for(app.entered.wait(), 5)
        repeat = asyncio.create_task(post(other, key))
        await wait_until(lambda: store.calls["watch"] == 1, 5)
        assert store.calls == Counter({"claim": 1, "watch": 1})
        assert await admin.client_kill_filter(_type="pubsub") >= 1
        await wait_until(lambda: store.calls["claim"] >= 2, 3)
        assert store.calls["claim"] >= 2, "the cut woke the repeat: it read its record again"
        app.gate.set()
        original, replayed = await first, await repeat
        assert replayed.replayed and replayed.body == original.body
    finally:
        await admin.aclose()
        await holder_store.aclose()
        await other_store.aclose()


@pytest.mark.postgres
async def test_postgres_repeats_watching_read_their_record_again_when_the_listening_connection_is_cut() -> None:
    """As on Redis: a NOTIFY sent while the LISTEN connection is down is never heard, so the cut
    itself (here pg_terminate_backend of that connection) wakes every watching repeat."""
    require("postgres", POSTGRES_DSN)
    namespace = f"t-{uuid.uuid4().hex}"
    holder_store = PostgresBackend.from_dsn(POSTGRES_DSN, table=TEST_TABLE)
    other_store = PostgresBackend.from_dsn(POSTGRES_DSN, table=TEST_TABLE)
    admin = await asyncpg.connect(POSTGRES_DSN)
    try:
        await holder_store.setup()
        app = Gated()
        holder = protect(app, holder_store, namespace)
        store = Counting(other_store)
        other = protect(Payments(), store, namespace, wait=10)
        key = uuid.uuid4().hex
        first = asyncio.create_task(post(holder, key))
        await asyncio.wait_for(app.entered.wait(), 5)
        repeat = asyncio.create_task(post(other, key))
        await wait_until(lambda: store.calls["watch"] == 1, 5)
        assert store.calls == Counter({"claim": 1, "watch": 1})
        await wait_until(lambda: other_store._notices is not None and other_store._notices.connection is not None, 5)
        notices = other_store._notices
        assert notices is not None and notices.connection is not None, "listening"
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", notices.connection.get_server_pid())
        await wait_until(lambda: store.calls["claim"] >= 2, 3)
        assert store.calls["claim"] >= 2, "the cut woke the repeat: it read its record again"
        app.gate.set()
        original, replayed = await first, await repeat
        assert replayed.replayed and replayed.body == original.body
    finally:
        await admin.close()
        await holder_store.aclose()
        await other_store.aclose()


async def test_many_repeats_held_on_a_holder_in_another_process_are_all_told_none_polls(
    backend: Backend, namespace: str
) -> None:
    """50 repeats in one process held on one claim of another: each claims, watches, and claims
    once more after the end, however long the hold (on Postgres they share one row update, which
    they would otherwise find locked by each other, and poll)."""
    if type(backend).__name__ == "MemoryBackend":
        pytest.skip("two processes never share a memory store")
    app = Gated()
    holder = protect(app, backend, namespace)
    store = Counting(backend)
    other = protect(Payments(), store, namespace, wait=10)
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(holder, key))
    await asyncio.wait_for(app.entered.wait(), 5)
    repeats = [asyncio.create_task(post(other, key)) for _ in range(50)]
    await wait_until(lambda: store.calls["watch"] == 50, 5)
    await asyncio.sleep(1.5)  # longer than the longest poll interval
    assert store.calls == Counter({"claim": 50, "watch": 50}), "nobody polled"
    app.gate.set()
    original = await first
    answers = await asyncio.gather(*repeats)
    assert {(a.status, a.body, a.replayed) for a in answers} == {(201, original.body, True)}
    assert store.calls == Counter({"claim": 100, "watch": 50})
