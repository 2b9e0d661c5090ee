"""The contract's decision table, one test per row, then the pass-through and replay-fidelity rules.

Rows that touch the store run on memory, redis and postgres (the `backend` fixture). Rows whose
answer is decided before any store call use a `Tripwire` store, which proves no call was made.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from idem_asgi import IdempotencyMiddleware, JsonIgnoring, RawBody, RoutePolicy, StoredResponse, current_idempotency
from idem_asgi._types import Message, Receive, Scope, Send
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.context import IdempotencyInfo
from idem_asgi.errors import ConfigurationError
from idem_asgi.http import problems
from idem_asgi.http.keys import scope_from_header
from idem_asgi.records import COMPLETED, IN_PROGRESS, Record, RecordKey
from tests.support.asgi import drive, http_scope, read_body
from tests.support.charges import BODY, KEY, LEASE, Payments, crash_first_request, post, protect, rk
from tests.support.problems import assert_problem
from tests.support.servers import POSTGRES_DSN, REDIS_URL, free_port, require
from tests.support.stores import SHARED, Delegating

# --- helpers ---------------------------------------------------------------------------------


class Tripwire(Delegating):
    """A store that records every call and answers none: proves a request cost no store round trip."""

    def __init__(self) -> None:
        super().__init__(MemoryBackend())  # never reached: every call is refused first
        self.calls: list[str] = []

    def before(self, op: str, key: RecordKey) -> RecordKey:
        self.calls.append(op)
        raise AssertionError(f"{op} must not be called")


@contextlib.asynccontextmanager
async def running(coro: Any) -> AsyncIterator[asyncio.Task[Any]]:
    """Run `coro` as a task for the block; cancel it if the block leaves it unfinished."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- the decision table, row by row ----------------------------------------------------------


async def test_no_key_on_optional_route_passes_through_unprotected() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(scope=scope, receive=receive, send=send, info=current_idempotency())
        await read_body(receive)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ran"})

    tripwire = Tripwire()
    mw = protect(app, tripwire, required=False)
    scope = http_scope()
    first = await drive(mw, scope, [BODY])
    second = await drive(mw, scope, [BODY])

    assert first.status == second.status == 201
    assert second.header("idempotent-replayed") is None
    assert seen["scope"] is scope and seen["info"] is None
    assert "state" not in seen["scope"]
    assert tripwire.calls == []


async def test_no_key_on_required_route_is_400_problem() -> None:
    app = Payments()
    tripwire = Tripwire()
    mw = protect(app, tripwire, required=True)

    response = await post(mw, key=None)

    assert_problem(response, problems.KEY_REQUIRED)
    assert app.calls == 0
    assert tripwire.calls == []


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b'""',
        b"two words",
        b"caf\xe9",
        b"tab\there",
        b"\x7f",
        b"x" * 256,
        b'"unterminated',
        b'"quoted"trailing',
        b'"' + b"x" * 256 + b'"',
    ],
    ids=["empty", "empty-quoted", "space", "non-ascii", "tab", "del", "256-chars", "open-quote", "junk", "long-q"],
)
async def test_malformed_key_is_400(raw: bytes) -> None:
    app = Payments()
    tripwire = Tripwire()
    mw = protect(app, tripwire, required=True)
    scope = http_scope()
    scope["headers"].append((b"idempotency-key", raw))

    result = await drive(mw, scope, [BODY])

    assert_problem(result, problems.KEY_MALFORMED)
    assert app.calls == 0
    assert tripwire.calls == []


