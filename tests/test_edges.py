"""Where real deployments differ from the test bench: mounts, shared routes, failures after the answer
started, scoping, long handlers, trailers, compression and stores that can never work.

One section per defect class; tests touching a store run on memory, Redis and Postgres (`backend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from idem_asgi import (
    IdempotencyMiddleware,
    RoutePolicy,
    SignatureMiddleware,
    StripeScheme,
    add_openapi,
    current_idempotency,
    event_id,
    scope_from_header,
    scope_from_user,
)
from idem_asgi._types import Message, Receive, Scope, Send
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.errors import BackendUnavailable, InvalidScope
from idem_asgi.http import problems
from idem_asgi.http.keys import MAX_SCOPE_LENGTH, stored_scope
from idem_asgi.records import COMPLETED, IN_PROGRESS, ClaimResult, RecordKey
from tests.support.asgi import Result, drive, http_scope, read_body
from tests.support.problems import assert_problem
from tests.support.servers import ROOT, free_port, serving

BODY = b'{"amount":1230,"currency":"EUR"}'


def client(app: Any, **headers: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", headers=headers)


def charges_app(counts: Counter[str]) -> FastAPI:
    """A FastAPI app whose POST /payments counts its charges and answers with the charge number."""
    app = FastAPI()

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict[str, Any]:
        counts["charges"] += 1
        info = request.state.idempotency
        return {
            "charge": counts["charges"],
            "key": info.key,
            "scope": info.scope,
            "body": (await request.body()).decode(),
        }

    return app


# --- 1. mounted apps and root_path ---------------------------------------------------------------


async def test_mounted_sub_app_matches_policies_relative_to_its_mount(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    sub = charges_app(counts)
    sub.add_middleware(
        IdempotencyMiddleware,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True)],
    )
    outer = Starlette(routes=[Mount("/v1", app=sub)])
    async with client(outer) as c:
        missing = await c.post("/v1/payments", content=BODY)
        first = await c.post("/v1/payments", content=BODY, headers={"Idempotency-Key": "mnt-1"})
        again = await c.post("/v1/payments", content=BODY, headers={"Idempotency-Key": "mnt-1"})
    assert_problem(missing, problems.KEY_REQUIRED)  # protected under the mount: no key is refused
    assert first.status_code == 201 and again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert counts["charges"] == 1


async def test_uvicorn_root_path_matches_policies_relative_to_it(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    app = charges_app(counts)
    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True)],
    )
    async with serving(app, root_path="/api") as url, httpx.AsyncClient(base_url=url) as c:
        # uvicorn hands the app path "/api/payments" with root_path "/api" (a proxy stripped /api)
        missing = await c.post("/payments", content=BODY)
        answers = await asyncio.gather(
            *[c.post("/payments", content=BODY, headers={"Idempotency-Key": "rp-1"}) for _ in range(20)]
        )
    assert_problem(missing, problems.KEY_REQUIRED)
    assert counts["charges"] == 1
    firsts = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(firsts) == 1
    assert all(a.status_code == 409 or a.content == firsts[0].content for a in answers)


def test_add_openapi_documents_a_mounted_sub_apps_operations() -> None:
    sub = charges_app(Counter())
    routes = [RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True)]
    sub.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=routes)
    outer = FastAPI()
    outer.mount("/v1", sub)
    add_openapi(sub)
    schema = sub.openapi()
    names = [p["name"] for p in schema["paths"]["/payments"]["post"]["parameters"]]
    assert names == ["Idempotency-Key"]


async def test_signature_middleware_under_a_mount_verifies_paths_relative_to_it() -> None:
    secret = "whsec_mount"
    seen: list[bytes] = []

    async def hook(request: Request) -> Response:
        seen.append(await request.body())
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/webhooks/stripe", hook, methods=["POST"])])
    guarded = SignatureMiddleware(inner, paths=["/webhooks/stripe"], scheme=StripeScheme(), secrets=[secret])
    outer = Starlette(routes=[Mount("/v1", app=guarded)])
    body = b'{"id":"evt_m1"}'
    t = int(time.time())
    good = f"t={t},v1=" + hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    async with client(outer) as c:
        forged = await c.post("/v1/webhooks/stripe", content=body, headers={"Stripe-Signature": f"t={t},v1={'0' * 64}"})
        genuine = await c.post("/v1/webhooks/stripe", content=body, headers={"Stripe-Signature": good})
    assert forged.status_code == 401 and genuine.status_code == 200
    assert seen == [body]


# --- 2. derived keys belong to their route -------------------------------------------------------


def webhook_app(counts: Counter[str]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        counts[scope["path"]] += 1
        body = json.dumps({"path": scope["path"], "run": counts[scope["path"]]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


async def test_derived_keys_belong_to_their_route(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    hook: dict[str, Any] = {"methods": ["POST"], "key": event_id(field="id"), "required": True, "single_tenant": True}
    mw = IdempotencyMiddleware(
        webhook_app(counts),
        backend=backend,
        namespace=namespace,
        routes=[
            RoutePolicy("/webhooks/stripe/billing", **hook),
            RoutePolicy("/webhooks/stripe/fulfilment", **hook),
            RoutePolicy("/webhooks/{provider}", **hook),
            RoutePolicy("/payments", methods=["POST"], single_tenant=True),
            RoutePolicy("/refunds", methods=["POST"], single_tenant=True),
        ],
    )
    event = json.dumps({"id": "evt_42"}).encode()
    async with client(mw) as c:
        # A header-key request whose key equals the event id comes first: it must neither block
        # the event (422) nor be what a later delivery of the event is answered with.
        pay = await c.post("/payments", content=b'{"amount":1}', headers={"Idempotency-Key": "evt_42"})
        for _ in range(2):
            for path in ("/webhooks/stripe/billing", "/webhooks/stripe/fulfilment", "/webhooks/acme", "/webhooks/zeta"):
                r = await c.post(path, content=event)
                assert r.status_code == 200 and r.json()["path"] == path, (path, r.content)
        # Header keys keep the IETF rule: one key space per scope, so a reuse on another route is 422.
        reuse = await c.post("/refunds", content=b'{"amount":1}', headers={"Idempotency-Key": "evt_42"})
    assert pay.status_code == 200 and counts["/payments"] == 1
    assert counts["/webhooks/stripe/billing"] == counts["/webhooks/stripe/fulfilment"] == 1  # once on each
    assert counts["/webhooks/acme"] == counts["/webhooks/zeta"] == 1  # one pattern policy, two routes
    assert_problem(reuse, problems.FINGERPRINT_MISMATCH)
    assert counts["/refunds"] == 0


async def test_an_intent_key_never_meets_a_header_key_of_the_same_text(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        webhook_app(counts),
        backend=backend,
        namespace=namespace,
        routes=[
            RoutePolicy("/bookings", methods=["POST"], key=lambda s, b, h: "same-text", single_tenant=True),
            RoutePolicy("/payments", methods=["POST"], single_tenant=True),
        ],
    )
    async with client(mw) as c:
        booking = await c.post("/bookings", content=b"{}")
        payment = await c.post("/payments", content=b'{"x":1}', headers={"Idempotency-Key": "same-text"})
    assert booking.status_code == payment.status_code == 200
    assert counts["/bookings"] == counts["/payments"] == 1


# --- 3. no re-execution after the answer started -------------------------------------------------


def started_then(fail: str, counts: Counter[str]) -> Any:
    """A raw app that sends a 200 start and one chunk, then raises, hangs (to be cancelled) or returns."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        counts["runs"] += 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"charged; receipt follows ", "more_body": True})
        if fail == "raise":
            raise RuntimeError("the receipt renderer crashed")
        if fail == "cancel":
            await asyncio.Event().wait()
        # "cut": returns without the final chunk

    return app


