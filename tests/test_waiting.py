"""`wait=` routes: repeats of a request in flight are held and answered with its stored answer.

In one process the holder hands its answer to the repeats it holds, so they make no store call
while it runs; a holder in another process (here: another middleware on the same store) is
noticed by polling with backoff. Counted through a store wrapper, on every real store.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend
from tests.support.pay import Payments, post
from tests.support.stores import Counting


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


def protect(app: Any, store: Backend, namespace: str, wait: float = 5.0) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app, backend=store, routes=[RoutePolicy("/pay", single_tenant=True, wait=wait)], namespace=namespace
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
    """Redis tells the waiting process when the claim ends (claim, watch, claim: three calls however
    long the holder runs); Postgres is polled with backoff (bounded)."""
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
    await asyncio.sleep(0.9)  # under the one-second check: only a notice (or a poll) wakes the repeat
    app.gate.set()
    original, replayed = await first, await repeat
    assert replayed.replayed and replayed.body == original.body
    if type(backend).__name__ == "RedisBackend":
        assert store.calls == Counter({"claim": 2, "watch": 1})
        assert replayed.elapsed < 1.0 + 0.5, "told at once, not at the next check"
    else:
        # The first claim, then polls 10 ms apart doubling to 250 ms: over the ~0.9 s hold that is
        # at most 9 polls (a fixed 10 ms poll would make 90).
        assert 2 <= store.calls["claim"] <= 10, store.calls