async def test_two_key_header_lines_are_400(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = protect(app, backend, namespace)
    scope = http_scope(headers=[("Idempotency-Key", "a-1"), ("Idempotency-Key", "b-2")])

    result = await drive(mw, scope, [BODY])

    assert_problem(result, problems.KEY_MALFORMED)
    assert app.calls == 0
    assert await backend.get(rk(namespace, "a-1")) is None
    assert await backend.get(rk(namespace, "b-2")) is None


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_body_over_limit_is_413_and_nothing_stored(framing: str) -> None:
    app = Payments()
    tripwire = Tripwire()
    mw = protect(app, tripwire, max_body=1000)
    if framing == "content-length":
        # Refused from the declared length, before a byte of the body is read.
        result = await drive(mw, http_scope(key=KEY, headers=[("content-length", "1001")]), [b"x" * 1001])
    else:
        # No Content-Length: refused as soon as the chunks add up past the limit.
        result = await drive(mw, http_scope(key=KEY), [b"x" * 400, b"x" * 400, b"x" * 400, b"x" * 400])

    assert_problem(result, problems.BODY_TOO_LARGE)
    assert app.calls == 0
    assert tripwire.calls == []


async def test_new_key_runs_app_once_and_stores(backend: Backend, namespace: str) -> None:
    during: list[Record | None] = []
    inner = Payments()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        during.append(await backend.get(rk(namespace)))
        await inner(scope, receive, send)

    mw = protect(app, backend, namespace)
    result = await drive(mw, http_scope(key=KEY), [BODY[:10], BODY[10:]])

    assert inner.calls == 1 and inner.bodies == [BODY]
    assert result.status == 201 and json.loads(result.body)["charge"] == 1
    assert result.header("idempotent-replayed") is None
    claimed = during[0]
    assert claimed is not None and claimed.state == IN_PROGRESS and claimed.response is None
    stored = await backend.get(rk(namespace))
    assert stored is not None and stored.state == COMPLETED and stored.token == claimed.token
    assert stored.response == StoredResponse(201, result.headers, result.body)


async def test_same_key_same_body_completed_replays_verbatim_with_marker(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = protect(app, backend, namespace)
    first = await drive(mw, http_scope(key=KEY), [BODY])
    record_before = await backend.get(rk(namespace))

    replay = await drive(mw, http_scope(key=KEY), [BODY[:5], BODY[5:]])

    assert app.calls == 1
    assert replay.status == first.status == 201
    assert replay.headers == [*first.headers, (b"idempotent-replayed", b"true")]
    assert replay.body == first.body
    assert first.header("idempotent-replayed") is None
    assert await backend.get(rk(namespace)) == record_before


async def test_same_key_in_progress_is_409_with_retry_after(backend: Backend, namespace: str) -> None:
    gate = asyncio.Event()
    app = Payments(gate=gate)
    mw = protect(app, backend, namespace, retry_after=3)
    async with running(post(mw)) as first:
        await asyncio.wait_for(app.entered.wait(), 5)
        record_before = await backend.get(rk(namespace))

        repeat = await post(mw)

        assert_problem(repeat, problems.IN_PROGRESS)
        assert repeat.headers["retry-after"] == "3"
        assert app.calls == 1
        assert await backend.get(rk(namespace)) == record_before
        gate.set()
        assert (await first).status_code == 201
    assert app.calls == 1


async def test_wait_then_replay_option(backend: Backend, namespace: str) -> None:
    gate = asyncio.Event()
    app = Payments(gate=gate)
    mw = protect(app, backend, namespace, wait=3)
    async with running(post(mw)) as first:
        await asyncio.wait_for(app.entered.wait(), 5)  # the first owns the key before the repeat is sent
        async with running(post(mw)) as repeat:
            await asyncio.sleep(0.1)
            assert not repeat.done(), "the repeat must be held, not answered 409"
            gate.set()
            original, replayed = await first, await repeat

    assert app.calls == 1
    assert original.status_code == replayed.status_code == 201
    assert replayed.content == original.content
    assert replayed.headers["idempotent-replayed"] == "true"


async def test_wait_that_runs_out_is_409(backend: Backend, namespace: str) -> None:
    gate = asyncio.Event()
    app = Payments(gate=gate)
    mw = protect(app, backend, namespace, wait=0.3)
    async with running(post(mw)) as first:
        await asyncio.wait_for(app.entered.wait(), 5)
        started = time.monotonic()
        repeat = await post(mw)
        waited = time.monotonic() - started
        gate.set()
        await first

    assert_problem(repeat, problems.IN_PROGRESS)
    assert 0.25 <= waited < 2
    assert app.calls == 1


async def test_same_key_different_body_is_422_in_progress_and_completed(backend: Backend, namespace: str) -> None:
    gate = asyncio.Event()
    app = Payments(gate=gate)
    mw = protect(app, backend, namespace)
    other = b'{"amount":9999,"currency":"EUR"}'
    async with running(post(mw)) as first:
        await asyncio.wait_for(app.entered.wait(), 5)
        in_progress = await post(mw, body=other)
        assert_problem(in_progress, problems.FINGERPRINT_MISMATCH)
        gate.set()
        await first
    record = await backend.get(rk(namespace))

    completed = await post(mw, body=other)

    assert_problem(completed, problems.FINGERPRINT_MISMATCH)
    assert app.calls == 1 and app.bodies == [BODY]
    assert await backend.get(rk(namespace)) == record
    assert (await post(mw)).headers["idempotent-replayed"] == "true"


async def test_app_raising_releases_the_claim(backend: Backend, namespace: str) -> None:
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        await read_body(receive)
        calls += 1
        if calls == 1:
            raise RuntimeError("card processor exploded")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"charged"})

    mw = protect(app, backend, namespace)
    with pytest.raises(RuntimeError, match="exploded"):
        await drive(mw, http_scope(key=KEY), [BODY])  # the middleware lets the server see the error
    assert await backend.get(rk(namespace)) is None

    retry = await post(mw)

    assert calls == 2
    assert retry.status_code == 201 and retry.content == b"charged"
    assert "idempotent-replayed" not in retry.headers


