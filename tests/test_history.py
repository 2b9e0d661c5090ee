"""Each key's history (`idem_asgi.history`), on every store: what a key went through, written off the
request path by the store's trail (`claims.trail.Trail`), bounded, counted, expiring with its record.

Every test reads the history back from the real store (memory, Redis, Postgres) and polls for the
background writes rather than sleeping for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import asyncpg
import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend, Histories, Maintenance, MemoryBackend
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.claims.runtime import machinery_for
from idem_asgi.claims.trail import Trail
from idem_asgi.history import Step
from idem_asgi.ops.resolving import resolve_key
from idem_asgi.records import Claimed, RecordKey
from tests.support.asgi import read_body
from tests.support.servers import POSTGRES_DSN
from tests.support.stores import BACKENDS, TEST_TABLE, Delegating, make_backend

WITHIN = 5.0
"""Seconds a background history write may take to show."""
ME = f"{socket.gethostname()}:{os.getpid()}"
"""`by` of every step this process writes (`history.this_process`)."""


class Kept(Backend, Histories, Protocol):
    """A store that keeps histories (all three built-in stores do)."""


async def open_store(name: str, history: int, *, table: str = TEST_TABLE) -> Kept:
    """A fresh, isolated store of the named kind keeping `history` steps per key (Postgres: in `table`)."""
    store: Any = await make_backend(cast(Any, name), history=history, table=table)
    assert isinstance(store, Histories) and store.history == history
    return cast(Kept, store)


class App:
    """Counts its runs per key; answers with the status the body asks for (`{"status": 202}`), 201 else."""

    def __init__(self, delay: float = 0.0) -> None:
        self.runs: Counter[str] = Counter()
        self.delay = delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        self.runs[key] += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        status = int(json.loads(body or b"{}").get("status", 201))
        payload = json.dumps({"key": key, "run": self.runs[key]}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def protect(app: App, store: Backend, namespace: str, *, ttl: float = 3600) -> IdempotencyMiddleware:
    route = RoutePolicy("/pay", methods=["POST"], single_tenant=True, ttl=ttl, lease=min(30, ttl))
    return IdempotencyMiddleware(app, backend=store, routes=[route], namespace=namespace)


def client_of(mw: IdempotencyMiddleware) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://test")


async def pay(client: httpx.AsyncClient, key: str, body: str = '{"amount": 1}', *, after: float = 0) -> httpx.Response:
    if after:
        await asyncio.sleep(after)
    return await client.post("/pay", content=body, headers={"Idempotency-Key": key})


def replayed(response: httpx.Response) -> bool:
    said: str | None = response.headers.get("idempotent-replayed")
    return said == "true"


def key_of(namespace: str, key: str) -> RecordKey:
    return RecordKey.build(namespace, "", key)


def whats(steps: Sequence[Step]) -> list[str]:
    return [step.what for step in steps]


def counted(steps: Sequence[Step], *kinds: str) -> int:
    """The `n` of every step of these kinds, summed."""
    return sum(step.n for step in steps if step.what in kinds)


async def history_until(
    store: Histories, key: RecordKey, done: Callable[[list[Step]], bool], within: float = WITHIN
) -> list[Step]:
    """The key's history once `done` holds of it (polled); fails with the last one read after `within` s."""
    deadline = time.monotonic() + within
    while True:
        steps = await store.read_history(key)
        if done(steps):
            return steps
        if time.monotonic() > deadline:
            raise AssertionError(f"history of {key.key!r} never got there within {within} s: {steps}")
        await asyncio.sleep(0.01)


async def until(check: Callable[[], bool], what: str, within: float = WITHIN) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within} s")
        await asyncio.sleep(0.01)


def trail_of(store: Backend) -> Trail:
    trail = machinery_for(store).trail
    assert trail is not None, "a store with history > 0 has a trail"
    return trail


def ended(last: str, n: int = 1) -> Callable[[list[Step]], bool]:
    """The history ends with a `last` step counted `n` times."""
    return lambda steps: bool(steps) and steps[-1].what == last and steps[-1].n == n