@pytest.mark.parametrize("fail", ["raise", "cancel", "cut"])
async def test_no_reexecution_after_the_answer_started(backend: Backend, namespace: str, fail: str) -> None:
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        started_then(fail, counts),
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True, on_expired="reclaim")],
    )
    scope = http_scope(key="started-1")
    if fail == "cancel":
        result = Result()
        task = asyncio.create_task(drive(mw, scope, [BODY], result=result))
        for _ in range(500):  # until the first chunk is out
            if len(result.messages) >= 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    elif fail == "raise":
        with pytest.raises(RuntimeError):
            await drive(mw, scope, [BODY])
    else:
        await drive(mw, scope, [BODY])
    record = await backend.get(RecordKey.build(namespace, None, "started-1"))
    assert record is not None and record.state == IN_PROGRESS and record.holder_failed
    # Even on a `reclaim` route, the retry is told the outcome is unknown; the handler never runs again.
    for _ in range(3):
        retry = await drive(mw, http_scope(key="started-1"), [BODY])
        assert_problem(retry, problems.OUTCOME_UNKNOWN)
    assert counts["runs"] == 1


async def test_a_streaming_response_that_fails_mid_body_in_fastapi_is_never_run_again(
    backend: Backend, namespace: str
) -> None:
    counts: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/payments")
    async def pay() -> StreamingResponse:
        counts["charges"] += 1

        async def receipt() -> AsyncIterator[bytes]:
            yield b"charged "
            raise RuntimeError("receipt failed")

        return StreamingResponse(receipt(), media_type="text/plain")

    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True)],
    )
    async with client(app) as c:
        with contextlib.suppress(httpx.HTTPError):
            await c.post("/payments", content=BODY, headers={"Idempotency-Key": "fa-1"})
        retry = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "fa-1"})
    assert_problem(retry, problems.OUTCOME_UNKNOWN)
    assert counts["charges"] == 1


async def test_a_released_status_that_started_and_then_failed_is_still_released(
    backend: Backend, namespace: str
) -> None:
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await read_body(receive)
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"busy", "more_body": True})
        raise RuntimeError("gave up")

    mw = IdempotencyMiddleware(
        app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
    )
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await drive(mw, http_scope(key="rel-1"), [BODY])
    assert runs == 2  # a 503 is "try again": nothing was done, so the retry runs