async def test_app_raising_gives_the_client_a_500(backend: Backend, namespace: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise RuntimeError("boom")

    mw = protect(app, backend, namespace)
    response = await post(mw, raise_app_exceptions=False)
    assert response.status_code == 500
    assert await backend.get(rk(namespace)) is None


async def test_5xx_releases_the_claim(backend: Backend, namespace: str) -> None:
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        await read_body(receive)
        calls += 1
        status, body = (503, b"processor down") if calls == 1 else (201, b"charged")
        await send({"type": "http.response.start", "status": status, "headers": [(b"x-app", b"1")]})
        await send({"type": "http.response.body", "body": body})

    mw = protect(app, backend, namespace)
    failed = await post(mw)
    assert failed.status_code == 503 and failed.content == b"processor down"  # the app's own answer
    assert failed.headers["x-app"] == "1"
    assert await backend.get(rk(namespace)) is None

    retry = await post(mw)

    assert calls == 2
    assert retry.status_code == 201 and retry.content == b"charged"


async def test_5xx_release_is_configurable(backend: Backend, namespace: str) -> None:
    app_calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal app_calls
        app_calls += 1
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"declined for good"})

    mw = protect(app, backend, namespace, release_statuses=())
    first = await post(mw)
    repeat = await post(mw)

    assert app_calls == 1
    assert repeat.status_code == first.status_code == 500
    assert repeat.content == b"declined for good" and repeat.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("how", ["send-raises", "disconnect-message"])
async def test_client_disconnect_still_completes_record(backend: Backend, namespace: str, how: str) -> None:
    finished: list[bool] = []

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"one,", b"two,", b"three"):
            yield part
            await asyncio.sleep(0.01)
        finished.append(True)

    async def handler(request: Request) -> StreamingResponse:
        await request.body()
        return StreamingResponse(chunks(), status_code=201, media_type="text/plain")

    mw = protect(Starlette(routes=[Route("/payments", handler, methods=["POST"])]), backend, namespace)
    scope = http_scope(key=KEY)
    if how == "send-raises":
        # uvicorn (ASGI spec 2.4): sending to a gone client raises OSError.
        scope["asgi"]["spec_version"] = "2.4"
        first = await drive(mw, scope, [BODY], send_raises_after=2)
        assert first.chunks == [b"one,"]  # the client did leave early
    else:
        # Older servers: `receive()` answers http.disconnect, which Starlette's streaming listens for.
        await drive(mw, scope, [BODY], disconnect_after_first_chunk=True)

    assert finished == [True], "the app must still finish"
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == COMPLETED
    assert record.response is not None and record.response.body == b"one,two,three"
    retry = await post(mw)
    assert retry.status_code == 201 and retry.content == b"one,two,three"
    assert retry.headers["idempotent-replayed"] == "true"
    assert finished == [True]


