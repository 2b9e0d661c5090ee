"""The writes that end a claim (an answer, a release, a lease end) are made again in the background
when the store failed to take them, fenced by the claim's token.

The network stores are covered under real faults by tests/test_lost_acks.py (completion request
lost twice, rolled back twice), tests/test_storm_faults.py and tests/test_lost_releases.py (a
release lost in a 3 s partition); here the store is the memory one behind a wrapper that fails on
cue, so each branch of the retry is pinned down.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.claims import late_writes as _late_writes
from idem_asgi.errors import BackendUnavailable
from idem_asgi.observe import Event
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, RecordKey, StoredResponse
from tests.support.asgi import Result, drive, http_scope

pytestmark = pytest.mark.memory

KEY = "late-1"


class Charge:
    """Counts executions; each answers 201 with its own charge number."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        self.calls += 1
        body = json.dumps({"charge": self.calls}).encode()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class FlakyStore(MemoryBackend):
    """`complete` fails the next `failures` times: before writing, or (`lose_reply`) after writing.
    So do `release` and `mark_failed`, the next `release_failures` and `fail_failures` times."""

    def __init__(
        self, failures: int = 0, *, lose_reply: bool = False, release_failures: int = 0, fail_failures: int = 0
    ) -> None:
        super().__init__()
        self.failures = failures
        self.lose_reply = lose_reply
        self.completes = 0
        self.failing = Counter({"release": release_failures, "mark_failed": fail_failures})
        self.calls: Counter[str] = Counter()

    async def release(self, key: RecordKey, token: int) -> bool:
        return await self._flaky("release", super().release(key, token))

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        return await self._flaky("mark_failed", super().mark_failed(key, token))

    async def _flaky(self, op: str, write: Coroutine[Any, Any, bool]) -> bool:
        self.calls[op] += 1
        if self.failing[op] > 0:
            self.failing[op] -= 1
            if self.lose_reply:
                await write
            else:
                write.close()
            raise BackendUnavailable(f"injected: {op} failed")
        return await write

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        self.completes += 1
        if self.failures > 0:
            self.failures -= 1
            if self.lose_reply:
                await super().complete(key, token, response, ttl=ttl)
            raise BackendUnavailable("injected: completion failed")
        return await super().complete(key, token, response, ttl=ttl)


def protect(app: Any, store: MemoryBackend, events: list[Event]) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app, backend=store, routes=[RoutePolicy("/payments", single_tenant=True)], observer=events.append
    )


async def post(mw: IdempotencyMiddleware) -> Result:
    return await drive(mw, http_scope(key=KEY), [b'{"amount":1}'])


async def settled(mw: IdempotencyMiddleware) -> None:
    """Wait until the middleware's background writes are done."""
    tasks = set(mw.late._tasks)
    if tasks:
        await asyncio.wait(tasks, timeout=5)
    assert mw.late.pending == 0


def record_key() -> RecordKey:
    return RecordKey.build("idem", None, KEY)


async def test_failed_completion_is_stored_by_a_later_attempt_and_then_replayed() -> None:
    app, store = Charge(), FlakyStore(failures=2)
    events: list[Event] = []
    mw = protect(app, store, events)

    first = await post(mw)
    assert first.status == 201  # the client gets its answer although the store failed
    meanwhile = await post(mw)
    assert meanwhile.status == 409 and b"request-in-progress" in meanwhile.body  # claim kept, not run again

    await settled(mw)
    replay = await post(mw)

    assert app.calls == 1
    assert store.completes == 3  # two failures, then the background write
    assert replay.header("idempotent-replayed") == b"true" and replay.body == first.body
    record = await store.get(record_key())
    assert record is not None and record.state == COMPLETED
    names = Counter(e.name for e in events)
    assert names["store_error"] == 1 and names["completed"] == 1


async def test_completion_whose_reply_was_lost_is_recognised_not_rewritten() -> None:
    # The first write landed, its reply did not: the retry's write is refused (no longer in
    # progress) and the record read back shows our own token, so it counts as stored.
    app, store = Charge(), FlakyStore(failures=1, lose_reply=True)
    events: list[Event] = []
    mw = protect(app, store, events)

    first = await post(mw)
    await settled(mw)
    replay = await post(mw)

    assert app.calls == 1 and store.completes == 2
    assert replay.body == first.body and replay.header("idempotent-replayed") == b"true"
    assert [e.name for e in events].count("completed") == 1
    assert "lease_lost" not in [e.name for e in events]


async def test_a_takeover_meanwhile_fences_the_late_write_off(caplog: pytest.LogCaptureFixture) -> None:
    app, store = Charge(), FlakyStore(failures=1)
    events: list[Event] = []
    mw = protect(app, store, events)
    gate = asyncio.Event()
    original = store.complete

    async def complete_after_takeover(key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        if store.completes == 1:  # the background attempt: another holder takes the key over first
            current = await store.get(key)
            assert current is not None and current.state == IN_PROGRESS
            await store.release(key, token)
            claimed = await store.claim(key, b"other", lease=30, ttl=60)
            assert isinstance(claimed, Claimed) and claimed.token != token
            gate.set()
        return await original(key, token, response, ttl=ttl)

    store.complete = complete_after_takeover  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="idem_asgi"):
        first = await post(mw)
        await settled(mw)

    assert first.status == 201 and gate.is_set()
    record = await store.get(record_key())
    assert record is not None and record.state == IN_PROGRESS and record.fingerprint == b"other"
    assert [e.name for e in events][-1] == "lease_lost"
    assert "was no longer held by this request; this answer was not stored" in caplog.text


