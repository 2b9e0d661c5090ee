"""The parts around the core: webhook method gaps, unsigned key headers, Postgres transactions,
reconcile, OpenAPI, observers, the client and the CLI. One section per defect class."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Annotated, Any, Literal

import httpx
import pytest
from fastapi import FastAPI, Header, Request

from idem_asgi import (
    ConfigurationError,
    HmacScheme,
    IdempotencyMiddleware,
    RoutePolicy,
    SignatureMiddleware,
    StripeScheme,
    event_id,
)
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.records import StaleRecord
from tests.support.asgi import drive, http_scope, read_body

SECRET = "whsec_around"


def hook_app(counts: Counter[str]) -> Any:
    """Routes POST only: any other method gets 405, as a framework's router answers."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        if scope["method"] != "POST":
            await send({"type": "http.response.start", "status": 405, "headers": [(b"allow", b"POST")]})
            await send({"type": "http.response.body", "body": b"method not allowed"})
            return
        counts[scope["path"]] += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"applied %d" % counts[scope["path"]]})

    return app


# --- 1. no unsigned path to a webhook's key space --------------------------------------------------


def test_no_unsigned_path_to_a_webhooks_key_space_refuses_the_method_mismatch_at_start_up() -> None:
    counts: Counter[str] = Counter()
    loose = IdempotencyMiddleware(
        hook_app(counts),
        routes=[RoutePolicy("/webhooks/stripe", key=event_id(field="id"), required=True, single_tenant=True)],
    )  # methods default to POST and PATCH
    with pytest.raises(ConfigurationError, match=r"\['PATCH'\].*methods=\['POST'\]"):
        SignatureMiddleware(loose, paths=["/webhooks/stripe"], scheme=StripeScheme(), secrets=[SECRET])
    patterned = IdempotencyMiddleware(
        hook_app(counts),
        routes=[RoutePolicy("/webhooks/{provider}", key=event_id(field="id"), single_tenant=True)],
    )
    with pytest.raises(ConfigurationError, match="PATCH"):
        SignatureMiddleware(patterned, paths=["/webhooks/*"], scheme=StripeScheme(), secrets=[SECRET])
    tight = IdempotencyMiddleware(
        hook_app(counts),
        routes=[RoutePolicy("/webhooks/stripe", methods=["POST"], key=event_id(field="id"), single_tenant=True)],
    )
    SignatureMiddleware(tight, paths=["/webhooks/stripe"], scheme=StripeScheme(), secrets=[SECRET])
    # Header-key routes under a signed path are not keyed by content: nothing to refuse.
    header_keyed = IdempotencyMiddleware(hook_app(counts), routes=[RoutePolicy("/webhooks/stripe", single_tenant=True)])
    SignatureMiddleware(header_keyed, paths=["/webhooks/stripe"], scheme=StripeScheme(), secrets=[SECRET])


async def test_a_405_is_never_stored_under_an_event_id() -> None:
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        hook_app(counts),
        routes=[RoutePolicy("/webhooks/acme", key=event_id(field="id"), required=True, single_tenant=True)],
    )
    event = json.dumps({"id": "evt_405"}).encode()
    unrouted = await drive(mw, http_scope("PATCH", "/webhooks/acme"), [event])
    again = await drive(mw, http_scope("PATCH", "/webhooks/acme"), [event])
    genuine = await drive(mw, http_scope("POST", "/webhooks/acme"), [event])
    assert unrouted.status == again.status == 405 and again.header("idempotent-replayed") is None
    assert genuine.status == 200 and genuine.body == b"applied 1"