async def test_expired_lease_blocks_with_outcome_unknown(backend: Backend, namespace: str) -> None:
    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=LEASE)
    await crash_first_request(mw, app)
    record = await backend.get(rk(namespace))

    for _ in range(2):
        response = await post(mw)
        assert_problem(response, problems.OUTCOME_UNKNOWN)

    assert app.calls == 1
    assert await backend.get(rk(namespace)) == record


async def test_expired_lease_block_is_resolved_by_the_ttl(backend: Backend, namespace: str) -> None:
    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=LEASE, ttl=1.6)
    await crash_first_request(mw, app)  # (lease, then its 1 s grace: 1.3 s)
    assert_problem(await post(mw), problems.OUTCOME_UNKNOWN)
    await asyncio.sleep(0.4)  # past the 1.6 s TTL of the dead holder's record

    response = await post(mw)

    assert response.status_code == 201 and app.calls == 2


async def test_expired_lease_reclaim_reruns(backend: Backend, namespace: str) -> None:
    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=LEASE, on_expired="reclaim")
    await crash_first_request(mw, app)
    dead = await backend.get(rk(namespace))
    assert dead is not None

    rerun = await post(mw)

    assert app.calls == 2
    assert rerun.status_code == 201 and json.loads(rerun.content)["charge"] == 2
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == COMPLETED and record.token != dead.token
    # The old holder's late writes are rejected by its stale token.
    late = StoredResponse(201, [], b"late answer from the dead holder")
    assert await backend.complete(rk(namespace), dead.token, late, ttl=60) is False
    assert await backend.release(rk(namespace), dead.token) is False
    assert (await post(mw)).content == rerun.content


async def test_recover_hook_run(backend: Backend, namespace: str) -> None:
    asked: list[tuple[RecordKey, Record]] = []

    async def recover(key: RecordKey, record: Record) -> Literal["run"]:
        asked.append((key, record))
        return "run"  # the provider has no charge under this key: safe to run

    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=LEASE, recover=recover)
    await crash_first_request(mw, app)
    dead = await backend.get(rk(namespace))

    rerun = await post(mw)

    assert [(k.key, r) for k, r in asked] == [(KEY, dead)]
    assert app.calls == 2 and rerun.status_code == 201
    assert (await post(mw)).headers["idempotent-replayed"] == "true"
    assert app.calls == 2


async def test_recover_hook_returns_response(backend: Backend, namespace: str) -> None:
    found = StoredResponse(201, [(b"content-type", b"application/json")], b'{"charge":"ch_from_provider"}')

    async def recover(key: RecordKey, record: Record) -> StoredResponse:
        return found  # the provider did charge: this is the answer

    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=LEASE, recover=recover)
    await crash_first_request(mw, app)

    recovered = await post(mw)
    again = await post(mw)

    assert app.calls == 1
    for response in (recovered, again):
        assert response.status_code == 201 and response.content == found.body
        assert response.headers["idempotent-replayed"] == "true"
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == COMPLETED and record.response == found


@pytest.mark.parametrize("hook", ["returns-none", "raises"])
async def test_recover_hook_returns_none(backend: Backend, namespace: str, hook: str) -> None:
    async def recover(key: RecordKey, record: Record) -> None:
        if hook == "raises":
            raise ConnectionError("provider unreachable")
        return None  # nobody knows yet

    app = Payments(hang_first=True)
    mw = protect(app, backend, namespace, lease=LEASE, recover=recover, on_expired="reclaim")
    await crash_first_request(mw, app)

    response = await post(mw)

    assert_problem(response, problems.OUTCOME_UNKNOWN)
    assert app.calls == 1


