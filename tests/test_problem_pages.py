"""Problem links that resolve: the default `type` locates nothing; `problem_base="/problems/"` makes
the middleware serve each problem's page, so following any refusal's `type` or `Link` through the
app answers 200 with that problem's text; docs/problems.md is made from the same text."""

from __future__ import annotations

import asyncio
import html
import re
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.errors import BackendMisconfigured, BackendUnavailable, ConfigurationError
from idem_asgi.http import problem_pages, problems
from idem_asgi.http.keys import scope_from_header
from idem_asgi.http.signatures import SignatureMiddleware, StripeScheme
from idem_asgi.records import RecordKey
from tests.support.charges import BODY, KEY, LEASE, Payments, crash_first_request
from tests.support.problems import assert_problem
from tests.support.signing import SECRET, sign_stripe
from tests.support.stores import Delegating
from tools import problems_doc

BASE = "/problems/"


class Failing(Delegating):
    """A store whose every call raises `error` (an outage, or a store that refuses us)."""

    def __init__(self, inner: Backend, error: Exception) -> None:
        super().__init__(inner)
        self.error = error

    def before(self, op: str, key: RecordKey) -> RecordKey:
        raise self.error


def guarded(app: Any, backend: Any, namespace: str, **policy: Any) -> IdempotencyMiddleware:
    policy.setdefault("single_tenant", "scope" not in policy)
    scope = policy.pop("scope", None)
    return IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        scope=scope,
        routes=[RoutePolicy("/payments", methods=["POST"], **policy)],
        problem_base=BASE,
    )


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def follow(app: Any, response: httpx.Response, problem: problems.ProblemType) -> None:
    """The refusal names `problem` under the served base, its Link says the same, and both resolve
    through `app` to that problem's page."""
    doc = assert_problem(response, problem, base=BASE)
    link = re.fullmatch(r'<([^>]+)>; rel="describedby"', response.headers["link"])
    assert link is not None and link.group(1) == doc["type"]
    async with client(app) as c:
        page = await c.get(urljoin(str(response.url), doc["type"]))
    assert page.status_code == 200, (problem.slug, page.status_code)
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    text = page.text
    assert f"<h1>{html.escape(problem.title)}</h1>" in text
    assert html.escape(problem.happened.split("`")[0], quote=False) in text  # what happened
    assert html.escape(problem.to_do.split("`")[0][1:], quote=False) in text  # what to do


def test_default_problem_types_are_not_urls_of_an_address_we_do_not_serve() -> None:
    for p in problems.DOCUMENTED:
        assert urlsplit(p.type).scheme not in ("http", "https"), p.type
        assert p.type == f"urn:idem-asgi:problem:{p.slug}"  # idem-asgi 0.1.0's identifiers, unchanged
        assert problems.slug_of(p.type) == p.slug
    assert "github.com" not in problems.DEFAULT_PROBLEM_BASE


async def test_default_refusal_sends_no_link_to_a_page_that_does_not_exist(backend: Backend, namespace: str) -> None:
    mw = IdempotencyMiddleware(
        Payments(), backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
    )
    async with client(mw) as c:
        r = await c.post("/payments", content=BODY, headers={"Idempotency-Key": ""})
        assert_problem(r, problems.KEY_MALFORMED)
        assert "link" not in r.headers
        page = await c.get(f"/problems/{problems.KEY_MALFORMED.slug}")
        assert "x-charge" in page.headers  # the app's own answer: the middleware serves no pages by default


async def test_every_refusal_resolves_through_the_app_when_pages_are_on(backend: Backend, namespace: str) -> None:
    app = Payments()
    mw = guarded(app, backend, namespace, required=True, max_body=64, lease=LEASE)
    async with client(mw) as c:
        await follow(mw, await c.post("/payments", content=BODY), problems.KEY_REQUIRED)
        await follow(
            mw, await c.post("/payments", content=BODY, headers={"Idempotency-Key": "a b"}), problems.KEY_MALFORMED
        )
        big = b"x" * 65
        await follow(
            mw, await c.post("/payments", content=big, headers={"Idempotency-Key": "big"}), problems.BODY_TOO_LARGE
        )
        assert (await c.post("/payments", content=BODY, headers={"Idempotency-Key": KEY})).status_code == 201
        other = await c.post("/payments", content=b"{}", headers={"Idempotency-Key": KEY})
        await follow(mw, other, problems.FINGERPRINT_MISMATCH)

    gate = asyncio.Event()
    held = Payments(gate=gate)
    mw = guarded(held, backend, namespace + "-held")
    async with client(mw) as c:
        first = asyncio.ensure_future(c.post("/payments", content=BODY, headers={"Idempotency-Key": KEY}))
        await asyncio.wait_for(held.entered.wait(), 5)
        await follow(
            mw, await c.post("/payments", content=BODY, headers={"Idempotency-Key": KEY}), problems.IN_PROGRESS
        )
        gate.set()
        assert (await first).status_code == 201

    crashed = Payments(hang_first=True)
    mw = guarded(crashed, backend, namespace + "-crash", lease=LEASE)
    await crash_first_request(mw, crashed)
    async with client(mw) as c:
        await follow(
            mw, await c.post("/payments", content=BODY, headers={"Idempotency-Key": KEY}), problems.OUTCOME_UNKNOWN
        )

    mw = guarded(Payments(), backend, namespace + "-scoped", scope=scope_from_header("x-tenant"))
    async with client(mw) as c:
        r = await c.post("/payments", content=BODY, headers={"Idempotency-Key": KEY})
        await follow(mw, r, problems.SCOPE_REQUIRED)
        two = [("Idempotency-Key", KEY), ("x-tenant", "a"), ("x-tenant", "b")]
        await follow(mw, await c.post("/payments", content=BODY, headers=two), problems.SCOPE_MALFORMED)

    for error, problem in (
        (BackendUnavailable("down"), problems.STORE_UNAVAILABLE),
        (BackendMisconfigured("no rights"), problems.STORE_MISCONFIGURED),
    ):
        mw = guarded(Payments(), Failing(backend, error), namespace)
        async with client(mw) as c:
            await follow(mw, await c.post("/payments", content=BODY, headers={"Idempotency-Key": KEY}), problem)


