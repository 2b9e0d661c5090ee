"""Fencing tokens nothing in the app can repeat (issue 25, item 1), on every store.

Claim tokens used to come from the global `random` generator, so a handler (or a library) that
seeds it made later claims draw the very token a live or completed record holds, and the stores
took "same token" for "our own claim": retries ran again, and claims in flight overwrote each
other's entry in the lease table, so a live claim lost its renewals. Now tokens come from
`secrets`; a stored token equal to ours is our own claim only while that record is in progress
under it with our fingerprint (a claim command retried after its reply was lost); and the lease
table is keyed by (record, token). The uvicorn storms with a reseeding app (1 and 2 workers) are in
tests/test_reliability_storms.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.backends._base import new_token
from idem_asgi.records import COMPLETED, Claimed, Existing, RecordKey, StoredResponse
from tests.support.pay import Answer, Payments, post

ANSWER = StoredResponse(201, [(b"content-type", b"application/json")], b'{"id": 1}')


@pytest.fixture(autouse=True)
def random_state() -> Iterator[None]:
    """These tests seed the global generator, as the apps they stand for do; put it back after."""
    state = random.getstate()
    yield
    random.setstate(state)


def test_tokens_do_not_follow_the_random_module() -> None:
    drawn = set()
    for _ in range(1000):
        random.seed(42)
        drawn.add(new_token())
    assert len(drawn) == 1000
    assert all(1 <= t <= 1 << 62 for t in drawn)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_worker_never_draws_its_parents_tokens() -> None:
    """Tokens are read from the OS in batches; a child forked with part of a batch unread (gunicorn
    --preload, multiprocessing) must not hand out the tokens its parent goes on drawing."""
    new_token()  # the parent holds a batch, most of it unread, when it forks
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next tokens, to the parent
        try:
            os.write(write, b",".join(str(new_token()).encode() for _ in range(100)))
        finally:
            os._exit(0)
    os.close(write)
    parents = {new_token() for _ in range(100)}
    with os.fdopen(read, "rb") as pipe:
        childs = {int(t) for t in pipe.read().split(b",")}
    os.waitpid(pid, 0)
    assert len(childs) == 100 and len(parents) == 100
    assert not parents & childs


# -- the stores: a token equal to the stored one is not proof of ownership -----------------------


@pytest.fixture
def same_token(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> int:
    """Every claim and takeover of `backend` draws this one token (what a seeded generator did)."""
    token = 4_242_424_242
    monkeypatch.setattr(sys.modules[type(backend).__module__], "new_token", lambda: token)
    return token


def key(namespace: str) -> RecordKey:
    return RecordKey.build(namespace, None, uuid.uuid4().hex)


async def test_a_claim_drawing_the_token_of_a_completed_record_replays_it(
    backend: Backend, namespace: str, same_token: int
) -> None:
    k = key(namespace)
    assert await backend.claim(k, b"fp", lease=30, ttl=60) == Claimed(same_token)
    assert await backend.complete(k, same_token, ANSWER, ttl=60)
    again = await backend.claim(k, b"fp", lease=30, ttl=60)
    assert isinstance(again, Existing) and again.record.state == COMPLETED
    assert again.record.response is not None and again.record.response.body == ANSWER.body


async def test_a_claim_drawing_the_holders_token_with_another_fingerprint_is_not_ours(
    backend: Backend, namespace: str, same_token: int
) -> None:
    k = key(namespace)
    assert await backend.claim(k, b"fp", lease=30, ttl=60) == Claimed(same_token)
    other = await backend.claim(k, b"another request", lease=30, ttl=60)
    assert isinstance(other, Existing) and other.record.fingerprint == b"fp"


async def test_a_claim_drawing_the_token_of_a_failed_holder_is_not_ours(
    backend: Backend, namespace: str, same_token: int
) -> None:
    k = key(namespace)
    assert await backend.claim(k, b"fp", lease=30, ttl=60) == Claimed(same_token)
    assert await backend.mark_failed(k, same_token)
    again = await backend.claim(k, b"fp", lease=30, ttl=60)
    assert isinstance(again, Existing) and again.record.holder_failed


async def test_a_takeover_drawing_the_token_of_a_completed_record_takes_nothing(
    backend: Backend, namespace: str, same_token: int
) -> None:
    k = key(namespace)
    assert await backend.claim(k, b"fp", lease=30, ttl=60) == Claimed(same_token)
    assert await backend.complete(k, same_token, ANSWER, ttl=60)
    taken = await backend.takeover(k, same_token, b"fp", lease=30, ttl=60)
    assert isinstance(taken, Existing) and taken.record.state == COMPLETED


# -- through the middleware: an app that reseeds `random` on every call --------------------------


class Reseeding(Payments):
    """Payments whose every call runs `random.seed(42)` as it starts and again as it ends (as a
    handler calling `transformers.set_seed` would), and waits for `gate` in between; `entered`
    gets the key of each call that started."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered: asyncio.Queue[str] = asyncio.Queue()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        random.seed(42)
        self.entered.put_nowait(dict(scope["headers"])[b"idempotency-key"].decode())
        await self.gate.wait()
        await super().__call__(scope, receive, send)
        random.seed(42)