async def test_lease_is_renewed_while_app_runs(backend: Backend, namespace: str) -> None:
    app = Payments(delay=1.0)
    # `reclaim` would re-run an expired lease, so a missed renewal shows up as a second execution.
    mw = protect(app, backend, namespace, lease=0.3, on_expired="reclaim")
    async with running(post(mw)) as first:
        await asyncio.wait_for(app.entered.wait(), 5)
        for _ in range(3):
            await asyncio.sleep(0.25)  # at 0.25, 0.5 and 0.75 s: past the unrenewed 0.3 s lease
            repeat = await post(mw)
            assert_problem(repeat, problems.IN_PROGRESS)
        original = await first

    assert app.calls == 1
    assert original.status_code == 201
    assert (await post(mw)).content == original.content


@pytest.fixture(params=SHARED)
async def dead_store(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """A real driver pointed at a port where nothing listens."""
    backend: Backend
    if request.param == "redis":
        require("redis", REDIS_URL)
        from idem_asgi.backends.redis import RedisBackend

        backend = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.2)
    else:
        require("postgres", POSTGRES_DSN)
        from idem_asgi.backends.postgres import PostgresBackend

        backend = PostgresBackend.from_dsn(f"postgresql://postgres@127.0.0.1:{free_port()}/test", timeout=0.5)
    try:
        yield backend
    finally:
        await backend.aclose()


async def test_store_unreachable_is_503_fail_closed(dead_store: Backend, caplog: pytest.LogCaptureFixture) -> None:
    app = Payments()
    mw = protect(app, dead_store, retry_after=2)
    started = time.monotonic()
    with caplog.at_level(logging.CRITICAL, logger="idem_asgi"):
        response = await post(mw)

    assert_problem(response, problems.STORE_UNAVAILABLE)
    assert response.headers["retry-after"] == "2"
    assert app.calls == 0
    assert time.monotonic() - started < 5


async def test_fail_open_runs_app(dead_store: Backend, caplog: pytest.LogCaptureFixture) -> None:
    app = Payments()
    mw = protect(app, dead_store, on_store_error="fail_open")
    with caplog.at_level(logging.CRITICAL, logger="idem_asgi"):
        response = await post(mw)

    assert app.calls == 1 and app.bodies == [BODY]
    assert response.status_code == 201
    assert "idempotent-replayed" not in response.headers


async def test_expired_record_is_treated_as_new(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = protect(app, backend, namespace, lease=0.2, ttl=0.4)
    first = await post(mw)
    assert (await post(mw)).headers["idempotent-replayed"] == "true"
    await asyncio.sleep(0.6)

    again = await post(mw, body=b'{"amount":1,"currency":"EUR"}')  # a new body is fine: the old record is gone

    assert app.calls == 2
    assert first.status_code == again.status_code == 201
    assert json.loads(again.content)["charge"] == 2
    assert "idempotent-replayed" not in again.headers


# --- pass-through ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["websocket"])
async def test_non_http_scopes_pass_through_untouched(kind: str) -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(scope=scope, receive=receive, send=send)

    async def receive() -> Message:
        return {"type": f"{kind}.disconnect"}

    async def send(message: Message) -> None:
        raise AssertionError("nothing is sent")

    tripwire = Tripwire()
    mw = protect(app, tripwire, required=True)
    scope: dict[str, Any] = {"type": kind, "asgi": {"version": "3.0"}}
    if kind == "websocket":
        scope.update(path="/payments", headers=[(b"idempotency-key", b"k")], query_string=b"")

    await mw(scope, receive, send)

    assert seen == {"scope": scope, "receive": receive, "send": send}
    assert seen["scope"] is scope and seen["receive"] is receive and seen["send"] is send
    assert tripwire.calls == []


@pytest.mark.parametrize(("method", "path"), [("GET", "/payments"), ("PUT", "/payments"), ("POST", "/refunds")])
async def test_unprotected_routes_and_methods_pass_through_untouched(method: str, path: str) -> None:
    seen: dict[str, Any] = {}
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.update(scope=scope, receive=receive, send=send)
        while True:
            message = await receive()
            received.append(message)
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"set-cookie", b"s=1")]})
        await send({"type": "http.response.body", "body": b"free"})

    tripwire = Tripwire()
    mw = protect(app, tripwire, required=True)
    scope = http_scope(method, path, key=KEY)
    chunks: list[bytes] = []

    async def receive() -> Message:
        chunk = [b"a", b"b"][len(chunks)]
        chunks.append(chunk)
        return {"type": "http.request", "body": chunk, "more_body": len(chunks) < 2}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await mw(scope, receive, send)

    assert seen["scope"] is scope and seen["receive"] is receive and seen["send"] is send
    assert [m["body"] for m in received] == [b"a", b"b"]  # unbuffered: the app read the chunks itself
    assert sent[0]["headers"] == [(b"set-cookie", b"s=1")]
    assert tripwire.calls == []


