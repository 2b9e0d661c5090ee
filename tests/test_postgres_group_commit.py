"""Group commit on Postgres: claims and completions that arrive while one is on the wire go as one
statement, and each caller gets exactly the answer its own one-row statement would have given."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.errors import BackendError, BackendUnavailable
from idem_asgi.records import Claimed, Existing, RecordKey, StoredResponse
from tests.support.faultproxy import StoreProxy, pg_execute
from tests.support.servers import POSTGRES_DSN, require
from tests.support.stores import TEST_TABLE

pytestmark = [pytest.mark.asyncio, pytest.mark.postgres]
ANSWER = StoredResponse(201, [(b"content-type", b"application/json")], b'{"ok":true}')


async def _store(**options: object) -> PostgresBackend:
    require("postgres", POSTGRES_DSN)
    store = PostgresBackend.from_dsn(POSTGRES_DSN, table=TEST_TABLE, **options)  # type: ignore[arg-type]
    await store.setup()
    return store


@pytest.mark.parametrize("implementation", ["lean", "asyncpg"])
async def test_a_storm_over_many_keys_has_one_winner_per_key_and_goes_in_batches(implementation: str) -> None:
    """500 claims over 50 keys at once, 10 callers per key: exactly one wins each key, every other
    caller reads that winner's record, each winner's completion lands, and they went as batches."""
    store = await _store(implementation=implementation)
    ns = f"group-{uuid.uuid4().hex}"
    keys = [RecordKey.build(ns, None, f"k{i}") for i in range(50)]
    callers = [k for k in keys for _ in range(10)]
    random.shuffle(callers)
    try:
        results = await asyncio.gather(*(store.claim(k, b"fp", lease=30, ttl=600) for k in callers))
        winners = {k.digest: r.token for k, r in zip(callers, results, strict=True) if isinstance(r, Claimed)}
        assert len(winners) == 50
        for k, r in zip(callers, results, strict=True):
            if isinstance(r, Existing):
                assert r.record.token == winners[k.digest]
        done = await asyncio.gather(*(store.complete(k, winners[k.digest], ANSWER, ttl=600) for k in keys))
        assert all(done)
        again = await asyncio.gather(*(store.claim(k, b"fp", lease=30, ttl=600) for k in keys))
        assert all(isinstance(r, Existing) and r.record.response == ANSWER for r in again)
        sizes = store.batch_sizes
        assert max(sizes["claim"]) > 1 and max(sizes["complete"]) > 1, sizes
        assert sum(n * c for n, c in sizes["claim"].items()) >= 500 + 50
    finally:
        await store.aclose()


@pytest.mark.parametrize("implementation", ["lean", "asyncpg"])
async def test_repeats_of_one_key_released_over_and_over_each_claim_it_in_turn(implementation: str) -> None:
    """30 callers of one key, each releasing the claim as soon as it wins (a transient 503): each one
    claims it in turn and none runs out of tries. Claims of one key in one batch: one wins and the
    others get its claim (they used to see no row at all, and a storm of repeats of a released key
    spent its five tries on itself, answering 503)."""
    store = await _store(implementation=implementation)
    key = RecordKey.build(f"group-{uuid.uuid4().hex}", None, "released")
    wins: list[int] = []

    async def caller() -> None:
        while True:
            result = await store.claim(key, b"fp", lease=30, ttl=600)
            if isinstance(result, Claimed):
                wins.append(result.token)
                assert await store.release(key, result.token)
                return
            await asyncio.sleep(0)  # held: ask again (the middleware waits to be told)

    try:
        await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(30))), 30)
        assert len(wins) == len(set(wins)) == 30
        assert max(store.batch_sizes["claim"]) > 1, "the key's claims met in one statement"
    finally:
        await store.aclose()


async def test_a_completion_with_a_stale_token_is_fenced_out_inside_a_batch() -> None:
    """In one batch, the holder's completion lands and a stale token's is refused."""
    store = await _store()
    ns = f"group-{uuid.uuid4().hex}"
    keys = [RecordKey.build(ns, None, f"k{i}") for i in range(20)]
    try:
        claims = await asyncio.gather(*(store.claim(k, b"fp", lease=30, ttl=600) for k in keys))
        tokens = [c.token for c in claims if isinstance(c, Claimed)]
        assert len(tokens) == 20
        done = await asyncio.gather(
            *(
                store.complete(k, t if i % 2 else t + 1, ANSWER, ttl=600)
                for i, (k, t) in enumerate(zip(keys, tokens, strict=True))
            )
        )
        assert done == [bool(i % 2) for i in range(20)]
        assert max(store.batch_sizes["complete"]) > 1
    finally:
        await store.aclose()


async def test_a_row_the_store_refuses_fails_only_its_own_caller() -> None:
    """A key Postgres cannot store (a NUL character in a raw key) in a batch: the batch is sent again
    row by row, so that caller gets the error and the others their claims."""
    store = await _store(store_keys=True)
    ns = f"group-{uuid.uuid4().hex}"
    good = [RecordKey.build(ns, None, f"k{i}") for i in range(30)]
    bad = RecordKey.build(ns, None, "bad\x00key")
    try:
        await store.claim(RecordKey.build(ns, None, "warm"), b"fp", lease=30, ttl=600)  # records store_keys first
        calls = [store.claim(k, b"fp", lease=30, ttl=600) for k in good]
        calls.insert(15, store.claim(bad, b"fp", lease=30, ttl=600))
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(results.pop(15), BackendError)
        assert store.batches_split >= 1
        assert all(isinstance(r, Claimed) for r in results), results
    finally:
        await store.aclose()


async def test_batches_over_the_same_keys_in_opposite_orders_never_deadlock() -> None:
    """Two stores (two processes' worth of connections) claim the same 200 keys, one in order and one
    reversed, 10 rounds: no deadlock error, one winner per key each round. (Unsorted, two such
    batches each hold a row the other waits for, and Postgres aborts one of them.)"""
    first, second = await _store(), await _store()
    try:
        for round_ in range(10):
            ns = f"group-{uuid.uuid4().hex}"
            keys = [RecordKey.build(ns, None, f"k{i}") for i in range(200)]
            results = await asyncio.gather(
                *(first.claim(k, b"fp", lease=30, ttl=600) for k in keys),
                *(second.claim(k, b"fp", lease=30, ttl=600) for k in reversed(keys)),
            )
            won = sum(isinstance(r, Claimed) for r in results)
            assert won == 200, f"round {round_}: {won} winners"
        assert max(first.batch_sizes["claim"]) > 1 and max(second.batch_sizes["claim"]) > 1
        assert (first.batches_split, second.batches_split) == (0, 0)  # no batch was refused (deadlocked)
    finally:
        await first.aclose()
        await second.aclose()


async def test_a_caller_cancelled_while_its_batch_is_on_the_wire_leaves_no_claim_behind() -> None:
    """Callers cancelled mid-batch: the others get their answers, and the cancelled callers' claims
    (made by the batch all the same) are removed, so their keys are free again."""
    store = await _store()
    ns = f"group-{uuid.uuid4().hex}"
    keys = [RecordKey.build(ns, None, f"k{i}") for i in range(40)]
    try:
        tasks = [asyncio.ensure_future(store.claim(k, b"fp", lease=30, ttl=600)) for k in keys]
        await asyncio.sleep(0)
        await asyncio.sleep(0.001)
        for task in tasks[::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        kept = [k for k, r in zip(keys, results, strict=True) if isinstance(r, Claimed)]
        cancelled = [k for k, r in zip(keys, results, strict=True) if isinstance(r, asyncio.CancelledError)]
        assert cancelled and len(kept) + len(cancelled) == 40
        for _ in range(100):
            if all([await store.get(k) is None for k in cancelled]):
                break
            await asyncio.sleep(0.1)
        assert [k.key for k in cancelled if await store.get(k) is not None] == []
        assert all([await store.get(k) is not None for k in kept])
    finally:
        await store.aclose()


async def test_one_stuck_statement_does_not_hold_the_claims_queued_behind_it() -> None:
    """The reply to one key's claim is lost (its caller waits out its `timeout`): the claims that
    queued behind it go on another lane within `STUCK_AFTER` and succeed at once, and only the
    stuck caller gets the 503-worthy error, as without batching."""
    require("postgres", POSTGRES_DSN)
    port = int(POSTGRES_DSN.rsplit(":", 1)[1].split("/")[0])
    async with StoreProxy(port, protocol="pg") as proxy:
        dsn = f"postgresql://postgres@127.0.0.1:{proxy.port}/{POSTGRES_DSN.rsplit('/', 1)[1]}?sslmode=disable"
        store = PostgresBackend.from_dsn(dsn, table=TEST_TABLE, timeout=2.0)
        await store.setup()
        ns = f"group-{uuid.uuid4().hex}"
        stuck = RecordKey.build(ns, None, "stuck")
        others = [RecordKey.build(ns, None, f"k{i}") for i in range(20)]
        try:
            await store.claim(RecordKey.build(ns, None, "warm"), b"fp", lease=30, ttl=600)
            proxy.fault(pg_execute("WITH cur AS", param=store._id(stuck)[2].encode()), action="drop_reply")
            head = asyncio.ensure_future(store.claim(stuck, b"fp", lease=30, ttl=600))
            await asyncio.sleep(0.02)  # the stuck claim is on the wire
            started = time.monotonic()
            results = await asyncio.gather(*(store.claim(k, b"fp", lease=30, ttl=600) for k in others))
            took = time.monotonic() - started
            assert all(isinstance(r, Claimed) for r in results), results
            assert not head.done() and took < 1.0, f"the queued claims took {took:.2f} s behind the stuck one"
            with pytest.raises(BackendUnavailable):
                await head
            assert proxy.applied() == 1
        finally:
            proxy.pass_through()
            await store.aclose()