def ended_since(last: str, since: float) -> Callable[[list[Step]], bool]:
    """The history ends with a `last` step that happened at `since` or later."""
    return lambda steps: bool(steps) and steps[-1].what == last and steps[-1].at >= since


# -- 1. a key's life ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_a_keys_life_claimed_completed_replays_counted_across_batches_and_a_mismatch(
    name: str, namespace: str
) -> None:
    store = await open_store(name, history=16)
    key = key_of(namespace, "k1")
    try:
        async with client_of(protect(App(), store, namespace)) as client:
            first = await pay(client, "k1")
            assert first.status_code == 201 and not replayed(first)
            steps = await history_until(store, key, ended("completed"))
            record = await store.get(key)
            assert record is not None and record.token
            token = str(record.token)[:8]
            claimed, completed = steps
            assert (claimed.what, claimed.token, claimed.by) == ("claimed", token, ME)
            assert (completed.what, completed.token, completed.by, completed.status) == ("completed", token, ME, 201)
            assert claimed.at <= completed.at

            # Replays one batch at a time (each written before the next is made): the store merges them.
            for n in (1, 2, 3):
                again = await pay(client, "k1")
                assert again.status_code == 201 and replayed(again) and again.content == first.content
                await history_until(store, key, ended("replayed", n))
            # ... and three more at once, in whatever batches the trail makes of them.
            for _ in range(3):
                again = await pay(client, "k1")
                assert again.status_code == 201 and replayed(again)
            steps = await history_until(store, key, ended("replayed", 6))
            assert whats(steps) == ["claimed", "completed", "replayed"]

            other = await pay(client, "k1", '{"amount": 2}')
            assert other.status_code == 422
            steps = await history_until(store, key, ended("mismatch"))
        assert whats(steps) == ["claimed", "completed", "replayed", "mismatch"]
        assert steps[2].n == 6 and steps[2].by == ME
        assert steps[3].n == 1 and steps[3].by == ME
        assert [s.at for s in steps] == sorted(s.at for s in steps)
    finally:
        await store.aclose()


# -- 2. bounded --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_the_history_keeps_the_newest_steps_oldest_first(name: str, namespace: str) -> None:
    store = await open_store(name, history=4)
    key = key_of(namespace, "bounded")
    try:
        async with client_of(protect(App(), store, namespace)) as client:
            assert (await pay(client, "bounded")).status_code == 201
            await history_until(store, key, ended("completed"))
            # Seven distinct steps in all: claimed, completed, then replayed and mismatch alternating.
            started: list[float] = []
            for i, what in enumerate(["replayed", "mismatch", "replayed", "mismatch", "replayed"]):
                started.append(time.time())
                body = '{"amount": 1}' if what == "replayed" else f'{{"amount": {i + 10}}}'
                response = await pay(client, "bounded", body)
                assert response.status_code == (201 if what == "replayed" else 422)
                await history_until(store, key, ended_since(what, started[-1]))
        steps = await store.read_history(key)
        assert whats(steps) == ["mismatch", "replayed", "mismatch", "replayed"]
        assert all(step.n == 1 for step in steps)
        # the newest four: the steps of the 2nd to 5th repeats, oldest first
        assert all(step.at >= started[i + 1] for i, step in enumerate(steps))
        assert steps[0].at < started[2] and steps[-1].at >= started[4]
    finally:
        await store.aclose()


# -- 3. expiry ---------------------------------------------------------------------------------------