# --- refusals, key and scope, replay fidelity ------------------------------------------------


def test_problem_types_are_stable() -> None:
    assert {p.slug: (p.status, p.type) for p in problems.ALL} == {
        "key-required": (400, "urn:idem-asgi:problem:key-required"),
        "key-malformed": (400, "urn:idem-asgi:problem:key-malformed"),
        "scope-malformed": (400, "urn:idem-asgi:problem:scope-malformed"),
        "body-too-large": (413, "urn:idem-asgi:problem:body-too-large"),
        "request-in-progress": (
            409,
            "urn:idem-asgi:problem:request-in-progress",
        ),
        "fingerprint-mismatch": (
            422,
            "urn:idem-asgi:problem:fingerprint-mismatch",
        ),
        "outcome-unknown": (409, "urn:idem-asgi:problem:outcome-unknown"),
        "response-not-stored": (
            409,
            "urn:idem-asgi:problem:response-not-stored",
        ),
        "response-expired": (409, "urn:idem-asgi:problem:response-expired"),
        "store-unavailable": (
            503,
            "urn:idem-asgi:problem:store-unavailable",
        ),
        "scope-required": (400, "urn:idem-asgi:problem:scope-required"),
        "key-quota-exceeded": (
            429,
            "urn:idem-asgi:problem:key-quota-exceeded",
        ),
        "store-misconfigured": (
            500,
            "urn:idem-asgi:problem:store-misconfigured",
        ),
    }


def test_every_problem_type_has_its_section_in_docs_problems_md() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "problems.md").read_text()
    sections = set(re.findall(r"^## ([a-z-]+)$", page, flags=re.MULTILINE))
    slugs = {p.slug for p in problems.DOCUMENTED}
    assert slugs <= sections, slugs - sections  # GitHub makes each heading the anchor #<slug>
    for slug in slugs:
        assert problems.slug_of(problems.DEFAULT_PROBLEM_BASE + slug) == slug
        assert problems.slug_of("urn:idem-asgi:problem:" + slug) == slug  # 0.1.0's values, the default again
        assert problems.slug_of("https://api.example.com/problems#" + slug) == slug
        assert problems.slug_of("/problems/" + slug) == slug


async def test_refusals_link_their_type_and_the_base_is_configurable(backend: Backend, namespace: str) -> None:
    default = protect(Payments(), backend, namespace, required=True)
    r = await post(default, key=None)
    doc = assert_problem(r, problems.KEY_REQUIRED)
    assert "link" not in r.headers  # the default identifier locates no page
    assert doc["type"] == "urn:idem-asgi:problem:key-required"

    custom = IdempotencyMiddleware(
        Payments(),
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", required=True, single_tenant=True)],
        problem_base="https://api.example.com/problems/",
    )
    r = await post(custom, key=None)
    assert r.status_code == 400
    assert r.json()["type"] == "https://api.example.com/problems/key-required"
    assert r.headers["link"] == '<https://api.example.com/problems/key-required>; rel="describedby"'
    for bad in ("urn:x:", "problems#", "https://api.example.com/problems"):
        with pytest.raises(ConfigurationError, match="problem_base"):
            IdempotencyMiddleware(Payments(), backend=backend, routes=[], problem_base=bad)