# --- 4. the effect marker ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["request.state", "current_idempotency"])
@pytest.mark.parametrize("failure", ["raise", "500"])
async def test_effect_marker_keeps_a_failed_claim_as_outcome_unknown(
    backend: Backend, namespace: str, how: str, failure: str
) -> None:
    counts: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/payments")
    async def pay(request: Request) -> Response:
        counts["provider_calls"] += 1  # the provider was called: money moved
        info = request.state.idempotency if how == "request.state" else current_idempotency()
        assert info is not None
        info.mark_effect()
        if failure == "raise":
            raise RuntimeError("could not write the order row")
        return JSONResponse({"error": "ledger down"}, status_code=500)

    @app.post("/quotes")
    async def quote() -> Response:
        counts["quotes"] += 1  # nothing irreversible yet: no marker
        raise RuntimeError("pricing service down")

    routes = [RoutePolicy(p, methods=["POST"], single_tenant=True) for p in ("/payments", "/quotes")]
    app.add_middleware(IdempotencyMiddleware, backend=backend, namespace=namespace, routes=routes)
    async with client(app) as c:
        first = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "eff-1"})
        retry = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "eff-1"})
        q1 = await c.post("/quotes", content=BODY, headers={"Idempotency-Key": "q-1"})
        q2 = await c.post("/quotes", content=BODY, headers={"Idempotency-Key": "q-1"})
    assert first.status_code == 500
    assert_problem(retry, problems.OUTCOME_UNKNOWN)
    assert counts["provider_calls"] == 1
    assert q1.status_code == q2.status_code == 500 and counts["quotes"] == 2  # before the marker: released


# --- 5. transient refusals are not stored --------------------------------------------------------


@pytest.mark.parametrize("status", [401, 407, 408, 425, 429, 500, 503])
async def test_transient_refusals_are_released_so_the_retry_runs(backend: Backend, namespace: str, status: int) -> None:
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await read_body(receive)
        await send({"type": "http.response.start", "status": status if runs == 1 else 201, "headers": []})
        await send({"type": "http.response.body", "body": b"attempt %d" % runs})

    mw = IdempotencyMiddleware(
        app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
    )
    first = await drive(mw, http_scope(key=f"tr-{status}"), [BODY])
    second = await drive(mw, http_scope(key=f"tr-{status}"), [BODY])
    third = await drive(mw, http_scope(key=f"tr-{status}"), [BODY])
    assert first.status == status and second.status == 201 and runs == 2
    assert third.body == second.body and third.header("idempotent-replayed") == b"true"


@pytest.mark.parametrize("status", [400, 402, 403, 404, 409, 422])
async def test_final_refusals_are_stored_and_replayed(backend: Backend, namespace: str, status: int) -> None:
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await read_body(receive)
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"no"})

    mw = IdempotencyMiddleware(
        app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
    )
    first = await drive(mw, http_scope(key=f"fin-{status}"), [BODY])
    again = await drive(mw, http_scope(key=f"fin-{status}"), [BODY])
    assert first.status == again.status == status and runs == 1
    assert again.header("idempotent-replayed") == b"true"


# --- 6. secure by default ------------------------------------------------------------------------


class User:
    def __init__(self, identity: str, authenticated: bool = True) -> None:
        self.identity = identity
        self.is_authenticated = authenticated


def test_scope_from_user_reads_the_authenticated_principal() -> None:
    scope_of = scope_from_user()
    assert scope_of({"user": User("u-7")}) == "u-7"
    assert scope_of({"user": User("", authenticated=False)}) is None  # Starlette's UnauthenticatedUser
    assert scope_of({"user": {"id": 42}}) == "42"
    assert scope_of({"user": "alice"}) == "alice"
    assert scope_of({"user": object()}) is None  # never str(obj): it could differ between retries
    assert scope_of({"auth": "raw-bearer-token"}) is None  # never a plain credential
    assert scope_of({"auth": {"sub": "svc-1"}}) == "svc-1"
    assert scope_from_user("account_id")({"user": {"account_id": "acct_1", "id": 5}}) == "acct_1"