async def test_the_readme_webhook_setup_starts_and_applies_each_event_once() -> None:
    from tests.support.signing import sign_stripe

    counts: Counter[str] = Counter()
    app = FastAPI()

    @app.post("/webhooks/stripe")
    async def hook(request: Request) -> dict[str, bool]:
        counts["events"] += 1
        await request.body()
        return {"received": True}

    app.add_middleware(
        IdempotencyMiddleware,
        backend=MemoryBackend(),
        routes=[
            RoutePolicy(
                "/webhooks/stripe",
                methods=["POST"],
                key=event_id(field="id"),
                required=True,
                single_tenant=True,
                ttl=timedelta(days=7),
            )
        ],
    )
    app.add_middleware(SignatureMiddleware, paths=["/webhooks/stripe"], scheme=StripeScheme(), secrets=[SECRET])
    body = b'{"id":"evt_readme"}'
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        answers = [
            await c.post("/webhooks/stripe", content=body, headers={"Stripe-Signature": sign_stripe(body, SECRET)})
            for _ in range(3)
        ]
        unsigned_patch = await c.patch("/webhooks/stripe", content=body)
    assert [a.status_code for a in answers] == [200, 200, 200] and counts["events"] == 1
    assert answers[2].headers["idempotent-replayed"] == "true"
    assert unsigned_patch.status_code == 405  # not protected, not signed: the framework's own answer


# --- 2. keys from headers the signature does not cover ---------------------------------------------


def test_a_key_from_a_header_the_signature_does_not_cover_is_refused_at_start_up() -> None:
    counts: Counter[str] = Counter()
    by_header = IdempotencyMiddleware(
        hook_app(counts),
        routes=[
            RoutePolicy(
                "/webhooks/github", methods=["POST"], key=event_id(header="X-GitHub-Delivery"), single_tenant=True
            )
        ],
    )
    github = HmacScheme(header="X-Hub-Signature-256", prefix="sha256=")
    with pytest.raises(ConfigurationError, match=r"X-GitHub-Delivery|x-github-delivery"):
        SignatureMiddleware(by_header, paths=["/webhooks/github"], scheme=github, secrets=[SECRET])

    class SignsTheDelivery(HmacScheme):
        signed_headers = frozenset({"X-GitHub-Delivery"})

    SignatureMiddleware(
        by_header, paths=["/webhooks/github"], scheme=SignsTheDelivery(header="X-Hub-Signature-256"), secrets=[SECRET]
    )
    by_field = IdempotencyMiddleware(
        hook_app(counts),
        routes=[RoutePolicy("/webhooks/github", methods=["POST"], key=event_id(field="delivery"), single_tenant=True)],
    )
    SignatureMiddleware(by_field, paths=["/webhooks/github"], scheme=github, secrets=[SECRET])


async def test_the_payments_example_replays_a_redelivery_that_was_signed_again() -> None:
    from examples.payments.app import create_app
    from examples.payments.provider import HonestProvider, webhook_signature

    provider = HonestProvider(latency=0.001, webhook_secret="whsec_old")
    app = create_app(provider=provider, webhook_secret=["whsec_old", "whsec_new"])  # a rotation
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
        r = await c.post("/orders", json={"amount": 100}, headers={"X-Merchant-Id": "m", "Idempotency-Key": "o1"})
        order_id = r.json()["id"]
        paid = await c.post(
            f"/orders/{order_id}/pay", json={"amount": 100}, headers={"X-Merchant-Id": "m", "Idempotency-Key": "p1"}
        )
        made = await provider.refund(
            charge_id=paid.json()["charge"]["id"], amount=10, reference=order_id, idempotency_key=None
        )
        delivery = provider.refund_webhook(made)
        first = await c.post("/webhooks/provider", content=delivery.body, headers=delivery.headers)
        resigned = {**delivery.headers, "Webhook-Signature": webhook_signature("whsec_new", delivery.id, delivery.body)}
        again = await c.post("/webhooks/provider", content=delivery.body, headers=resigned)
    assert first.status_code == 200 and first.json()["applied"] is True
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"  # not a 422
    assert again.content == first.content


# --- 4. Postgres transaction() used more than once, or nested --------------------------------------