async def test_key_and_scope_reach_the_app(backend: Backend, namespace: str) -> None:
    seen: list[tuple[Any, Any]] = []

    async def handler(request: Request) -> JSONResponse:
        await request.body()
        assert request.scope["state"]["idempotency"] is request.state.idempotency
        seen.append((request.scope["state"]["idempotency"], current_idempotency()))
        return JSONResponse({"ok": True}, status_code=201)

    app = Starlette(routes=[Route("/payments", handler, methods=["POST"])])
    mw = protect(app, backend, namespace, scope=scope_from_header("x-tenant"))

    await post(mw, key='"quoted-key"', headers={"x-tenant": "acme"})

    expected = IdempotencyInfo(key="quoted-key", scope="acme")
    assert seen == [(expected, expected)]
    assert current_idempotency() is None  # reset once the request is over
    assert await backend.get(rk(namespace, "quoted-key", "acme")) is not None


async def test_quoted_and_bare_key_are_the_same_key(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = protect(app, backend, namespace)
    await post(mw, key="abc-123")
    replay = await post(mw, key='"abc-123"')
    assert app.calls == 1 and replay.headers["idempotent-replayed"] == "true"


async def test_denylisted_headers_are_not_replayed_but_reach_the_first_client(backend: Backend, namespace: str) -> None:
    headers = [
        (b"content-type", b"text/plain"),
        (b"Set-Cookie", b"session=secret; HttpOnly"),
        (b"x-keep", b"1"),
        (b"www-authenticate", b"Bearer"),
        (b"proxy-authenticate", b"Basic"),
        (b"set-cookie", b"csrf=also-secret"),
        (b"x-keep", b"2"),
    ]

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = protect(app, backend, namespace)
    first = await drive(mw, http_scope(key=KEY), [BODY])
    replay = await drive(mw, http_scope(key=KEY), [BODY])

    assert first.headers == headers
    assert replay.headers == [
        (b"content-type", b"text/plain"),
        (b"x-keep", b"1"),
        (b"x-keep", b"2"),
        (b"idempotent-replayed", b"true"),
    ]
    record = await backend.get(rk(namespace))
    assert record is not None and record.response is not None
    assert b"secret" not in b"".join(v for _, v in record.response.headers)


async def test_excluded_headers_are_configurable(backend: Backend, namespace: str) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"x-internal", b"node-7"), (b"x-public", b"yes")]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = protect(app, backend, namespace, excluded_headers=["X-Internal"])
    first = await post(mw)
    replay = await post(mw)

    assert first.headers["x-internal"] == "node-7"
    assert "x-internal" not in replay.headers and replay.headers["x-public"] == "yes"


async def test_pathsend_and_zerocopysend_are_hidden_from_the_app_on_protected_routes() -> None:
    seen: list[dict[str, Any]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(dict(scope["extensions"]))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    extensions: dict[str, Any] = {
        "http.response.pathsend": {},
        "http.response.zerocopysend": {},
        "http.response.trailers": {},
    }
    mw = IdempotencyMiddleware(app, routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True)])

    await drive(mw, http_scope(key=KEY, extensions=extensions), [BODY])  # protected
    await drive(mw, http_scope(path="/files", key=KEY, extensions=extensions), [BODY])  # unprotected

    assert seen[0] == {"http.response.trailers": {}}
    assert seen[1] == extensions
    assert set(extensions) == {"http.response.pathsend", "http.response.zerocopysend", "http.response.trailers"}


def test_secure_by_default_a_route_without_scope_or_single_tenant_refuses_to_start() -> None:
    app = Payments()
    with pytest.raises(ConfigurationError, match="scope_from_user") as raised:
        IdempotencyMiddleware(app, routes=[RoutePolicy("/payments")])  # strict is the default
    assert "single_tenant=True" in str(raised.value) and "/payments" in str(raised.value)
    with pytest.raises(ConfigurationError, match="scope"):
        IdempotencyMiddleware(app, routes=[RoutePolicy("/payments")], strict=True)
    # Either a scope callable or a single-tenant declaration satisfies strict mode.
    IdempotencyMiddleware(app, routes=[RoutePolicy("/payments")], strict=True, scope=scope_from_header("x-tenant"))
    IdempotencyMiddleware(app, routes=[RoutePolicy("/payments", single_tenant=True)], strict=True)