async def test_scope_from_user_isolates_two_users_behind_an_auth_middleware(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    inner = charges_app(counts)

    def auth(app: Any) -> Any:
        async def with_user(scope: Scope, receive: Receive, send: Send) -> None:
            name = dict(scope["headers"]).get(b"x-test-user", b"").decode()
            scope["user"] = User(name, authenticated=bool(name))
            await app(scope, receive, send)

        return with_user

    mw = IdempotencyMiddleware(
        inner,
        backend=backend,
        namespace=namespace,
        scope=scope_from_user(),
        routes=[RoutePolicy("/payments", methods=["POST"])],
    )
    app = auth(mw)
    async with client(app) as c:
        a = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k", "x-test-user": "ann"})
        b = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k", "x-test-user": "bob"})
        anon = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k"})
    assert a.json()["scope"] == "ann" and b.json()["scope"] == "bob" and counts["charges"] == 2
    assert_problem(anon, problems.SCOPE_REQUIRED)


async def test_scope_header_sent_twice_is_a_400_problem() -> None:
    runs = Counter[str]()
    mw = IdempotencyMiddleware(
        webhook_app(runs), scope=scope_from_header("x-tenant-id"), routes=[RoutePolicy("/payments", methods=["POST"])]
    )
    scope = http_scope(key="k", headers=[("x-tenant-id", "acme"), ("x-tenant-id", "globex")])
    answer = await drive(mw, scope, [BODY])
    doc = assert_problem(answer, problems.SCOPE_MALFORMED)
    assert "x-tenant-id" in doc["detail"] and not runs
    with pytest.raises(InvalidScope):
        scope_from_header("x-tenant-id")({"headers": scope["headers"]})


# --- 7. a scoped route never falls back to unscoped ---------------------------------------------


async def test_a_scoped_route_never_falls_back_to_unscoped(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        charges_app(counts),
        backend=backend,
        namespace=namespace,
        scope=scope_from_header("x-tenant-id"),
        routes=[RoutePolicy("/payments", methods=["POST"], ttl=86_400, required=True)],
    )
    async with client(mw) as c:
        first = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k7", "x-tenant-id": "acme"})
        no_tenant = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k7"})
        empty = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k7", "x-tenant-id": ""})
    assert first.status_code == 201 and counts["charges"] == 1
    for answer in (no_tenant, empty):
        doc = assert_problem(answer, problems.SCOPE_REQUIRED)
        assert doc["type"] == "urn:idem-asgi:problem:scope-required"


async def test_anonymous_callers_get_their_own_key_space_when_the_route_allows_it(
    backend: Backend, namespace: str
) -> None:
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        charges_app(counts),
        backend=backend,
        namespace=namespace,
        scope=scope_from_header("x-tenant-id"),
        routes=[RoutePolicy("/payments", methods=["POST"], anonymous=True)],
    )
    async with client(mw) as c:
        anon = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "an-1"})
        anon_again = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "an-1"})
        # a tenant literally named like the anonymous space is another key space
        sneaky = await c.post(
            "/payments", content=BODY, headers={"Idempotency-Key": "an-1", "x-tenant-id": "~anonymous"}
        )
    assert anon.status_code == 201 and anon_again.headers["idempotent-replayed"] == "true"
    assert anon.json()["scope"] is None
    assert sneaky.status_code == 201 and "idempotent-replayed" not in sneaky.headers
    assert counts["charges"] == 2


# --- 8. a scope value of any kind ----------------------------------------------------------------


@pytest.mark.parametrize("value", [{"tenant": 1}, 1.5, b"acme", True])
async def test_a_scope_callable_returning_a_non_string_gets_a_problem_never_a_500(
    backend: Backend, namespace: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    runs: Counter[str] = Counter()
    path = f"/payments-{uuid.uuid4().hex[:8]}"
    mw = IdempotencyMiddleware(
        webhook_app(runs),
        backend=backend,
        namespace=namespace,
        scope=lambda s: value,  # type: ignore[arg-type,return-value]  # not a str, on purpose
        routes=[RoutePolicy(path)],
    )
    with caplog.at_level(logging.ERROR, logger="idem_asgi"):
        answer = await drive(mw, http_scope(path=path, key="k8"), [BODY])
    assert_problem(answer, problems.SCOPE_MALFORMED)
    assert not runs and "must return a str or None" in caplog.text


async def test_a_scope_of_thousands_of_characters_is_stored_as_a_digest(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    long_a, long_b = "a" * 10_000, "a" * 9_999 + "b"
    mw = IdempotencyMiddleware(
        charges_app(counts),
        backend=backend,
        namespace=namespace,
        scope=scope_from_header("x-tenant-id"),
        routes=[RoutePolicy("/payments", methods=["POST"])],
    )
    async with client(mw) as c:
        first = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k", "x-tenant-id": long_a})
        again = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k", "x-tenant-id": long_a})
        other = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k", "x-tenant-id": long_b})
        by_int = IdempotencyMiddleware(
            charges_app(counts),
            backend=backend,
            namespace=namespace,
            scope=lambda s: 42,  # type: ignore[arg-type,return-value]  # not a str, on purpose
            routes=[RoutePolicy("/payments", methods=["POST"])],
        )
    assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 201 and "idempotent-replayed" not in other.headers
    assert first.json()["scope"] == long_a  # the handler still sees the real scope
    assert counts["charges"] == 2
    digest = stored_scope(long_a)
    assert len(digest) < MAX_SCOPE_LENGTH and digest.startswith("~h ")
    record = await backend.get(RecordKey.build(namespace, digest, "k"))
    assert record is not None and record.state == COMPLETED
    async with client(by_int) as c:
        numbered = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "k-int"})
    assert numbered.status_code == 201 and numbered.json()["scope"] == "42"


# --- 9. handlers longer than the TTL -------------------------------------------------------------


async def test_a_handler_running_past_its_ttl_keeps_its_key(backend: Backend, namespace: str) -> None:
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await read_body(receive)
        await asyncio.sleep(2.0)  # twice the TTL
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"done %d" % runs})

    mw = IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", single_tenant=True, ttl=1.0, lease=0.3)],
    )
    first = asyncio.create_task(drive(mw, http_scope(key="long-1"), [BODY]))
    await asyncio.sleep(1.5)  # past the TTL, still running
    duplicate = await drive(mw, http_scope(key="long-1"), [BODY])
    assert_problem(duplicate, problems.IN_PROGRESS)
    done = await first
    assert done.status == 201 and runs == 1
    await asyncio.sleep(0.6)  # the answer is kept a full TTL from completion, not from the claim
    replay = await drive(mw, http_scope(key="long-1"), [BODY])
    assert replay.body == b"done 1" and replay.header("idempotent-replayed") == b"true"
    await asyncio.sleep(0.6)
    assert await backend.get(RecordKey.build(namespace, None, "long-1")) is None  # and then it expires