async def test_memory_only_refusals_resolve_through_the_app_when_pages_are_on(namespace: str) -> None:
    store = MemoryBackend(max_entries=2, scope_share=0.5)
    try:
        mw = guarded(Payments(), store, namespace, scope=scope_from_header("x-tenant"), max_stored_body=4)
        async with client(mw) as c:
            headers = {"Idempotency-Key": KEY, "x-tenant": "t"}
            assert (await c.post("/payments", content=BODY, headers=headers)).status_code == 201
            await follow(mw, await c.post("/payments", content=BODY, headers=headers), problems.NOT_STORED)
            r = await c.post("/payments", content=BODY, headers={**headers, "Idempotency-Key": "second"})
            await follow(mw, r, problems.KEY_QUOTA)
    finally:
        await store.aclose()


async def test_webhook_refusals_resolve_through_the_app_when_pages_are_on() -> None:
    mw = SignatureMiddleware(
        Payments(), paths=["/hooks"], scheme=StripeScheme(), secrets=[SECRET], max_body=64, problem_base=BASE
    )
    async with client(mw) as c:
        await follow(mw, await c.post("/hooks", content=BODY), problems.SIGNATURE_MALFORMED)
        bad = {"Stripe-Signature": sign_stripe(BODY, secret="whsec_other")}
        await follow(mw, await c.post("/hooks", content=BODY, headers=bad), problems.SIGNATURE_INVALID)
        await follow(mw, await c.post("/hooks", content=b"x" * 65), problems.BODY_TOO_LARGE)


async def test_pages_are_read_only_and_leave_the_rest_of_the_path_to_the_app(namespace: str) -> None:
    async def other(request: Any) -> PlainTextResponse:
        return PlainTextResponse(f"app {request.method}", status_code=404)

    inner = Starlette(routes=[Route("/problems/{rest:path}", other, methods=["GET", "POST"])])
    mw = guarded(inner, MemoryBackend(), namespace)
    async with client(mw) as c:
        head = await c.head("/problems/key-required")
        assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        assert (await c.post("/problems/key-required")).text == "app POST"  # not a page: the app's
        assert (await c.get("/problems/no-such-problem")).text == "app GET"
        assert (await c.get("/problems/")).text == "app GET"
        every = [await c.get(p.url(BASE)) for p in problems.DOCUMENTED]
        assert [r.status_code for r in every] == [200] * len(problems.DOCUMENTED)


async def test_pages_under_a_mount_are_linked_with_the_mount_path(namespace: str) -> None:
    mw = guarded(Payments(), MemoryBackend(), namespace, required=True)
    outer = Starlette(routes=[Mount("/api", app=mw)])
    async with client(outer) as c:
        r = await c.post("/api/payments", content=BODY)
        assert r.json()["type"] == "/api/problems/key-required"
        page = await c.get(r.json()["type"])
        assert page.status_code == 200 and problems.KEY_REQUIRED.title in page.text


def test_problem_base_must_be_a_served_path_or_an_absolute_url() -> None:
    for bad in ("urn:x:", "problems/", "/problems", "//evil.example/p/", "/p#/", "/p?x=/", "https://a.example/p"):
        with pytest.raises(ConfigurationError, match="problem_base"):
            IdempotencyMiddleware(Payments(), routes=[], problem_base=bad)
    assert problems.served("/problems/") and not problems.served("https://a.example/p/")


def test_docs_problems_md_is_made_from_the_page_text_in_the_code() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "problems.md").read_text()
    assert problems_doc.replaced(doc) == doc, "run: python -m tools.problems_doc --write"
    for p in problems.DOCUMENTED:
        assert f"\n## {p.slug}\n" in doc
        assert problem_pages.render(p).count(b"<p>") == 3