def test_strict_false_only_warns_once_per_process_about_a_missing_scope(caplog: pytest.LogCaptureFixture) -> None:
    path = f"/payments-{uuid.uuid4().hex}"
    routes = [RoutePolicy(path), RoutePolicy("/t", single_tenant=True)]
    with caplog.at_level(logging.WARNING, logger="idem_asgi"):
        for _ in range(5):  # a framework building one middleware per handler
            IdempotencyMiddleware(Payments(), routes=routes, strict=False)
    warnings = [r for r in caplog.records if r.name == "idem_asgi" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and path in warnings[0].getMessage()


def test_single_tenant_and_a_scope_callable_contradict() -> None:
    with pytest.raises(ConfigurationError, match="contradict"):
        IdempotencyMiddleware(
            Payments(), routes=[RoutePolicy("/payments", single_tenant=True, scope=scope_from_header("x-tenant"))]
        )


async def test_scopes_isolate_keys(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = protect(app, backend, namespace, scope=scope_from_header("x-tenant"))
    acme_body, globex_body = b'{"amount":1,"tenant":"acme"}', b'{"amount":2,"tenant":"globex"}'

    acme = await post(mw, body=acme_body, headers={"x-tenant": "acme"})
    globex = await post(mw, body=globex_body, headers={"x-tenant": "globex"})  # same key, other tenant
    acme_again = await post(mw, body=acme_body, headers={"x-tenant": "acme"})
    globex_again = await post(mw, body=globex_body, headers={"x-tenant": "globex"})

    assert app.calls == 2
    assert acme.status_code == globex.status_code == 201
    assert b"globex" not in acme.content + acme_again.content
    assert b"acme" not in globex.content + globex_again.content
    assert acme_again.content == acme.content and globex_again.content == globex.content
    assert acme_again.headers["idempotent-replayed"] == globex_again.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize("tenant", ["acme\x00evil", "acme\udc80"])
async def test_unstorable_scope_is_400_and_nothing_stored(backend: Backend, namespace: str, tenant: str) -> None:
    # NUL (from a header) is refused by Postgres text; a lone surrogate (from a scope callable) is
    # not UTF-8. Every store answers the same 400 instead of Postgres alone answering 503.
    app = Payments()
    mw = protect(app, backend, namespace, scope=lambda scope: tenant)

    result = await drive(mw, http_scope(key=KEY), [BODY])

    assert_problem(result, problems.SCOPE_MALFORMED)
    assert app.calls == 0
    assert await backend.get(RecordKey.build(namespace, "acme", KEY)) is None


async def test_body_at_the_limit_is_accepted(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = protect(app, backend, namespace, max_body=1000)
    response = await drive(mw, http_scope(key=KEY, headers=[("content-length", "1000")]), [b"x" * 500, b"x" * 500])
    assert response.status == 201 and app.bodies == [b"x" * 1000]


@pytest.mark.parametrize(
    ("headers", "chunks", "json_rule"),
    [
        ([("Idempotency-Key", KEY)], [b"[" * 100_000], True),
        ([("Idempotency-Key", KEY)], [b'{"a":' * 50_000], True),
        ([("Idempotency-Key", KEY), ("content-length", "abc")], [BODY], False),
        ([("Idempotency-Key", KEY), ("content-length", "9" * 40)], [BODY], False),
        ([("Idempotency-Key", "".join(map(chr, range(256))))], [BODY], False),
        ([("Idempotency-Key", "\x00")], [BODY], False),
    ],
    ids=["deep-json-array", "deep-json-object", "junk-length", "huge-length", "all-bytes-key", "nul-key"],
)
async def test_hostile_input_never_gets_a_500_from_the_middleware(
    headers: list[tuple[str, str]], chunks: list[bytes], json_rule: bool
) -> None:
    app = Payments()
    mw = protect(app, MemoryBackend(), fingerprint=JsonIgnoring("ts") if json_rule else RawBody())
    result = await drive(mw, http_scope(headers=headers), chunks)
    assert result.status in (201, 400, 413)
    assert (result.status == 201) == (app.calls == 1)
