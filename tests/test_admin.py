"""The admin app (`idem_asgi.admin`): the operator's console over HTTP, on real stores.

Each test drives `AdminApp` through httpx (`ASGITransport`, or a Starlette app that mounts it) and
checks what an operator, or someone who is not one, gets: authorization on every route, the fenced
resolve on memory, Redis and Postgres (the record, its history, the observer), refusals that write
nothing, bad input answered with 4xx problems (never a 500), the page under its nonce CSP and its
mount path, a failing store as 503, and hostile key text kept out of any HTML.

A stuck claim is staged as a SIGKILLed worker leaves it: claimed directly on the store with a short
lease, never completed, the lease left to run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from idem_asgi._types import Message, Scope
from idem_asgi.admin import MAX_BODY, AdminApp, token_auth
from idem_asgi.backends import Backend, Histories, MemoryBackend
from idem_asgi.claims.surfaces import JOB
from idem_asgi.errors import ConfigurationError
from idem_asgi.history import token_prefix
from idem_asgi.http.keys import MAX_SCOPE_LENGTH, stored_scope
from idem_asgi.jobs.decorator import stored_result
from idem_asgi.observe import Event
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, Existing, RecordKey, StoredResponse
from tests.support.servers import free_port
from tests.support.stores import BACKENDS, make_backend, store_from_url

DAY = 86_400.0
OPERATOR = "op-" + uuid.uuid4().hex
READER = "ro-" + uuid.uuid4().hex
AS_OPERATOR = {"authorization": f"Bearer {OPERATOR}"}
AS_READER = {"authorization": f"Bearer {READER}"}
JSON_TYPE = {"content-type": "application/json"}
BODY = '{"charge":"ch_from_provider","amount":1230}'
PAGE_SOURCE = Path(__file__).resolve().parents[1] / "idem_asgi" / "admin" / "_page.py"
HOSTILE = "<img src=x onerror=alert(1)>"
ROUTES = [("GET", "/"), ("GET", "/api/stuck"), ("GET", "/api/key"), ("POST", "/api/resolve")]


# -- helpers ----------------------------------------------------------------------------------------


def admin(backend: Backend, events: list[Event] | None = None, **options: Any) -> AdminApp:
    """The app as an operator mounts it: alice may resolve, bob may only look."""
    return AdminApp(
        backend,
        authorize=token_auth({OPERATOR: "alice"}, read_only={READER: "bob"}),
        observer=None if events is None else events.append,
        **options,
    )


def client(app: Any, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """An httpx client on the ASGI app; an exception in the app comes back as a 500, as a server sends it."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://admin.test", headers=headers)


def problem(response: httpx.Response, status: int) -> dict[str, Any]:
    """Assert an RFC 9457 problem of this status; returns its document."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["cache-control"] == "no-store"
    doc = response.json()
    assert isinstance(doc, dict), doc
    assert doc["type"] == "about:blank" and doc["status"] == status
    assert isinstance(doc["title"], str) and doc["title"]
    assert isinstance(doc["detail"], str) and doc["detail"]
    assert "Traceback" not in response.text
    return doc


def ok(response: httpx.Response, status: int = 200) -> dict[str, Any]:
    """Assert a JSON answer (never HTML) of this status; returns its document."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    assert response.headers["cache-control"] == "no-store"
    doc = json.loads(response.content)  # strict: no NaN or Infinity allowed below
    assert isinstance(doc, dict), doc
    return doc


async def claim(backend: Backend, key: RecordKey, *, lease: float = 0.05, fingerprint: bytes = b"fp") -> int:
    """A claim its worker never finishes; its token."""
    claimed = await backend.claim(key, fingerprint, lease=lease, ttl=DAY)
    assert isinstance(claimed, Claimed), claimed
    return claimed.token


async def lease_over() -> None:
    await asyncio.sleep(0.15)  # the claims above lease 0.05 s: over, by the store's clock too


async def untouched(backend: Backend, key: RecordKey, token: int) -> None:
    """The claim is as it was staged: in progress, same token, no step `resolved` in its history."""
    record = await backend.get(key)
    assert record is not None and record.state == IN_PROGRESS and record.token == token, record
    assert isinstance(backend, Histories)
    assert [s for s in await backend.read_history(key) if s.what == "resolved"] == []


def answer_of(status: int = 201, body: str = BODY) -> dict[str, Any]:
    return {"status": status, "headers": [["Content-Type", "application/json"]], "body": body}