# --- 10. fail_open still forwards the key --------------------------------------------------------


class DownStore(MemoryBackend):
    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        raise BackendUnavailable("store down")


async def test_fail_open_still_forwards_the_key_and_scope() -> None:
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        charges_app(counts),
        backend=DownStore(),
        scope=scope_from_header("x-tenant-id"),
        on_store_error="fail_open",
        routes=[RoutePolicy("/payments", methods=["POST"])],
    )
    async with client(mw) as c:
        r = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "fo-1", "x-tenant-id": "acme"})
    assert r.status_code == 201 and r.json()["key"] == "fo-1" and r.json()["scope"] == "acme"
    assert json.loads(r.json()["body"]) == json.loads(BODY)


# --- 11. request.state is shared, not copied -----------------------------------------------------


async def test_request_state_is_shared_with_outer_middleware(backend: Backend, namespace: str) -> None:
    seen: dict[str, Any] = {}
    app = FastAPI()

    @app.post("/payments")
    async def pay(request: Request) -> dict[str, str]:
        request.state.charge_id = "ch_1"
        return {"ok": "yes"}

    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True)],
    )

    async def access_log(scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})
        await app(scope, receive, send)
        if scope["type"] == "http":
            seen.update(scope["state"])

    async with client(access_log) as c:
        await c.post("/payments", content=BODY, headers={"Idempotency-Key": "st-1"})
    assert seen["charge_id"] == "ch_1" and seen["idempotency"].key == "st-1"


# --- 12. the Postgres claim context ends with its request ----------------------------------------


@pytest.mark.postgres
async def test_postgres_claim_context_ends_with_its_request() -> None:
    from tests.support.stores import make_backend

    pg = await make_backend("postgres")
    ledger = f"ledger_{uuid.uuid4().hex[:8]}"
    async with pg.transaction() as conn:
        await conn.execute(f"CREATE TABLE {ledger} (what text)")
    done = asyncio.Event()

    async def write(what: str) -> None:
        async with pg.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1)", what)

    async def after_answer() -> None:
        await write("background")
        done.set()

    async def pay(request: Request) -> Response:
        await write("keyed")
        return PlainTextResponse("paid", status_code=201, background=BackgroundTask(after_answer))

    async def plain(request: Request) -> Response:
        await write("keyless")
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route("/payments", pay, methods=["POST"]), Route("/notes", plain, methods=["POST"])])
    mw = IdempotencyMiddleware(
        inner, backend=pg, namespace=f"t-{uuid.uuid4().hex}", routes=[RoutePolicy("/payments", single_tenant=True)]
    )
    try:
        # One task for all three (httpx's ASGI transport runs the app in the caller's task), so a
        # context variable leaking from the keyed request would reach the next ones.
        async with client(mw) as c:
            keyed = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "ctx-1"})
            await asyncio.wait_for(done.wait(), 5)
            keyless = await c.post("/notes", content=b"x")
            keyless_protected = await c.post("/payments", content=BODY)  # optional key, none sent
        assert keyed.status_code == 201 and keyless.status_code == 200 and keyless_protected.status_code == 201
        async with pg.transaction() as conn:
            rows = sorted(r[0] for r in await conn.fetch(f"SELECT what FROM {ledger}"))
        # every write committed as its own plain transaction once no claim was live: none raised ClaimLost
        assert rows == ["background", "background", "keyed", "keyed", "keyless"]
    finally:
        async with pg.transaction() as conn:
            await conn.execute(f"DROP TABLE {ledger}")
        await pg.aclose()


# --- 13. the memory store never evicts a live completed record -----------------------------------


async def test_a_full_memory_store_refuses_with_503_and_a_greedy_scope_gets_429() -> None:
    counts: Counter[str] = Counter()
    backend = MemoryBackend(max_entries=20, scope_share=0.25)
    mw = IdempotencyMiddleware(
        charges_app(counts),
        backend=backend,
        scope=scope_from_header("x-tenant-id"),
        routes=[RoutePolicy("/payments", methods=["POST"])],
    )
    async with client(mw) as c:
        greedy = [
            await c.post("/payments", content=BODY, headers={"Idempotency-Key": f"g{i}", "x-tenant-id": "greedy"})
            for i in range(8)
        ]
        others = []
        for t in range(4):
            for i in range(4):
                others.append(
                    await c.post(
                        "/payments", content=BODY, headers={"Idempotency-Key": f"o{i}", "x-tenant-id": f"t{t}"}
                    )
                )
        full = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "late", "x-tenant-id": "t9"})
        replay = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "g0", "x-tenant-id": "greedy"})
    assert [r.status_code for r in greedy] == [201] * 5 + [429] * 3  # its share: 5 of 20
    assert_problem(greedy[-1], problems.KEY_QUOTA)
    assert greedy[-1].headers["retry-after"] == "1"
    assert [r.status_code for r in others[:15]] == [201] * 15  # other tenants keep working
    assert_problem(others[15], problems.STORE_UNAVAILABLE)  # the store is full: 20 live records
    assert_problem(full, problems.STORE_UNAVAILABLE)
    assert replay.headers["idempotent-replayed"] == "true"  # nothing was evicted to make room
    assert len(backend) == 20