async def test_redis_history_list_lives_as_long_as_its_record(namespace: str) -> None:
    store = await open_store("redis", history=16)
    assert isinstance(store, RedisBackend)
    try:
        async with client_of(protect(App(), store, namespace, ttl=30)) as client:
            key = key_of(namespace, "lives")
            assert (await pay(client, "lives")).status_code == 201
            await history_until(store, key, ended("completed"))
            record_ms = await store.client.pttl(f"{store.prefix}{{{key.digest}}}")
            list_ms = await store.client.pttl(f"{store.prefix}h{{{key.digest}}}")
            assert 25_000 < record_ms <= 30_000
            assert abs(list_ms - record_ms) < 1000, (list_ms, record_ms)

            # A short TTL: the list goes with its record.
            short = key_of(namespace, "short")
        async with client_of(protect(App(), store, namespace, ttl=1)) as client:
            assert (await pay(client, "short")).status_code == 201
            await history_until(store, short, ended("completed"))
            assert await store.client.exists(f"{store.prefix}h{{{short.digest}}}") == 1
            await asyncio.sleep(1.2)
            assert await store.get(short) is None
            assert await store.client.exists(f"{store.prefix}h{{{short.digest}}}") == 0
            assert await store.read_history(short) == []
    finally:
        await store.aclose()


async def test_postgres_history_row_expires_with_its_record_and_purge_deletes_it(namespace: str) -> None:
    # A table of its own: a purge run meanwhile by another test (the shared table's) cannot take the row first.
    store = await open_store("postgres", history=16, table=f"idem_test_{uuid.uuid4().hex[:12]}")
    assert isinstance(store, PostgresBackend)
    key = key_of(namespace, "expires")
    conn = await asyncpg.connect(POSTGRES_DSN)
    rows = f"SELECT count(*) FROM {store.history_table} WHERE namespace = $1"
    try:
        async with client_of(protect(App(), store, namespace, ttl=1)) as client:
            assert (await pay(client, "expires")).status_code == 201
            await history_until(store, key, ended("completed"))
        assert await conn.fetchval(rows, namespace) == 1
        await asyncio.sleep(1.2)
        assert await store.get(key) is None
        assert await store.read_history(key) == []  # past its expiry: never read
        assert await conn.fetchval(rows, namespace) == 1  # still there, until purged
        assert await store.purge() >= 1  # its record, at least
        assert await conn.fetchval(rows, namespace) == 0
        assert await store.read_history(key) == []
    finally:
        await store.aclose()
        await conn.execute(f"DROP TABLE IF EXISTS {store.table}, {store.history_table}")
        await conn.close()


async def test_memory_history_expires_with_its_record(namespace: str) -> None:
    now = [time.time()]
    store = MemoryBackend(history=16, clock=lambda: now[0])
    key = key_of(namespace, "expires")
    try:
        async with client_of(protect(App(), store, namespace, ttl=60)) as client:
            assert (await pay(client, "expires")).status_code == 201
            await history_until(store, key, ended("completed"))
        now[0] += 59
        assert await store.get(key) is not None
        assert whats(await store.read_history(key)) == ["claimed", "completed"]
        now[0] += 2
        assert await store.get(key) is None
        assert await store.read_history(key) == []
        await store.purge()
        assert await store.read_history(key) == []
    finally:
        await store.aclose()


# -- 4. off the request path -------------------------------------------------------------------------