@pytest.mark.postgres
async def test_postgres_transaction_used_twice_or_nested_commits_under_one_claim(namespace: str) -> None:
    import uuid

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from idem_asgi.http import problems
    from tests.support.problems import assert_problem
    from tests.support.stores import make_backend

    pg = await make_backend("postgres")
    ledger = f"ledger_{uuid.uuid4().hex[:8]}"
    async with pg.transaction() as conn:
        await conn.execute(f"CREATE TABLE {ledger} (key text, step text)")
    runs: Counter[str] = Counter()

    async def pay(request: Request) -> PlainTextResponse:
        key = request.headers["idempotency-key"]
        runs[key] += 1
        async with pg.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 'charge')", key)
            async with pg.transaction() as inner:  # joins: a savepoint on the same connection
                assert inner is conn
                await inner.execute(f"INSERT INTO {ledger} VALUES ($1, 'fee')", key)
            with pytest.raises(RuntimeError):
                async with pg.transaction() as inner:  # a nested block that fails rolls back alone
                    await inner.execute(f"INSERT INTO {ledger} VALUES ($1, 'rolled back')", key)
                    raise RuntimeError("nested failure")
        if key.startswith("fail"):
            raise RuntimeError("the receipt step failed after the first block committed")
        async with pg.transaction() as conn:  # a second block, after the first committed
            await conn.execute(f"INSERT INTO {ledger} VALUES ($1, 'receipt')", key)
        return PlainTextResponse("paid", status_code=201)

    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/payments", pay, methods=["POST"])]),
        backend=pg,
        namespace=namespace,
        routes=[RoutePolicy("/payments", single_tenant=True)],
    )
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=mw, raise_app_exceptions=False), base_url="http://t"
        ) as c:
            first = await c.post("/payments", content=b"{}", headers={"Idempotency-Key": "ok-1"})
            again = await c.post("/payments", content=b"{}", headers={"Idempotency-Key": "ok-1"})
            failed = await c.post("/payments", content=b"{}", headers={"Idempotency-Key": "fail-1"})
            retry = await c.post("/payments", content=b"{}", headers={"Idempotency-Key": "fail-1"})
        async with pg.transaction() as conn:
            rows = sorted((r["key"], r["step"]) for r in await conn.fetch(f"SELECT key, step FROM {ledger}"))
        assert first.status_code == 201 and again.headers["idempotent-replayed"] == "true"
        assert rows == [
            ("fail-1", "charge"),
            ("fail-1", "fee"),
            ("ok-1", "charge"),
            ("ok-1", "fee"),
            ("ok-1", "receipt"),
        ]
        assert failed.status_code == 500
        assert_problem(retry, problems.OUTCOME_UNKNOWN)  # its first block committed: never run again
        assert runs == {"ok-1": 1, "fail-1": 1}
    finally:
        async with pg.transaction() as conn:
            await conn.execute(f"DROP TABLE {ledger}")
        await pg.aclose()


# --- 7. OpenAPI output validates -------------------------------------------------------------------


def test_openapi_output_validates_without_duplicates_and_with_the_right_headers() -> None:
    from openapi_spec_validator import validate

    from idem_asgi import add_openapi, intent_key

    outer = FastAPI()
    sub = FastAPI()

    @outer.post("/payments")
    async def pay(idempotency_key: Annotated[str, Header(alias="Idempotency-Key")]) -> dict[str, str]:
        return {"key": idempotency_key}

    @outer.post("/bookings")
    async def book() -> dict[str, str]:
        return {}

    @sub.post("/refunds")
    async def refund() -> dict[str, str]:
        return {}

    outer.mount("/v1", sub)
    outer.add_middleware(
        IdempotencyMiddleware,
        replay_header="X-Replayed",
        routes=[
            RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True),
            RoutePolicy("/bookings", methods=["POST"], key=intent_key("user"), single_tenant=True),
            RoutePolicy("/v1/refunds", methods=["POST"], single_tenant=True),
        ],
    )
    add_openapi(outer)
    schema = outer.openapi()
    validate(schema)
    pay_op = schema["paths"]["/payments"]["post"]
    assert [p["name"] for p in pay_op["parameters"]] == ["Idempotency-Key"]  # declared once, not twice
    assert "X-Replayed" in pay_op["responses"]["200"]["headers"]
    assert "Idempotent-Replayed" not in pay_op["responses"]["200"]["headers"]
    book_op = schema["paths"]["/bookings"]["post"]
    assert "parameters" not in book_op  # a derived key ignores the header: not documented
    assert "409" in book_op["responses"]
    sub_schema = sub.openapi()  # the mounted app's own schema, its paths relative to the mount
    validate(sub_schema)
    refund_op = sub_schema["paths"]["/refunds"]["post"]
    assert [p["name"] for p in refund_op["parameters"]] == ["Idempotency-Key"]
    assert "X-Replayed" in refund_op["responses"]["200"]["headers"]