async def test_gives_up_after_the_window_and_leaves_the_claim(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_late_writes, "WINDOW", 0.3)
    app, store = Charge(), FlakyStore(failures=10**6)
    events: list[Event] = []
    mw = protect(app, store, events)

    with caplog.at_level(logging.ERROR, logger="idem_asgi"):
        first = await post(mw)
        await settled(mw)

    assert first.status == 201 and app.calls == 1
    assert 2 <= store.completes < 10  # backoff, not a busy loop
    record = await store.get(record_key())
    assert record is not None and record.state == IN_PROGRESS  # never released: the effect happened
    assert "gave up storing the answer" in caplog.text
    assert mw.late._pending_bytes == 0


async def test_pending_answers_are_bounded_in_bytes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_late_writes, "MAX_PENDING_BYTES", 10)
    app, store = Charge(), FlakyStore(failures=1)
    events: list[Event] = []
    mw = protect(app, store, events)

    with caplog.at_level(logging.ERROR, logger="idem_asgi"):
        first = await post(mw)

    assert first.status == 201
    assert mw.late.pending == 0 and store.completes == 1  # nothing retried: over the bound
    assert "too many writes waiting for the store" in caplog.text


class Transient:
    """Answers `first` (a status, or "raise" before any answer) to its first call, then 201."""

    def __init__(self, first: int | str) -> None:
        self.first = first
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        self.calls += 1
        status = 201 if self.calls > 1 else self.first
        if status == "raise":
            raise RuntimeError("failed before answering")
        if status == "raise_mid_answer":
            await send({"type": "http.response.start", "status": 201, "headers": []})
            raise RuntimeError("failed mid-answer")
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"run %d" % self.calls})


@pytest.mark.parametrize("first", [503, 429, "raise"])
async def test_a_release_the_store_failed_to_take_is_made_later_and_the_next_retry_runs(first: int | str) -> None:
    """503, 429 or an exception before the answer: "nothing happened, retry". The release failed
    twice; until it lands, retries get 409 in progress; then a retry runs the handler."""
    app, store = Transient(first), FlakyStore(release_failures=2)
    events: list[Event] = []
    mw = protect(app, store, events)

    if first == "raise":
        with pytest.raises(RuntimeError):
            await post(mw)
    else:
        assert (await post(mw)).status == first
    meanwhile = await post(mw)
    assert meanwhile.status == 409 and b"request-in-progress" in meanwhile.body

    await settled(mw)
    retried = await post(mw)

    assert retried.status == 201 and retried.body == b"run 2" and app.calls == 2
    assert store.calls["release"] == 3  # two failures, then the background release
    names = [e.name for e in events]
    assert names.count("store_error") == 1 and names.count("released") == 1  # the late one
    assert "lease_lost" not in names


async def test_a_release_whose_reply_was_lost_is_recognised_as_done() -> None:
    app, store = Transient(503), FlakyStore(release_failures=1, lose_reply=True)
    events: list[Event] = []
    mw = protect(app, store, events)

    assert (await post(mw)).status == 503
    await settled(mw)

    assert (await post(mw)).status == 201 and app.calls == 2
    assert store.calls["release"] == 2  # the second found nothing left: the record read back says released
    names = [e.name for e in events]
    assert names.count("released") == 1 and "lease_lost" not in names


async def test_a_lease_end_the_store_failed_to_take_is_made_later_so_reclaim_never_reruns_it() -> None:
    """The app failed after its answer started: the record must say so (holder failed), or once its
    lease ran out it would look like a crash, and `reclaim` would run the request again."""
    app, store = Transient("raise_mid_answer"), FlakyStore(fail_failures=1)
    events: list[Event] = []
    route = RoutePolicy("/payments", single_tenant=True, lease=0.2, on_expired="reclaim")
    mw = IdempotencyMiddleware(app, backend=store, routes=[route], observer=events.append)

    with pytest.raises(RuntimeError):
        await post(mw)
    await settled(mw)
    record = await store.get(record_key())
    assert record is not None and record.holder_failed and store.calls["mark_failed"] == 2
    await asyncio.sleep(0.3)  # past the lease it would have had
    retry = await post(mw)

    assert retry.status == 409 and b"outcome-unknown" in retry.body
    assert app.calls == 1
    assert [e.name for e in events].count("unresolved") == 1


async def test_pending_releases_are_bounded_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_late_writes, "MAX_PENDING_BYTES", _late_writes.OVERHEAD - 1)
    app, store = Transient(503), FlakyStore(release_failures=1)
    mw = protect(app, store, [])

    with caplog.at_level(logging.ERROR, logger="idem_asgi"):
        assert (await post(mw)).status == 503

    assert mw.late.pending == 0 and store.calls["release"] == 1
    assert "too many writes waiting for the store" in caplog.text