def protect(app: Any, backend: Backend, namespace: str, **policy: Any) -> IdempotencyMiddleware:
    route = RoutePolicy("/pay", single_tenant=True, **policy)
    return IdempotencyMiddleware(app, backend=backend, routes=[route], namespace=namespace)


async def answered(requests: list[asyncio.Task[Answer]]) -> None:
    """Until every request is answered; bounded, since a request run by mistake waits for the gate."""
    await asyncio.wait(requests, timeout=3)


async def test_an_app_that_reseeds_random_runs_each_key_once_under_concurrent_and_late_retries(
    backend: Backend, namespace: str
) -> None:
    app = Reseeding()
    app.gate.set()
    mw = protect(app, backend, namespace)
    assert (await post(mw, uuid.uuid4().hex)).status == 201  # a call has reseeded: claims now draw alike
    app.entered.get_nowait()
    keys = [uuid.uuid4().hex for _ in range(4)]
    for k in keys:
        app.gate.clear()
        first = asyncio.create_task(post(mw, k))
        assert await asyncio.wait_for(app.entered.get(), 5) == k
        meanwhile = [asyncio.create_task(post(mw, k)) for _ in range(5)]
        await answered(meanwhile)
        app.gate.set()
        original = await first
        assert original.status == 201 and not original.replayed
        assert [a.problem for a in await asyncio.gather(*meanwhile)] == ["request-in-progress"] * 5
        late = await asyncio.gather(*(post(mw, k) for _ in range(3)))
        assert {(a.status, a.body, a.replayed) for a in late} == {(201, original.body, True)}
    assert {k: app.runs[k] for k in keys} == dict.fromkeys(keys, 1)


async def test_claims_held_at_once_by_an_app_that_reseeds_random_all_keep_their_leases(
    backend: Backend, namespace: str
) -> None:
    """Three claims in flight together, each drawn after the previous call reseeded: the lease
    table must renew every one of them. A claim whose renewals stopped would expire while its app
    runs and (with `reclaim`) run a second time."""
    app = Reseeding()
    mw = protect(app, backend, namespace, lease=0.3, on_expired="reclaim")
    keys = [uuid.uuid4().hex for _ in range(3)]
    firsts = []
    for k in keys:
        firsts.append(asyncio.create_task(post(mw, k)))
        assert await asyncio.wait_for(app.entered.get(), 5) == k
    await asyncio.sleep(1.2)  # four leases: only renewals keep the claims alive this long
    retries = [asyncio.create_task(post(mw, k)) for k in keys]
    await answered(retries)
    app.gate.set()
    assert [a.status for a in await asyncio.gather(*firsts)] == [201] * 3
    assert [a.problem for a in await asyncio.gather(*retries)] == ["request-in-progress"] * 3
    assert app.runs == Counter(dict.fromkeys(keys, 1))


async def test_claims_on_other_keys_that_drew_one_token_all_keep_their_leases(
    backend: Backend, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease table never lets two claims overwrite each other, whatever their tokens: here the
    first three claims draw one token (the retries draw fresh ones)."""
    drawn = iter([4_242_424_242] * 3)
    module = sys.modules[type(backend).__module__]
    monkeypatch.setattr(module, "new_token", lambda: next(drawn, None) or new_token())
    app = Reseeding()
    mw = protect(app, backend, namespace, lease=0.3, on_expired="reclaim")
    keys = [uuid.uuid4().hex for _ in range(3)]
    firsts = [asyncio.create_task(post(mw, k)) for k in keys]
    assert {await asyncio.wait_for(app.entered.get(), 5) for _ in keys} == set(keys)
    await asyncio.sleep(1.2)
    retries = [asyncio.create_task(post(mw, k)) for k in keys]
    await answered(retries)
    app.gate.set()
    assert [a.status for a in await asyncio.gather(*firsts)] == [201] * 3
    assert [a.problem for a in await asyncio.gather(*retries)] == ["request-in-progress"] * 3
    assert app.runs == Counter(dict.fromkeys(keys, 1))