# --- 14. Litestar and other per-route builders ---------------------------------------------------


@pytest.mark.redis
async def test_litestar_per_route_instances_share_one_store_and_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    from litestar import Litestar, post
    from litestar.middleware import DefineMiddleware

    from idem_asgi.testing import find_middleware
    from tests.support.servers import REDIS_URL, require

    require("redis", REDIS_URL)
    runs: Counter[str] = Counter()

    @post("/payments", status_code=201)
    async def pay() -> dict[str, int]:
        runs["pay"] += 1
        return {"run": runs["pay"]}

    @post("/refunds", status_code=201)
    async def refund() -> dict[str, int]:
        runs["refund"] += 1
        return {"run": runs["refund"]}

    path = f"/unscoped-{uuid.uuid4().hex[:8]}"
    url = REDIS_URL.rsplit("/", 1)[0] + f"/{3 + uuid.uuid4().int % 12}"  # a URL string, as users write it
    with caplog.at_level(logging.WARNING, logger="idem_asgi"):
        app = Litestar(
            logging_config=None,  # Litestar's default reconfigures the process's logging
            route_handlers=[pay, refund],
            middleware=[
                DefineMiddleware(
                    IdempotencyMiddleware,  # type: ignore[arg-type]  # Litestar types ASGI with its own TypedDicts
                    backend=url,
                    namespace=f"t-{uuid.uuid4().hex}",
                    strict=False,
                    routes=[RoutePolicy("/payments", methods=["POST"]), RoutePolicy(path), RoutePolicy("/refunds")],
                )
            ],
        )
        async with client(app) as c:
            a = await c.post("/payments", headers={"Idempotency-Key": "lit-1"})
            b = await c.post("/refunds", headers={"Idempotency-Key": "lit-1"})  # same header key, other route
            a2 = await c.post("/payments", headers={"Idempotency-Key": "lit-1"})
    instances = find_middleware(app)
    assert len(instances) > 1  # Litestar really built one per handler
    assert len({id(m.backend) for m in instances}) == 1  # ... and they share one store, one pool
    await instances[0].backend.aclose()
    assert a.status_code == 201 and a2.headers["idempotent-replayed"] == "true"
    assert_problem(b, problems.FINGERPRINT_MISMATCH)  # one store: the reuse on another route is seen
    warnings = [r for r in caplog.records if path in r.getMessage()]
    assert len(warnings) == 1


# --- 15. replay fidelity leftovers: trailers, compression ----------------------------------------


async def test_trailers_are_stored_and_replayed(backend: Backend, namespace: str) -> None:
    runs = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        runs += 1
        await read_body(receive)
        headers = [(b"content-type", b"text/plain"), (b"trailer", b"x-checksum")]
        await send({"type": "http.response.start", "status": 200, "headers": headers, "trailers": True})
        await send({"type": "http.response.body", "body": b"report ", "more_body": True})
        await send({"type": "http.response.body", "body": b"body", "more_body": False})
        await send({"type": "http.response.trailers", "headers": [(b"x-checksum", b"abc123")], "more_trailers": False})

    mw = IdempotencyMiddleware(
        app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
    )
    extensions: dict[str, Any] = {"http.response.trailers": {}}
    first = await drive(mw, http_scope(key="tr-1", extensions=extensions), [BODY])
    replay = await drive(mw, http_scope(key="tr-1", extensions=extensions), [BODY])
    no_trailers = await drive(mw, http_scope(key="tr-1"), [BODY])  # this server cannot send trailers
    assert runs == 1
    assert [m["type"] for m in first.messages][-1] == "http.response.trailers"
    assert replay.messages[0]["trailers"] is True and replay.body == b"report body"
    assert replay.messages[-1] == {
        "type": "http.response.trailers",
        "headers": [(b"x-checksum", b"abc123")],
        "more_trailers": False,
    }
    assert (b"trailer", b"x-checksum") in replay.headers
    assert [m["type"] for m in no_trailers.messages] == ["http.response.start", "http.response.body"]
    assert no_trailers.body == b"report body" and "trailers" not in no_trailers.messages[0]
    record = await backend.get(RecordKey.build(namespace, None, "tr-1"))
    assert record is not None and record.response is not None
    assert record.response.trailers == [(b"x-checksum", b"abc123")]