class SlowHistory(Delegating):
    """`write_history` takes 2 s (or until `go` is set), then writes to the store."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.go = asyncio.Event()
        self.started = 0

    async def write_history(self, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
        self.started += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.go.wait(), 2.0)
        await cast(Histories, self.inner).write_history(batch)


class BrokenHistory(Delegating):
    """`write_history` always fails."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls = 0

    async def write_history(self, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
        self.calls += 1
        raise ConnectionError("the history store is down")


@pytest.mark.parametrize("name", BACKENDS)
async def test_a_slow_history_write_does_not_slow_requests(name: str, namespace: str) -> None:
    inner = await open_store(name, history=16)
    store = SlowHistory(inner)
    trail = trail_of(store)
    try:
        async with client_of(protect(App(), store, namespace)) as client:
            assert (await pay(client, "first")).status_code == 201
            await until(lambda: store.started == 1, "the first history write started")
            started = time.monotonic()  # ... and is on the wire while 20 requests run
            for i in range(20):
                assert (await pay(client, f"slow-{i}")).status_code == 201
            elapsed = time.monotonic() - started
            assert elapsed < 1.0, f"20 requests took {elapsed:.2f} s"
            assert trail.written == 0 and trail.pending  # nothing written yet: the requests did not wait for it
            store.go.set()
            await until(lambda: trail.written == 42 and not trail.pending, "every step written")
            assert trail.failed == 0 and trail.dropped == 0
            for i in (0, 19):
                steps = await inner.read_history(key_of(namespace, f"slow-{i}"))
                assert whats(steps) == ["claimed", "completed"]
    finally:
        store.go.set()
        await store.aclose()


@pytest.mark.parametrize("name", BACKENDS)
async def test_a_failing_history_write_fails_no_request_and_is_counted(name: str, namespace: str) -> None:
    inner = await open_store(name, history=16)
    store = BrokenHistory(inner)
    trail = trail_of(store)
    app = App()
    try:
        async with client_of(protect(app, store, namespace)) as client:
            for i in range(10):
                first = await pay(client, f"broken-{i}")
                assert first.status_code == 201 and not replayed(first)
                again = await pay(client, f"broken-{i}")
                assert again.status_code == 201 and replayed(again) and again.content == first.content
            # claimed, completed, replayed for each key: 30 steps, none written
            await until(lambda: trail.failed == 30 and not trail.pending, "every step counted as failed")
            assert trail.written == 0 and trail.dropped == 0 and store.calls >= 1
            assert app.runs == Counter({f"broken-{i}": 1 for i in range(10)})
            assert await inner.read_history(key_of(namespace, "broken-0")) == []
    finally:
        await store.aclose()


# -- 5. retry storms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_a_retry_storm_on_one_key_runs_once_and_its_history_counts_every_repeat(
    name: str, namespace: str
) -> None:
    store = await open_store(name, history=64)
    app = App(delay=0.05)
    key = key_of(namespace, "storm")
    try:
        async with client_of(protect(app, store, namespace)) as client:
            # Half at once (refused while it runs), half trickling in over 0.4 s (most replayed).
            delays = [0.0] * 100 + [i * 0.004 for i in range(100)]
            responses = await asyncio.gather(*[pay(client, "storm", after=d) for d in delays])
            assert app.runs == Counter({"storm": 1})
            statuses = Counter("replay" if replayed(r) else r.status_code for r in responses)
            assert statuses[201] == 1 and statuses[409] + statuses["replay"] == 199, statuses
            assert statuses[409] >= 99 and statuses["replay"] > 0, statuses
            steps = await history_until(
                store,
                key,
                lambda s: "completed" in whats(s) and counted(s, "replayed", "conflict") == 199,
            )
        assert Counter(whats(steps))["claimed"] == 1 and Counter(whats(steps))["completed"] == 1
        assert set(whats(steps)) <= {"claimed", "completed", "replayed", "conflict"}
        assert whats(steps).index("claimed") < whats(steps).index("completed")
        assert counted(steps, "conflict") == statuses[409]
        assert counted(steps, "replayed") == statuses["replay"]
        assert len(steps) < 64  # the repeats were counted into a few steps, not one each
    finally:
        await store.aclose()


@pytest.mark.parametrize("name", BACKENDS)
async def test_a_storm_over_fifty_keys_runs_each_once_with_one_claim_and_completion_each(
    name: str, namespace: str
) -> None:
    store = await open_store(name, history=16)
    app = App(delay=0.05)
    keys = [f"order-{i}" for i in range(50)]
    try:
        async with client_of(protect(app, store, namespace)) as client:
            responses = await asyncio.gather(*[pay(client, k) for k in keys for _ in range(10)])
        assert app.runs == Counter(dict.fromkeys(keys, 1))
        assert sum(1 for r in responses if r.status_code == 201 and not replayed(r)) == 50
        for k in keys:
            steps = await history_until(
                store,
                key_of(namespace, k),
                lambda s: "completed" in whats(s) and counted(s, "replayed", "conflict") == 9,
            )
            kinds = Counter(whats(steps))
            assert kinds["claimed"] == 1 and kinds["completed"] == 1, steps
            assert set(kinds) <= {"claimed", "completed", "replayed", "conflict"}
    finally:
        await store.aclose()