@pytest.fixture
def memory() -> MemoryBackend:
    return MemoryBackend(history=16)


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Memory, Redis, Postgres; each keeping 16 steps of history per key."""
    backend: Backend = await make_backend(request.param, history=16)
    try:
        yield backend
    finally:
        await backend.aclose()


# -- 1. never without authorization -----------------------------------------------------------------


def test_it_is_never_built_without_authorization(memory: MemoryBackend) -> None:
    with pytest.raises(TypeError, match="authorize"):
        AdminApp(memory)  # type: ignore[call-arg]
    for wrong in (None, "s3cret", {OPERATOR: "alice"}):
        with pytest.raises(ConfigurationError, match=r"AdminApp needs authorize="):
            AdminApp(memory, authorize=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="at least one token"):
        token_auth({})
    assert isinstance(admin(memory), AdminApp)  # with a callable it is built


# -- 2. authorization on every route ----------------------------------------------------------------


@pytest.mark.parametrize(
    "credentials",
    [
        pytest.param({}, id="none"),
        pytest.param({"authorization": "Bearer not-a-known-token"}, id="unknown-bearer"),
        pytest.param({"authorization": "Bearer "}, id="empty-bearer"),
        pytest.param({"authorization": f"Basic {OPERATOR}"}, id="right-token-wrong-scheme"),
        pytest.param({"authorization": f"Bearer {OPERATOR}x"}, id="operator-token-plus-one-char"),
        pytest.param({"x-authorization": f"Bearer {OPERATOR}"}, id="another-header"),
    ],
)
async def test_every_route_answers_401_without_credentials_it_accepts(
    memory: MemoryBackend, namespace: str, credentials: dict[str, str]
) -> None:
    key = RecordKey.build(namespace, None, "pay-secret-4711")
    token = await claim(memory, key)
    await lease_over()
    events: list[Event] = []
    async with client(admin(memory, events, namespace=namespace), credentials) as http:
        for method, path in ROUTES:
            if method == "POST":
                ask = {"key": key.key, "token": str(token), "release": True, "older_than": 0}
                response = await http.post(path, json=ask)
            else:
                response = await http.get(path, params={"key": key.key, "older_than": "0"})
            doc = problem(response, 401)
            assert response.headers["www-authenticate"] == "Bearer"
            assert doc["detail"] == "credentials are needed"
            for secret in (key.key, str(token), namespace, key.digest):  # nothing of the store leaks
                assert secret not in response.text, (path, response.text)
    await untouched(memory, key, token)
    assert events == []


async def test_a_read_only_token_reads_and_gets_403_on_resolve(memory: MemoryBackend, namespace: str) -> None:
    key = RecordKey.build(namespace, None, "pay-ro")
    token = await claim(memory, key)
    await lease_over()
    events: list[Event] = []
    app = admin(memory, events, namespace=namespace)
    ask = {"key": key.key, "token": str(token), "answer": answer_of(), "older_than": 0}
    async with client(app, AS_READER) as http:
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        stuck = ok(await http.get("/api/stuck", params={"older_than": "0"}))
        assert [c["digest"] for c in stuck["claims"]] == [key.digest]
        found = ok(await http.get("/api/key", params={"key": key.key}))
        assert found["found"] is True and found["token"] == str(token)

        refused = await http.post("/api/resolve", json=ask)
        doc = problem(refused, 403)
        assert doc["detail"] == "these credentials may not resolve"
        assert "www-authenticate" not in refused.headers
        assert key.key not in refused.text and str(token) not in refused.text
    await untouched(memory, key, token)
    assert events == []

    async with client(app, AS_OPERATOR) as http:  # the same request, from an operator: done
        assert ok(await http.post("/api/resolve", json=ask))["resolved"] is True


async def test_a_custom_authorize_is_asked_the_action_and_false_is_403_everywhere(
    memory: MemoryBackend, namespace: str
) -> None:
    key = RecordKey.build(namespace, None, "pay-custom")
    token = await claim(memory, key)
    await lease_over()
    asked: list[tuple[str, str]] = []
    answer: list[str | bool | None] = [False]

    async def authorize(scope: Scope, action: str) -> str | bool | None:
        asked.append((scope["path"], action))
        return answer[0]

    app = AdminApp(memory, authorize=authorize, namespace=namespace)
    ask = {"key": key.key, "token": str(token), "answer": answer_of(), "older_than": 0}
    async with client(app) as http:
        for method, path in ROUTES:
            if method == "POST":
                response = await http.post(path, json=ask)
            else:
                response = await http.get(path, params={"key": key.key, "older_than": "0"})
            doc = problem(response, 403)
            assert "www-authenticate" not in response.headers
            assert key.key not in response.text and key.digest not in response.text, doc
        assert asked == [(p, "resolve" if m == "POST" else "read") for m, p in ROUTES]
        await untouched(memory, key, token)

        answer[0] = ""  # an empty name allows nothing either
        problem(await http.get("/api/stuck"), 403)
        answer[0] = None
        problem(await http.get("/api/stuck"), 401)

        answer[0] = True  # allowed, without a name: written down as "admin"
        assert ok(await http.post("/api/resolve", json=ask))["resolved"] is True
        steps = ok(await http.get("/api/key", params={"key": key.key}))["history"]
    assert [(s["what"], s["by"]) for s in steps if s["what"] == "resolved"] == [("resolved", "admin via the admin app")]


# -- 3. the whole flow on every store ---------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["answer", "release"])
async def test_a_stuck_claim_is_listed_inspected_and_resolved(store: Backend, namespace: str, outcome: str) -> None:
    """The answer by its key and scope; the release by its digest alone, as the page resolves a
    claim listed by digest (a store that keeps no raw key: Redis and Postgres by default)."""
    key = RecordKey.build(namespace, stored_scope("tenant-7"), "pay-flow")
    token = await claim(store, key)
    live = RecordKey.build(namespace, stored_scope("tenant-7"), "pay-running")
    await claim(store, live, lease=30)
    await lease_over()
    events: list[Event] = []
    async with client(admin(store, events, namespace=namespace), AS_OPERATOR) as http:
        stuck = ok(await http.get("/api/stuck", params={"older_than": "0"}))
        assert stuck["namespace"] == namespace and stuck["older_than"] == 0
        assert [(c["digest"], c["token"]) for c in stuck["claims"]] == [(key.digest, str(token))]  # not the live one
        listed = stuck["claims"][0]
        assert (listed["key"], listed["scope"]) in ((key.key, "tenant-7"), ("?", "?"))  # "?": a digest-only store
        elsewhere = ok(await http.get("/api/stuck", params={"older_than": "0", "namespace": f"{namespace}-other"}))
        assert elsewhere["claims"] == []
        assert ok(await http.get("/api/stuck"))["claims"] == []  # the default: over for 60 s at least

        by_key = {"key": key.key, "scope": "tenant-7"}
        by_digest = {"key": listed["key"], "scope": listed["scope"], "digest": listed["digest"]}  # as the page asks
        query = by_key if outcome == "answer" else by_digest
        before = ok(await http.get("/api/key", params=query))
        assert (before["found"], before["state"], before["lease_over"]) == (True, IN_PROGRESS, True)
        assert before["token"] == str(token) and isinstance(before["token"], str)
        assert (before["namespace"], before["digest"]) == (namespace, key.digest)
        if outcome == "answer":
            assert (before["scope"], before["key"]) == ("tenant-7", key.key)
        # The dead holder never wrote its `claimed` step: the record tells it.
        assert [(s["what"], s["token"]) for s in before["history"]] == [("claimed", token_prefix(token))]
        assert before["history"][0]["note"].startswith("read from the record")

        ask: dict[str, Any] = {**query, "token": before["token"], "older_than": 0}
        ask |= {"answer": answer_of(201)} if outcome == "answer" else {"release": True}
        done = ok(await http.post("/api/resolve", json=ask))
        verdict = "completed" if outcome == "answer" else "released"
        assert (done["resolved"], done["verdict"]) == (True, verdict), done
        assert done["said"] == (
            "stored the 201 answer: retries replay it" if outcome == "answer" else "released: the next retry runs it"
        )
        assert done["digest"] == key.digest

        record = await store.get(key)
        if outcome == "answer":
            assert record is not None and record.state == COMPLETED and record.response is not None
            assert record.response.status == 201
            assert record.response.headers == [(b"content-type", b"application/json")]
            assert record.response.body == BODY.encode()
            retry = await store.claim(key, b"fp", lease=30, ttl=DAY)  # a client's retry replays it
            assert isinstance(retry, Existing) and retry.record.response == record.response
        else:
            assert record is None
        assert (await store.get(live)) is not None  # the live claim beside it: left alone

        after = ok(await http.get("/api/key", params=query))
        steps = [(s["what"], s["token"]) for s in after["history"]]
        assert steps == [("claimed", token_prefix(token)), ("resolved", token_prefix(token))], after["history"]
        claimed, step = after["history"]
        assert "read from the record" in claimed["note"]  # written with the resolution, as it was read
        assert step["by"] == "alice via the admin app"
        if outcome == "answer":
            assert (after["state"], after["response"]["status"]) == (COMPLETED, 201)
            assert after["response"]["body_size"] == len(BODY)
            assert (step["status"], step["note"]) == (201, "completed")
        else:
            assert after["found"] is False
            assert (step["status"], step["note"]) == (None, "released")
            assert isinstance(await store.claim(key, b"fp", lease=30, ttl=DAY), Claimed)  # the retry runs

        again = await http.post("/api/resolve", json=ask)  # the same token a second time: nothing to do
        assert ok(again, 409)["resolved"] is False
    status = 201 if outcome == "answer" else None
    assert events == [Event("resolved", "admin", done["key"], done["scope"] or None, status)]
    assert events[0].key == (key.key if outcome == "answer" else listed["key"])


# -- 4. refusals write nothing ----------------------------------------------------------------------


async def test_refusals_say_why_and_write_nothing(store: Backend, namespace: str) -> None:
    live = RecordKey.build(namespace, None, "pay-live")
    live_token = await claim(store, live, lease=30)
    over = RecordKey.build(namespace, None, "pay-over")
    over_token = await claim(store, over)
    await lease_over()
    events: list[Event] = []
    async with client(admin(store, events, namespace=namespace), AS_OPERATOR) as http:

        async def resolve(status: int, **ask: Any) -> dict[str, Any]:
            body = {"answer": answer_of(), "older_than": 0, **ask}
            headers = {"content-type": "application/json; charset=utf-8"}  # parameters allowed
            return ok(await http.post("/api/resolve", content=json.dumps(body), headers=headers), status)

        doc = await resolve(409, key=live.key, token=str(live_token))
        assert (doc["resolved"], doc["verdict"]) == (False, "refused")
        assert "its holder is live; wait for the lease, then retry" in doc["said"], doc

        doc = await resolve(409, key=over.key, token=str(over_token + 1))
        assert doc["verdict"] == "refused" and f"its token is {over_token} now, not {over_token + 1}" in doc["said"]
        assert "it changed since you read it" in doc["said"]

        doc = await resolve(404, key="pay-never", token="12345")
        assert (doc["resolved"], doc["verdict"]) == (False, "missing")
        assert doc["said"].startswith(f"no record for {namespace} / - / pay-never"), doc

        doc = await resolve(404, key=over.key, scope="tenant-9", token=str(over_token))  # not under that scope
        assert doc["verdict"] == "missing" and doc["scope"] == "tenant-9"

        doc = await resolve(200, key=over.key, token=over_token, dry_run=True)  # a JSON number is taken too
        assert (doc["resolved"], doc["verdict"]) == (False, "dry_run")
        assert doc["said"] == f"http claim, token {over_token}: would store a 201 answer (dry run)"
        doc = await resolve(200, key=over.key, token=str(over_token), dry_run=True, answer=None, release=True)
        assert doc["said"].endswith("would release it (dry run)")

        # The default older_than (60 s): a lease over for a fraction of a second is not yet stuck.
        body = {"key": over.key, "token": str(over_token), "release": True}
        doc = ok(await http.post("/api/resolve", json=body), 409)
        assert doc["verdict"] == "refused" and "less than --older-than 60" in doc["said"], doc
        doc = ok(await http.post("/api/resolve", json={**body, "older_than": 3600}), 409)
        assert "less than --older-than 3600" in doc["said"]

    await untouched(store, live, live_token)
    await untouched(store, over, over_token)
    assert events == []


async def test_a_completed_record_is_not_resolved_again(memory: MemoryBackend, namespace: str) -> None:
    key = RecordKey.build(namespace, None, "pay-done")
    token = await claim(memory, key)
    assert await memory.complete(key, token, StoredResponse(200, [], b"done"), ttl=DAY)
    record = await memory.get(key)
    assert record is not None and record.state == COMPLETED
    async with client(admin(memory, namespace=namespace), AS_OPERATOR) as http:
        ask = {"key": key.key, "token": str(token), "release": True, "older_than": 0}
        doc = ok(await http.post("/api/resolve", json=ask), 409)
    assert "it is completed already" in doc["said"]
    assert await memory.get(key) == record


async def test_a_job_record_takes_a_result_not_an_http_answer(memory: MemoryBackend, namespace: str) -> None:
    key = RecordKey.build(namespace, None, "order_id=o-1")
    token = await claim(memory, key, fingerprint=JOB + b"\x01" * 16)
    await lease_over()
    events: list[Event] = []
    async with client(admin(memory, events, namespace=namespace), AS_OPERATOR) as http:
        base = {"key": key.key, "token": str(token), "older_than": 0}
        doc = problem(await http.post("/api/resolve", json={**base, "answer": answer_of(200)}), 400)
        assert "is a job's record, and this answer is an HTTP response" in doc["detail"]
        await untouched(memory, key, token)
        done = ok(await http.post("/api/resolve", json={**base, "result": {"charge": "ch_9", "amount": 100}}))
    assert (done["resolved"], done["verdict"]) == (True, "completed")
    record = await memory.get(key)
    assert record is not None and record.response == stored_result({"charge": "ch_9", "amount": 100})
    assert events == [Event("resolved", "admin", key.key, None, 200)]


async def test_an_observer_that_raises_does_not_undo_the_resolution(
    memory: MemoryBackend, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    key = RecordKey.build(namespace, None, "pay-observed")
    token = await claim(memory, key)
    await lease_over()

    def observer(event: Event) -> None:
        raise RuntimeError("metrics down")

    app = AdminApp(memory, authorize=token_auth({OPERATOR: "alice"}), namespace=namespace, observer=observer)
    async with client(app, AS_OPERATOR) as http:
        ask = {"key": key.key, "token": str(token), "release": True, "older_than": 0}
        assert ok(await http.post("/api/resolve", json=ask))["resolved"] is True
    assert await memory.get(key) is None
    assert "observer failed on 'resolved'" in caplog.text
    assert f"alice resolved {key.key} (released)" in caplog.text  # logged with the operator's name


# -- 5. bad input: 4xx problems, never a 500 --------------------------------------------------------

VALID: dict[str, Any] = {"key": "pay-bad", "token": "1", "release": True, "older_than": 0}
"""A resolve request that is right (the test puts in the claim's real token) but for what a case changes."""


def body(**changes: Any) -> bytes:
    """`VALID` with `changes` (a value of `...` drops the field), as JSON."""
    doc = {**VALID, **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("content", "ctype", "status", "detail"),
    [
        pytest.param(b"{not json", "application/json", 400, "the body is not JSON", id="not-json"),
        pytest.param(b"\xff\xfe{}", "application/json", 400, "the body is not JSON", id="not-utf8"),
        pytest.param(b"", "application/json", 400, "the body is not JSON", id="empty"),
        pytest.param(b"[1, 2]", "application/json", 400, "must be a JSON object", id="array"),
        pytest.param(
            b"key=a&token=1&release=true", "application/x-www-form-urlencoded", 415, "application/json", id="form"
        ),
        pytest.param(body(), "text/plain", 415, "application/json", id="text-plain"),
        pytest.param(body(), "multipart/form-data; boundary=x", 415, "application/json", id="multipart"),
        pytest.param(body(), None, 415, "application/json", id="no-content-type"),
        pytest.param(body(answer=answer_of()), "application/json", 400, "exactly one of", id="release-and-answer"),
        pytest.param(body(release=...), "application/json", 400, "exactly one of", id="neither"),
        pytest.param(body(release=False), "application/json", 400, "exactly one of", id="release-false"),
        pytest.param(body(release=..., answer=answer_of(99)), "application/json", 400, "answer.status", id="status-99"),
        pytest.param(
            body(release=..., answer=answer_of(600)), "application/json", 400, "answer.status", id="status-600"
        ),
        pytest.param(
            body(release=..., answer={"status": "201"}), "application/json", 400, "answer.status", id="status-text"
        ),
        pytest.param(
            body(release=..., answer={"status": True}), "application/json", 400, "answer.status", id="status-bool"
        ),
        pytest.param(body(release=..., answer=[201]), "application/json", 400, "answer: an object", id="answer-list"),
        pytest.param(
            body(release=..., answer={"status": 200, "headers": [["x-only-a-name"]]}),
            "application/json",
            400,
            "answer.headers",
            id="header-not-a-pair",
        ),
        pytest.param(
            body(release=..., answer={"status": 200, "headers": [["x-price", "5 €"]]}),
            "application/json",
            400,
            "latin-1",
            id="header-not-latin1",
        ),
        pytest.param(
            body(release=..., answer={"status": 200, "body_base64": "not base64!"}),
            "application/json",
            400,
            "not base64",
            id="bad-base64",
        ),
        pytest.param(
            body(release=..., answer={"status": 200, "body": 5}),
            "application/json",
            400,
            "answer.body",
            id="body-number",
        ),
        pytest.param(body(token="abc"), "application/json", 400, "token:", id="token-not-a-number"),
        pytest.param(body(token="-1"), "application/json", 400, "token:", id="token-signed-text"),
        pytest.param(body(token=1.5), "application/json", 400, "token:", id="token-float"),
        pytest.param(body(token=True), "application/json", 400, "token:", id="token-bool"),
        pytest.param(body(token=...), "application/json", 400, "token:", id="token-missing"),
        pytest.param(body(key=...), "application/json", 400, "key is required", id="key-missing"),
        pytest.param(body(key=""), "application/json", 400, "key is required", id="key-empty"),
        pytest.param(body(key=7), "application/json", 400, "key: a string", id="key-number"),
        pytest.param(body(key="?"), "application/json", 400, "key is required", id="key-unknown-without-digest"),
        pytest.param(body(key=..., digest="ab" * 31), "application/json", 400, "64 hex digits", id="digest-short"),
        pytest.param(body(key="?", digest="AB" * 32), "application/json", 400, "64 hex digits", id="digest-upper"),
        pytest.param(body(key=..., digest=64), "application/json", 400, "digest: a string", id="digest-number"),
        pytest.param(body(namespace=["idem"]), "application/json", 400, "namespace: a string", id="namespace-list"),
        pytest.param(body(scope=5), "application/json", 400, "scope: a string", id="scope-number"),
        pytest.param(body(scope="a\x00b"), "application/json", 400, "invalid scope", id="scope-nul"),
        pytest.param(body(older_than="soon"), "application/json", 400, "older_than: a number", id="older-than-text"),
        pytest.param(body(older_than=-1), "application/json", 400, "older_than: 0 or more", id="older-than-negative"),
        pytest.param(body(older_than="nan"), "application/json", 400, "older_than: 0 or more", id="older-than-nan"),
        pytest.param(body(older_than=[1]), "application/json", 400, "older_than: a number", id="older-than-list"),
        pytest.param(b"{" + b" " * MAX_BODY + b"}", "application/json", 413, f"at most {MAX_BODY}", id="over-1MiB"),
        # Library bugs found writing these tests (each was a 500), fixed:
        pytest.param(
            body(token="\u00b2"),
            "application/json",
            400,
            "token:",
            id="token-superscript-digit",
        ),
        pytest.param(
            body(release=..., answer={"status": 200, "headers": 5}),
            "application/json",
            400,
            "answer.headers",
            id="headers-not-a-list",
        ),
        pytest.param(
            b'{"key": "\\ud800", "token": "1", "release": true}',
            "application/json",
            400,
            "key",
            id="key-lone-surrogate",
        ),
        pytest.param(
            b"[" * 50_000 + b"]" * 50_000,
            "application/json",
            400,
            "JSON",
            id="deeply-nested",
        ),
    ],
)
async def test_bad_resolve_requests_get_a_4xx_problem_and_write_nothing(
    memory: MemoryBackend, content: bytes, ctype: str | None, status: int, detail: str
) -> None:
    key = RecordKey.build("idem", None, "pay-bad")
    token = await claim(memory, key, lease=30)
    # The right token (the only thing wrong in each request is the field its id names).
    content = content.replace(b'"token": "1"', f'"token": "{token}"'.encode())
    events: list[Event] = []
    headers = {} if ctype is None else {"content-type": ctype}
    async with client(admin(memory, events), AS_OPERATOR) as http:
        response = await http.post("/api/resolve", content=content, headers=headers)
    doc = problem(response, status)
    assert detail in doc["detail"], doc
    await untouched(memory, key, token)
    assert events == []


async def test_a_body_over_1MiB_in_chunks_is_413(memory: MemoryBackend) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"key": "pay-big", "release": true, "pad": "'
        for _ in range(40):
            yield b"x" * 32_768
        yield b'"}'

    async with client(admin(memory), AS_OPERATOR) as http:
        response = await http.post("/api/resolve", content=chunks(), headers=JSON_TYPE)
    assert problem(response, 413)["detail"] == f"at most {MAX_BODY} bytes"


@pytest.mark.parametrize(
    ("method", "target", "status", "detail"),
    [
        pytest.param("GET", "/api/key", 400, "key is required", id="key-missing"),
        pytest.param("GET", "/api/key?key=", 400, "key is required", id="key-empty"),
        pytest.param("GET", "/api/key?digest=xyz", 400, "64 hex digits", id="digest-not-hex"),
        pytest.param("GET", "/api/key?key=k&scope=%00", 400, "invalid scope", id="scope-nul"),
        pytest.param("GET", "/api/stuck?older_than=abc", 400, "older_than: a number", id="older-than-text"),
        pytest.param("GET", "/api/stuck?older_than=-5", 400, "older_than: 0 or more", id="older-than-negative"),
        pytest.param("GET", "/api/stuck?older_than=nan", 400, "older_than: 0 or more", id="older-than-nan"),
        pytest.param("GET", "/api/nope", 404, "no such page: /api/nope", id="unknown-path"),
        pytest.param("GET", "/index.html", 404, "no such page", id="unknown-page"),
        pytest.param("GET", "/api/resolve", 405, "/api/resolve takes POST", id="get-resolve"),
        pytest.param("POST", "/api/key?key=k", 405, "/api/key takes GET", id="post-key"),
        pytest.param("POST", "/api/stuck", 405, "/api/stuck takes GET", id="post-stuck"),
        pytest.param("DELETE", "/", 405, "/ takes GET", id="delete-page"),
        pytest.param("PUT", "/api/resolve", 405, "/api/resolve takes POST", id="put-resolve"),
    ],
)
async def test_bad_reads_and_unknown_routes_get_a_4xx_problem(
    memory: MemoryBackend, method: str, target: str, status: int, detail: str
) -> None:
    async with client(admin(memory), AS_OPERATOR) as http:
        response = await http.request(method, target, headers=JSON_TYPE, content=b"{}" if method != "GET" else None)
    assert detail in problem(response, status)["detail"]


async def test_a_scope_too_long_is_found_under_its_digest_form(memory: MemoryBackend, namespace: str) -> None:
    """A scope longer than MAX_SCOPE_LENGTH is no error: routes store it as `~h <sha256>`, and the
    API finds the record under the scope as given (or under that stored form, as `stale` lists it)."""
    long_scope = "t" * (MAX_SCOPE_LENGTH + 1)
    stored = stored_scope(long_scope)
    assert stored.startswith("~h ")
    key = RecordKey.build(namespace, stored, "pay-long")
    token = await claim(memory, key)
    await lease_over()
    async with client(admin(memory, namespace=namespace), AS_OPERATOR) as http:
        for given in (long_scope, stored):
            doc = ok(await http.get("/api/key", params={"key": key.key, "scope": given}))
            assert (doc["found"], doc["scope"], doc["token"]) == (True, stored, str(token))
        ask = {"key": key.key, "scope": long_scope, "token": str(token), "release": True, "older_than": 0}
        assert ok(await http.post("/api/resolve", json=ask))["verdict"] == "released"
    assert await memory.get(key) is None


# -- 6. the page ------------------------------------------------------------------------------------


def nonce_of(response: httpx.Response) -> str:
    policy = response.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["frame-ancestors"] == "'none'" and directives["form-action"] == "'none'"
    assert directives["connect-src"] == "'self'"
    found = re.fullmatch(r"'nonce-([A-Za-z0-9_-]{16,})'", directives["script-src"])
    assert found is not None, policy
    assert directives["style-src"] == directives["script-src"]
    return found.group(1)


async def test_the_page_runs_only_its_own_nonced_script_and_style(memory: MemoryBackend) -> None:
    hostile_ns = '"><script>alert(1)</script>'
    app = AdminApp(memory, authorize=token_auth({OPERATOR: "alice"}), namespace=hostile_ns, older_than=90)
    async with client(app, AS_OPERATOR) as http:
        first, second = await http.get("/"), await http.get("/")
    assert first.status_code == 200
    assert first.headers["content-type"] == "text/html; charset=utf-8"
    assert first.headers["x-content-type-options"] == "nosniff"
    assert first.headers["cache-control"] == "no-store"
    assert first.headers["referrer-policy"] == "no-referrer"
    nonce = nonce_of(first)
    page = first.text
    assert page.count("<script") == page.count(f'<script nonce="{nonce}">') == 1
    assert page.count("<style") == page.count(f'<style nonce="{nonce}">') == 1
    assert set(re.findall(r'nonce="([^"]*)"', page)) == {nonce}
    assert nonce_of(second) != nonce  # fresh per response
    assert '<body data-base="">' in page  # served at the root: the API is at /api/...
    assert "<script>alert(1)</script>" not in page  # the namespace is escaped into the page
    assert 'value="&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;"' in page
    assert 'id="older" type="number" min="0" step="1" value="90"' in page


def test_the_page_never_parses_store_values_as_html() -> None:
    source = PAGE_SOURCE.read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in source, sink
    assert source.count(".textContent =") >= 5  # values go in as text


async def test_mounted_under_starlette_the_page_and_api_use_the_mount_path(
    memory: MemoryBackend, namespace: str
) -> None:
    key = RecordKey.build(namespace, None, "pay-mounted")
    token = await claim(memory, key)
    await lease_over()
    events: list[Event] = []
    outer = Starlette(routes=[Mount("/idem-admin", app=admin(memory, events, namespace=namespace))])
    async with client(outer, AS_OPERATOR) as http:
        page = await http.get("/idem-admin/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        base = re.search(r'<body data-base="([^"]*)">', page.text)
        assert base is not None and base.group(1) == "/idem-admin"
        nonce_of(page)

        # The page calls base + "/api/...": under the mount, that is the app's API.
        found = ok(await http.get(base.group(1) + "/api/key", params={"key": key.key}))
        assert (found["found"], found["token"], found["lease_over"]) == (True, str(token), True)
        stuck = ok(await http.get(base.group(1) + "/api/stuck", params={"older_than": "0"}))
        assert [c["digest"] for c in stuck["claims"]] == [key.digest]
        ask = {"key": key.key, "token": found["token"], "release": True, "older_than": "0"}  # as the page sends it
        done = ok(await http.post(base.group(1) + "/api/resolve", json=ask))
        assert (done["resolved"], done["verdict"]) == (True, "released")
        assert problem(await http.get("/idem-admin/api/nope"), 404)["detail"] == "no such page: /api/nope"
        problem(await http.get("/idem-admin/api/key", params={"key": key.key}, headers={"authorization": ""}), 401)
        gone = ok(await http.get("/idem-admin/api/key", params={"key": key.key}, headers=AS_READER))
        assert gone["found"] is False and [s["what"] for s in gone["history"]] == ["claimed", "resolved"]
    assert await memory.get(key) is None
    assert events == [Event("resolved", "admin", key.key, None, None)]


async def test_mounted_alone_it_answers_the_lifespan(memory: MemoryBackend) -> None:
    app = admin(memory)
    inbox: list[Message] = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return inbox.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    await asyncio.wait_for(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send), 2)
    assert sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]


# -- 7. a failing store is a 503 --------------------------------------------------------------------


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never says a word (a hung store)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


@pytest.mark.parametrize("kind", ["redis", "postgres"])
@pytest.mark.parametrize("fault", ["refused", "silent"])
async def test_a_store_that_fails_is_a_503_problem(kind: str, fault: str) -> None:
    with silent_port() as hung:
        port = free_port() if fault == "refused" else hung
        url = f"redis://127.0.0.1:{port}/0" if kind == "redis" else f"postgresql://postgres@127.0.0.1:{port}/test"
        backend = store_from_url(url, timeout=0.3, history=16)
        try:
            async with client(admin(backend), AS_OPERATOR) as http:
                page = await http.get("/")  # the page needs no store
                assert page.status_code == 200
                for method, target in [("GET", "/api/stuck"), ("GET", "/api/key?key=k"), ("POST", "/api/resolve")]:
                    started = time.monotonic()
                    ask = {"key": "k", "token": "1", "release": True, "older_than": 0}
                    response = await http.request(method, target, json=ask if method == "POST" else None)
                    doc = problem(response, 503)
                    assert doc["detail"].startswith("the store failed: "), doc
                    assert time.monotonic() - started < 5, (target, time.monotonic() - started)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(backend.aclose(), 5)


# -- 8. hostile text stays text ---------------------------------------------------------------------


async def test_html_in_keys_and_names_comes_back_as_json_text(memory: MemoryBackend, namespace: str) -> None:
    key = RecordKey.build(namespace, stored_scope("<script>s</script>"), HOSTILE)
    token = await claim(memory, key)
    await lease_over()
    app = AdminApp(memory, authorize=token_auth({OPERATOR: "<b>mallory</b>"}), namespace=namespace)
    async with client(app, AS_OPERATOR) as http:
        query = {"key": HOSTILE, "scope": "<script>s</script>"}
        responses = [
            await http.get("/api/stuck", params={"older_than": "0"}),
            await http.get("/api/key", params=query),
            await http.post("/api/resolve", json={**query, "token": str(token), "release": True, "older_than": 0}),
            await http.get("/api/key", params=query),
            await http.get("/api/nope<script>", params=query),
        ]
    for response in responses:
        assert response.headers["content-type"] in ("application/json", "application/problem+json"), response
        assert "html" not in response.headers["content-type"]
        json.loads(response.content)
    listed, found, done, after = (r.json() for r in responses[:4])
    assert [(c["key"], c["scope"]) for c in listed["claims"]] == [(HOSTILE, "<script>s</script>")]
    assert (found["key"], found["scope"], found["token"]) == (HOSTILE, "<script>s</script>", str(token))
    assert (done["key"], done["verdict"]) == (HOSTILE, "released")
    assert [s["by"] for s in after["history"] if s["what"] == "resolved"] == ["<b>mallory</b> via the admin app"]


# -- library bugs these tests found, fixed ----------------------------------------------------------


async def test_stuck_lists_tokens_as_strings_as_key_does(memory: MemoryBackend, namespace: str) -> None:
    key = RecordKey.build(namespace, None, "pay-token")
    token = await claim(memory, key)
    await lease_over()
    assert token > 2**53  # more than a JavaScript number holds exactly (62 random bits: nearly always)
    async with client(admin(memory, namespace=namespace), AS_OPERATOR) as http:
        stuck = ok(await http.get("/api/stuck", params={"older_than": "0"}))
    assert [c["token"] for c in stuck["claims"]] == [str(token)]


async def test_stuck_answers_strict_json_for_an_infinite_older_than(memory: MemoryBackend) -> None:
    async with client(admin(memory), AS_OPERATOR) as http:
        response = await http.get("/api/stuck", params={"older_than": "inf"})
    assert response.status_code in (200, 400)
    json.loads(response.content, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