# --- 8. observers are isolated ---------------------------------------------------------------------


def test_fan_out_keeps_calling_observers_when_one_raises(caplog: pytest.LogCaptureFixture) -> None:
    from idem_asgi.observe import Counters, Event, fan_out

    counts = Counters()

    def broken(event: Event) -> None:
        raise RuntimeError("metrics backend down")

    observer = fan_out(broken, counts)
    observer(Event("claimed", "/payments"))
    observer(Event("completed", "/payments"))
    assert counts["claimed"] == counts["completed"] == 1
    assert "metrics backend down" in caplog.text


def test_prometheus_observer_can_be_made_twice() -> None:
    from prometheus_client import CollectorRegistry

    from idem_asgi.observe import Event, prometheus_observer

    registry = CollectorRegistry()
    first, second = prometheus_observer(registry), prometheus_observer(registry)  # an app factory, called twice
    first(Event("claimed", "/payments"))
    second(Event("claimed", "/payments"))
    assert registry.get_sample_value("idem_asgi_events_total", {"event": "claimed", "route": "/payments"}) == 2


async def test_logs_never_carry_a_raw_scope_or_a_resolvers_secret(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from idem_asgi import scope_from_header
    from idem_asgi.observe import LogObserver
    from idem_asgi.ops.reconcile import reconcile
    from idem_asgi.records import RecordKey

    api_key = "sk_live_51HxQ2eLkdIwHu7ixlZ3k9Qmz"
    counts: Counter[str] = Counter()
    mw = IdempotencyMiddleware(
        hook_app(counts),
        scope=scope_from_header("x-api-key"),
        observer=LogObserver(),
        routes=[RoutePolicy("/payments", methods=["POST"])],
    )
    with caplog.at_level(logging.INFO):
        await drive(mw, http_scope(key="log-1", headers=[("x-api-key", api_key)]), [b"{}"])
    records = [r for r in caplog.records if r.name == "idem_asgi.events"]
    assert records and all(api_key not in str(vars(r)) for r in records)
    assert all(len(vars(r)["idem_scope_digest"]) == 16 for r in records)

    store = MemoryBackend()
    key = RecordKey.build("ns", None, "stuck-1")
    await store.claim(key, b"fp", lease=0.001, ttl=60)
    import asyncio

    await asyncio.sleep(0.01)

    def resolve(stale: object) -> None:
        raise RuntimeError(f"provider refused token {api_key}")

    caplog.clear()
    report = await reconcile(store, resolve, older_than=0)
    assert report.errors == 1 and api_key not in report.items[0].detail
    assert api_key not in caplog.text and "<redacted>" in caplog.text


# --- 9. the client reads Retry-After as HTTP defines it --------------------------------------------


class Scripted(httpx.AsyncBaseTransport):
    """Answers each request with the next of `answers` (callables making a response), counting calls."""

    def __init__(self, *answers: Callable[[], httpx.Response]) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        return self.answers.pop(0)() if len(self.answers) > 1 else self.answers[0]()


def busy(retry_after: str) -> Callable[[], httpx.Response]:
    body = json.dumps({"type": "urn:idem-asgi:problem:request-in-progress", "status": 409}).encode()
    headers = [(b"content-type", b"application/problem+json"), (b"retry-after", retry_after.encode("latin-1"))]
    return lambda: httpx.Response(409, headers=headers, content=body)


@pytest.mark.parametrize("value", ["soon", "-1", "1.5", "\u00b2", "Mon, 99 Foo 2026 00:00:00 GMT", ""])
async def test_the_client_ignores_odd_retry_after_values(value: str) -> None:
    from idem_asgi.client import IdempotentRetryTransport

    inner = Scripted(busy(value), lambda: httpx.Response(201, content=b"ok"))
    transport = IdempotentRetryTransport(inner, backoff_base=0.01, backoff_cap=0.02)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        r = await c.post("/payments", content=b"{}")
    assert r.status_code == 201 and inner.calls == 2  # retried after a backoff, never a ValueError


async def test_the_client_honours_an_http_date_retry_after() -> None:
    import email.utils
    import time

    from idem_asgi.client import IdempotentRetryTransport

    when = email.utils.formatdate(time.time() + 1.2, usegmt=True)
    inner = Scripted(busy(when), lambda: httpx.Response(201, content=b"ok"))
    transport = IdempotentRetryTransport(inner, backoff_base=0.0, backoff_cap=0.0)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        started = time.monotonic()
        r = await c.post("/payments", content=b"{}")
        waited = time.monotonic() - started
    assert r.status_code == 201 and inner.calls == 2
    assert 0.1 < waited < 2.5  # the date, to its second


async def test_the_client_never_retries_a_replayed_answer() -> None:
    from idem_asgi.client import IdempotentRetryTransport, was_replayed

    stored = lambda: httpx.Response(503, headers={"Idempotent-Replayed": "true"}, content=b"stored 503")  # noqa: E731
    inner = Scripted(stored, lambda: httpx.Response(201))
    async with httpx.AsyncClient(
        transport=IdempotentRetryTransport(inner, backoff_base=0.01), base_url="http://t"
    ) as c:
        r = await c.post("/payments", content=b"{}")
    assert r.status_code == 503 and was_replayed(r) and inner.calls == 1


async def test_total_timeout_bounds_reading_the_final_body() -> None:
    import asyncio
    import time

    from idem_asgi.client import IdempotentRetryTransport

    class Stalls(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b"partial"
            await asyncio.sleep(30)
            yield b"never"

    inner = Scripted(lambda: httpx.Response(200, stream=Stalls()))
    transport = IdempotentRetryTransport(inner, total_timeout=0.5)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        started = time.monotonic()
        with pytest.raises(httpx.TimeoutException, match="total_timeout"):
            await c.post("/payments", content=b"{}")
    assert time.monotonic() - started < 2


# --- 10. CLI exit codes are consistent -------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.postgres
async def test_cli_exit_codes_are_the_same_for_bad_credentials_on_every_store(tmp_path: Any) -> None:
    import uuid

    import redis.asyncio as aioredis

    from idem_asgi.ops.cli import run
    from tests.support.servers import POSTGRES_DSN, redis_process, require

    require("postgres", POSTGRES_DSN)
    role = f"idem_cli_{uuid.uuid4().hex[:8]}"
    with redis_process(tmp_path / "redis") as server:
        admin = aioredis.Redis(port=server.port)
        await admin.execute_command("ACL", "SETUSER", "app", "on", ">right", "~*", "+@all")  # type: ignore[no-untyped-call]  # untyped in redis-py
        await admin.aclose()
        redis_code = await run(["--backend", f"redis://app:wrong@127.0.0.1:{server.port}/0", "inspect", "k"])
        redis_stale = await run(["--backend", f"redis://app:wrong@127.0.0.1:{server.port}/0", "stale"])
    no_role = POSTGRES_DSN.replace("postgres@", f"{role}@")  # a role that does not exist
    no_db = POSTGRES_DSN.rsplit("/", 1)[0] + "/no_such_database_idem"
    assert redis_code == redis_stale == 2
    assert await run(["--backend", no_role, "inspect", "k"]) == 2
    assert await run(["--backend", no_db, "stale"]) == 2


async def test_cli_refuses_a_non_utf8_key_and_a_negative_older_than(capsys: pytest.CaptureFixture[str]) -> None:
    from idem_asgi.ops.cli import run

    assert await run(["--backend", "memory://", "inspect", "caf\udce9"]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err
    assert await run(["--backend", "memory://", "stale", "--older-than", "-5"]) == 2
    assert "--older-than must be 0 or more" in capsys.readouterr().err
    assert await run(["--backend", "memory://", "reconcile", "--hook", "json:dumps", "--older-than", "-1"]) == 2


# --- 6. reconcile never resurrects -----------------------------------------------------------------


async def stuck(backend: Any, namespace: str, name: str, ttl: float = 600) -> Any:
    import asyncio

    from idem_asgi.records import Claimed, RecordKey

    key = RecordKey.build(namespace, None, name)
    claimed = await backend.claim(key, b"fp", lease=0.05, ttl=ttl)
    assert isinstance(claimed, Claimed)
    await asyncio.sleep(0.1)  # its holder is gone: the lease ended
    return key, claimed.token


async def test_reconcile_never_resurrects_a_claim_gone_since_the_listing(backend: Any, namespace: str) -> None:
    from idem_asgi.ops.reconcile import reconcile
    from idem_asgi.records import StoredResponse

    key, token = await stuck(backend, namespace, "gone-1")
    listed = await backend.stale(0, namespace=namespace)
    assert [s.key.digest for s in listed] == [key.digest]
    assert await backend.takeover(key, token, b"fp", lease=30, ttl=600) is not None  # someone resolves it ...
    taken = await backend.get(key)
    assert taken is not None
    assert await backend.release(key, taken.token)  # ... and releases it: the key is free again
    assert await backend.takeover(key, token, b"fp", lease=30, ttl=600) is None  # nothing taken, nothing created
    assert await backend.get(key) is None

    answer = StoredResponse(201, [], b"found at the provider")

    key2, _ = await stuck(backend, namespace, "gone-2")

    async def resolve(s: Any) -> Any:
        # The claim is released by someone else between the listing and our write.
        current = await backend.get(s.key)
        taken = await backend.takeover(s.key, current.token, b"fp", lease=30, ttl=600)
        await backend.release(s.key, (await backend.get(s.key)).token)
        assert taken is not None
        return answer

    report = await reconcile(backend, resolve, older_than=0, namespace=namespace)
    assert (report.completed, report.skipped) == (0, 1)
    assert "gone since it was listed" in report.items[0].detail
    assert await backend.get(key2) is None  # not resurrected as a completed record


async def test_two_concurrent_release_runs_count_one_release(backend: Any, namespace: str) -> None:
    import asyncio

    from idem_asgi.ops.reconcile import reconcile

    key, _ = await stuck(backend, namespace, "rel-1")
    listed = await backend.stale(0, namespace=namespace)
    gate = asyncio.Event()

    async def release_after_both_listed(s: StaleRecord) -> Literal["release"]:
        await gate.wait()
        return "release"

    runs = [asyncio.create_task(reconcile(backend, release_after_both_listed, older_than=0, namespace=namespace))]
    runs.append(asyncio.create_task(reconcile(backend, release_after_both_listed, older_than=0, namespace=namespace)))
    await asyncio.sleep(0.1)
    gate.set()
    first, second = await asyncio.gather(*runs)
    assert len(listed) == 1 and first.examined == second.examined == 1
    assert first.released + second.released == 1
    assert first.skipped + second.skipped == 1
    assert await backend.get(key) is None


async def test_reconcile_keeps_a_resolved_answer_for_the_records_own_ttl(backend: Any, namespace: str) -> None:
    import time

    from idem_asgi.ops.reconcile import reconcile
    from idem_asgi.records import COMPLETED, StoredResponse

    key, _ = await stuck(backend, namespace, "ttl-1", ttl=3 * 86_400)  # a route with a 3-day TTL
    report = await reconcile(backend, lambda s: StoredResponse(201, [], b"ok"), older_than=0, namespace=namespace)
    assert report.completed == 1
    record = await backend.get(key)
    assert record is not None and record.state == COMPLETED
    assert record.expires_at - time.time() > 2.9 * 86_400  # not a silent one day


@pytest.mark.postgres
async def test_the_cli_shows_the_postgres_checkpoint(namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    from idem_asgi.ops.cli import run
    from tests.support.servers import POSTGRES_DSN
    from tests.support.stores import make_backend

    pg = await make_backend("postgres")
    try:
        key, token = await stuck(pg, namespace, "cp-1")
        await pg.checkpoint("charged ch_123", key=key, token=token)
    finally:
        await pg.aclose()
    common = ["--backend", POSTGRES_DSN, "--table", "idem_test_records"]
    assert await run([*common, "inspect", "cp-1", "--namespace", namespace]) == 0
    assert "checkpoint charged ch_123" in capsys.readouterr().out
    assert await run([*common, "--json", "inspect", "cp-1", "--namespace", namespace]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == "charged ch_123"
    assert await run([*common, "stale", "--older-than", "0", "--namespace", namespace]) == 0
    assert "checkpoint 'charged ch_123'" in capsys.readouterr().out
    assert await run([*common, "--json", "stale", "--older-than", "0", "--namespace", namespace]) == 0
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"] == "charged ch_123" and doc["ttl"] == 600