# -- 6. an operator's resolve ------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_an_operators_resolve_is_kept_even_without_history(name: str, namespace: str) -> None:
    store = await open_store(name, history=0)
    assert machinery_for(store).trail is None  # requests write no steps here
    key = key_of(namespace, "stuck")
    try:
        at = time.time()
        claimed = await store.claim(key, b"fp", lease=0.05, ttl=60)
        assert isinstance(claimed, Claimed)
        token = str(claimed.token)[:8]
        await asyncio.sleep(0.15)  # its lease is over: its holder is gone
        result = await resolve_key(store, key, claimed.token, "release", by="alice via test", older_than=0)
        assert result.done and result.verdict == "released"
        steps = await store.read_history(key)  # written by resolve_key itself: no trail to wait for
        # The claim's own step was never written (no history, as for a holder killed at once):
        # the resolve writes it as the record told it, then its own.
        assert whats(steps) == ["claimed", "resolved"], steps
        lost, step = steps
        assert lost.token == token and lost.note.startswith("read from the record") and abs(lost.at - at) < 1
        assert (step.what, step.by, step.note) == ("resolved", "alice via test", "released")
        assert step.token == token and step.status is None and step.n == 1 and step.at >= lost.at
        assert result.steps == [step]

        # The key runs again through a route; the store (history=0) adds none of its steps.
        async with client_of(protect(App(), store, namespace)) as client:
            assert (await pay(client, "stuck")).status_code == 201
            assert (await pay(client, "stuck")).status_code == 201
        await asyncio.sleep(0.1)
        assert await store.read_history(key) == steps
    finally:
        await store.aclose()


# -- 7. isolation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BACKENDS)
async def test_histories_of_keys_and_namespaces_never_mix(name: str, namespace: str) -> None:
    store = await open_store(name, history=16)
    a, b = f"{namespace}-a", f"{namespace}-b"
    try:
        async with client_of(protect(App(), store, a)) as in_a, client_of(protect(App(), store, b)) as in_b:
            assert (await pay(in_a, "k", '{"status": 201}')).status_code == 201
            assert replayed(await pay(in_a, "k", '{"status": 201}'))
            assert (await pay(in_b, "k", '{"status": 202}')).status_code == 202  # same key, other namespace
            assert (await pay(in_a, "k2", '{"status": 203}')).status_code == 203
            assert (await pay(in_a, "k2", '{"status": 201}')).status_code == 422
        a_k = await history_until(store, key_of(a, "k"), ended("replayed"))
        b_k = await history_until(store, key_of(b, "k"), ended("completed"))
        a_k2 = await history_until(store, key_of(a, "k2"), ended("mismatch"))
        assert whats(a_k) == ["claimed", "completed", "replayed"] and a_k[1].status == 201
        assert whats(b_k) == ["claimed", "completed"] and b_k[1].status == 202
        assert whats(a_k2) == ["claimed", "completed", "mismatch"] and a_k2[1].status == 203
        assert len({a_k[0].token, b_k[0].token, a_k2[0].token}) == 3
        assert await store.read_history(key_of(b, "k2")) == []
        assert await store.read_history(key_of(namespace, "k")) == []

        # A stuck claim beside the histories: the record scan lists it alone, and meets no history.
        stuck = key_of(a, "stuck")
        claimed = await store.claim(stuck, b"fp", lease=0.05, ttl=60)
        assert isinstance(claimed, Claimed)
        await asyncio.sleep(0.15)
        assert isinstance(store, Maintenance)
        listed = await store.stale(older_than=0, namespace=a)
        assert [(s.key.digest, s.record.token) for s in listed] == [(stuck.digest, claimed.token)]
        if isinstance(store, RedisBackend):  # its own prefix: a scan of every record of the store
            assert await store.client.exists(f"{store.prefix}h{{{key_of(a, 'k').digest}}}") == 1
            listed = await store.stale(older_than=0)
            assert [(s.key.digest, s.record.token) for s in listed] == [(stuck.digest, claimed.token)]
    finally:
        await store.aclose()