async def test_compression_outside_the_middleware_stores_identity_bytes_and_compresses_each_replay(
    backend: Backend, namespace: str
) -> None:
    payload = {"receipt": "x" * 2_000}
    runs = 0

    async def pay(request: Request) -> Response:
        nonlocal runs
        runs += 1
        return JSONResponse(payload, status_code=201)

    app = Starlette(
        routes=[Route("/payments", pay, methods=["POST"])],
        middleware=[
            Middleware(GZipMiddleware, minimum_size=500),  # outermost: compresses each answer, replays too
            Middleware(
                IdempotencyMiddleware,
                backend=backend,
                namespace=namespace,
                routes=[RoutePolicy("/payments", single_tenant=True)],
            ),
        ],
    )
    async with client(app) as c:
        first = await c.post("/payments", content=BODY, headers={"Idempotency-Key": "gz-1", "Accept-Encoding": "gzip"})
        identity = await c.post(
            "/payments", content=BODY, headers={"Idempotency-Key": "gz-1", "Accept-Encoding": "identity"}
        )
    assert runs == 1
    assert first.headers["content-encoding"] == "gzip"
    assert "content-encoding" not in identity.headers and identity.headers["idempotent-replayed"] == "true"
    assert identity.json() == first.json() == payload
    record = await backend.get(RecordKey.build(namespace, None, "gz-1"))
    assert record is not None and record.response is not None
    assert json.loads(record.response.body) == payload  # the app's own bytes, not gzip
    with pytest.raises(OSError):
        gzip.decompress(record.response.body)


def test_a_compressor_inside_the_middleware_is_warned_about_at_start_up(caplog: pytest.LogCaptureFixture) -> None:
    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("not called")

    with caplog.at_level(logging.WARNING, logger="idem_asgi"):
        IdempotencyMiddleware(GZipMiddleware(endpoint), routes=[RoutePolicy("/gz-warn", single_tenant=True)])
    assert "GZipMiddleware runs inside IdempotencyMiddleware" in caplog.text


# --- 16. a store that can never work fails at start-up -------------------------------------------


async def lifespan(app: Any) -> list[Message]:
    """Drive one ASGI lifespan start-up and shutdown; return what the app sent."""
    sent: list[Message] = []
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> Message:
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    with contextlib.suppress(Exception):
        await asyncio.wait_for(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send), 10)
    return sent


def plain_app() -> Starlette:
    return Starlette(routes=[Route("/payments", lambda r: PlainTextResponse("ok", 201), methods=["POST"])])


@pytest.fixture
async def restricted_role() -> AsyncIterator[str]:
    """A Postgres role that may log in but has no rights on the idempotency table: its DSN."""
    import asyncpg

    from tests.support.servers import POSTGRES_DSN, require

    require("postgres", POSTGRES_DSN)
    role = f"idem_norights_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(POSTGRES_DSN)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        yield POSTGRES_DSN.replace("postgres@", f"{role}@")
    finally:
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()


@pytest.mark.postgres
@pytest.mark.parametrize("table", ["idem_test_records", "idem_never_created"])
async def test_a_postgres_role_without_rights_fails_at_start_up_not_per_request(
    restricted_role: str, table: str, caplog: pytest.LogCaptureFixture
) -> None:
    from idem_asgi.backends.postgres import PostgresBackend
    from tests.support.stores import make_backend

    await (await make_backend("postgres")).aclose()  # the owner has created idem_test_records
    backend = PostgresBackend.from_dsn(restricted_role, table=table, min_size=1, max_size=2)
    mw = IdempotencyMiddleware(plain_app(), backend=backend, routes=[RoutePolicy("/payments", single_tenant=True)])
    try:
        with caplog.at_level(logging.ERROR, logger="idem_asgi"):
            sent = await lifespan(mw)
        failed = [m for m in sent if m["type"] == "lifespan.startup.failed"]
        assert failed and "GRANT SELECT, INSERT, UPDATE, DELETE" in failed[0]["message"]
        if table == "idem_never_created":
            assert "idem-asgi --backend <owner DSN> migrate" in failed[0]["message"]
        assert "refuses" in caplog.text
        # served anyway (a server without lifespan): a clear 500, never a "retry later" 503
        answer = await drive(mw, http_scope(key="mis-1"), [BODY])
        assert_problem(answer, problems.STORE_MISCONFIGURED)
        assert answer.header("retry-after") is None
    finally:
        await backend.aclose()


@pytest.mark.postgres
async def test_a_postgres_database_that_does_not_exist_fails_at_start_up() -> None:
    from idem_asgi.backends.postgres import PostgresBackend
    from tests.support.servers import POSTGRES_DSN, require

    require("postgres", POSTGRES_DSN)
    dsn = POSTGRES_DSN.rsplit("/", 1)[0] + "/no_such_database_idem"
    backend = PostgresBackend.from_dsn(dsn, min_size=1, max_size=1)
    mw = IdempotencyMiddleware(plain_app(), backend=backend, routes=[RoutePolicy("/payments", single_tenant=True)])
    try:
        sent = await lifespan(mw)
        assert sent[0]["type"] == "lifespan.startup.failed"
        assert_problem(await drive(mw, http_scope(key="db-1"), [BODY]), problems.STORE_MISCONFIGURED)
    finally:
        await backend.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("problem", ["wrong_password", "no_script_rights"])