@pytest.mark.postgres
async def test_a_postgres_table_without_its_history_table_still_serves_the_tools() -> None:
    """A table made before histories existed (or by an app without `history`) has no
    `<table>_history`: reading a key's history finds none, `purge()` still purges, a store without
    `history` never asks to create it (its role may not), and one with `history` creates it."""
    table = f"idem_test_{uuid.uuid4().hex[:12]}"
    store = await make_backend("postgres", table=table)
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        await conn.execute(f'DROP TABLE "{table}_history"')  # as an earlier release left it
        key = RecordKey.build("ns", "", "k")
        assert isinstance(await store.claim(key, b"fp", lease=30, ttl=0.5), Claimed)
        await asyncio.sleep(0.6)
        assert await store.read_history(key) == []
        assert await store.purge() == 1
        again = PostgresBackend.from_dsn(POSTGRES_DSN, table=table, create_table=True)
        await again.setup()  # history off: nothing to create, so no DDL (and no CREATE right needed)
        await again.aclose()
        assert not await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{table}_history")
        kept = PostgresBackend.from_dsn(POSTGRES_DSN, table=table, history=4)
        await kept.setup()
        await kept.aclose()
        assert await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", f"{table}_history")
    finally:
        await store.aclose()
        await conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_history"')
        await conn.close()


@pytest.mark.parametrize("name", BACKENDS)
async def test_a_jobs_history_has_its_claim_completion_and_repeats(name: str, namespace: str) -> None:
    """The same history for a job as for a request: every surface's steps go through one claim core."""
    from idem_asgi.jobs import idempotent

    store = await open_store(name, 16)
    runs: list[str] = []
    try:

        @idempotent(store, key=lambda order: f"charge:{order}", namespace=namespace, wait=5)
        async def charge(order: str) -> int:
            runs.append(order)
            await asyncio.sleep(0.05)
            return len(runs)

        results = await asyncio.gather(*(charge("o-1") for _ in range(10)))
        assert runs == ["o-1"] and set(results) == {1}
        key = RecordKey.build(namespace, None, "charge:o-1")
        steps = await history_until(store, key, lambda s: counted(s, "replayed", "conflict") >= 9)
        assert [s.what for s in steps if s.what in ("claimed", "completed")] == ["claimed", "completed"], steps
        assert counted(steps, "replayed", "conflict") == 9, steps
    finally:
        await store.aclose()


@pytest.mark.parametrize("name", BACKENDS)
async def test_reconcile_writes_who_resolved_each_key(name: str, namespace: str) -> None:
    """`reconcile()` (and `idem-asgi reconcile`) leaves a `resolved` step in each key it resolved,
    naming the run; a key its resolver left alone gets none."""
    from idem_asgi.ops.reconcile import reconcile

    store = await open_store(name, 16)
    try:
        keys = [RecordKey.build(namespace, "", k) for k in ("released", "left")]
        tokens = []
        for key in keys:
            claimed = await store.claim(key, b"fp", lease=0.05, ttl=60)
            assert isinstance(claimed, Claimed)
            tokens.append(claimed.token)
        await asyncio.sleep(0.1)
        report = await reconcile(
            store,  # type: ignore[arg-type]
            lambda s: "release" if s.record.token == tokens[0] else None,
            older_than=0,
            namespace=namespace,
        )
        assert (report.released, report.unresolved) == (1, 1)
        steps = await store.read_history(keys[0])
        assert [(s.what, s.by, s.token) for s in steps] == [("resolved", f"reconcile on {ME}", str(tokens[0])[:8])], (
            steps
        )
        assert "released" in steps[0].note
        assert await store.read_history(keys[1]) == []
    finally:
        await store.aclose()