async def test_a_redis_that_refuses_us_fails_at_start_up_not_per_request(tmp_path: Any, problem: str) -> None:
    import redis.asyncio as aioredis

    from idem_asgi.backends.redis import RedisBackend
    from tests.support.servers import redis_process

    with redis_process(tmp_path / "redis") as server:
        admin = aioredis.Redis(port=server.port)
        await admin.execute_command("ACL", "SETUSER", "app", "on", ">right", "~*", "+@all", "-@scripting")  # type: ignore[no-untyped-call]  # untyped in redis-py
        await admin.aclose()
        url = f"redis://app:{'wrong' if problem == 'wrong_password' else 'right'}@127.0.0.1:{server.port}/0"
        backend = RedisBackend.from_url(url)
        mw = IdempotencyMiddleware(plain_app(), backend=backend, routes=[RoutePolicy("/payments", single_tenant=True)])
        try:
            sent = await lifespan(mw)
            assert sent[0]["type"] == "lifespan.startup.failed", sent
            assert "redis refuses" in sent[0]["message"]
            answer = await drive(mw, http_scope(key="rmis-1"), [BODY])
            assert_problem(answer, problems.STORE_MISCONFIGURED)
        finally:
            await backend.aclose()


async def test_a_store_that_is_merely_down_at_start_up_does_not_fail_it(caplog: pytest.LogCaptureFixture) -> None:
    from idem_asgi.backends.redis import RedisBackend

    backend = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    mw = IdempotencyMiddleware(plain_app(), backend=backend, routes=[RoutePolicy("/payments", single_tenant=True)])
    try:
        with caplog.at_level(logging.WARNING, logger="idem_asgi"):
            sent = await lifespan(mw)
        assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
        assert "unreachable at start-up" in caplog.text
        answer = await drive(mw, http_scope(key="down-1"), [BODY])
        assert_problem(answer, problems.STORE_UNAVAILABLE)  # an outage: retry later
    finally:
        await backend.aclose()


@pytest.mark.postgres
def test_uvicorn_refuses_to_start_with_a_store_that_can_never_work(restricted_role: str) -> None:
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "uvicorn", "--factory", "tests.store_check_app:app"]
    command += ["--port", str(free_port()), "--lifespan", "on"]
    env = {**os.environ, "IDEM_CHECK_DSN": restricted_role}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]  # uvicorn's "application start-up failed"
    assert "the idempotency store refuses this app" in done.stderr and "GRANT SELECT" in done.stderr


async def test_litestar_compression_config_is_inside_and_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    from litestar import Litestar, post
    from litestar.config.compression import CompressionConfig
    from litestar.middleware import DefineMiddleware

    @post("/payments", status_code=201)
    async def pay() -> dict[str, str]:
        return {"receipt": "x" * 3_000}

    with caplog.at_level(logging.WARNING, logger="idem_asgi"):
        inside = Litestar(
            [pay],
            logging_config=None,
            compression_config=CompressionConfig(backend="gzip", minimum_size=500),
            middleware=[DefineMiddleware(IdempotencyMiddleware, routes=[RoutePolicy("/payments", single_tenant=True)])],  # type: ignore[arg-type]  # Litestar types ASGI with its own TypedDicts
        )
        async with client(inside) as c:
            await c.post("/payments", headers={"Idempotency-Key": "lz-1"})
    assert "CompressionMiddleware runs inside IdempotencyMiddleware" in caplog.text
    # The README's way: the compressor wraps the whole app, so each replay is compressed for its request.
    backend = MemoryBackend()
    outside = GZipMiddleware(
        Litestar(  # type: ignore[arg-type]  # Starlette and Litestar type ASGI apps differently
            [pay],
            logging_config=None,
            middleware=[
                DefineMiddleware(
                    IdempotencyMiddleware,  # type: ignore[arg-type]  # Litestar types ASGI with its own TypedDicts
                    backend=backend,
                    routes=[RoutePolicy("/payments", single_tenant=True)],
                )
            ],
        ),
        minimum_size=500,
    )
    async with client(outside) as c:
        zipped = await c.post("/payments", headers={"Idempotency-Key": "lz-2", "Accept-Encoding": "gzip"})
        plain = await c.post("/payments", headers={"Idempotency-Key": "lz-2", "Accept-Encoding": "identity"})
    assert zipped.headers["content-encoding"] == "gzip" and "content-encoding" not in plain.headers
    assert plain.headers["idempotent-replayed"] == "true" and plain.json() == zipped.json()


async def test_litestar_per_route_instances_share_the_default_memory_store() -> None:
    from litestar import Litestar, post
    from litestar.middleware import DefineMiddleware

    from idem_asgi.testing import find_middleware

    @post("/payments", status_code=201)
    async def pay() -> dict[str, str]:
        return {"paid": "yes"}

    @post("/refunds", status_code=201)
    async def refund() -> dict[str, str]:
        return {"refunded": "yes"}

    routes = [RoutePolicy("/payments", single_tenant=True), RoutePolicy("/refunds", single_tenant=True)]
    app = Litestar(
        [pay, refund],
        logging_config=None,
        middleware=[DefineMiddleware(IdempotencyMiddleware, routes=routes)],  # type: ignore[arg-type]  # Litestar types ASGI with its own TypedDicts
    )
    async with client(app) as c:
        await c.post("/payments", headers={"Idempotency-Key": "dm-1"})
        reuse = await c.post("/refunds", headers={"Idempotency-Key": "dm-1"})
    instances = find_middleware(app)
    assert len(instances) > 1 and len({id(m.backend) for m in instances}) == 1
    assert_problem(reuse, problems.FINGERPRINT_MISMATCH)
