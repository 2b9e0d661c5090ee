"""idem_asgi.testing: the storm passes on a correct app, fails loudly on a broken one, and works as a plugin."""
# No `from __future__ import annotations` here: FastAPI reads handler annotations at run time.

import asyncio
import functools
import importlib.metadata
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import ASGIApp, Message, Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.http.request import Protected
from idem_asgi.records import Claimed, RecordKey, StoredResponse
from idem_asgi.testing import FAULTS, find_middleware, storm

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.memory

ROUTES = [RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True)]


def payments_app(charges: Counter[str], *, middleware: Callable[..., Any] | None = None, **options: Any) -> Any:
    """A FastAPI payments endpoint counting its executions per key, behind `middleware`."""
    from fastapi import FastAPI, Request

    app = FastAPI()
    if middleware is None:
        app.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=ROUTES, **options)
    else:
        app.add_middleware(middleware, **options)

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict[str, Any]:
        key = request.headers["idempotency-key"]
        charges[key] += 1
        await asyncio.sleep(0.001)  # the call to the card network
        return {"key": key, "charge": f"ch_{charges.total()}", "amount": (await request.json())["amount"]}

    return app


class CheckThenSet:
    """The naive idempotency layer the contract exists to stop: GET "seen?", run, then SET.

    With `atomic=True` a lock makes it race-free, but it still ignores the body (no fingerprint)
    and, with `tamper=True`, replays a body that is not the first answer's.
    """

    def __init__(self, app: ASGIApp, *, atomic: bool = False, tamper: bool = False) -> None:
        self.app = app
        self.seen: dict[bytes, tuple[int, list[tuple[bytes, bytes]], bytes]] = {}
        self.lock = asyncio.Lock() if atomic else None
        self.tamper = tamper

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = dict(scope.get("headers", ())).get(b"idempotency-key")
        if scope["type"] != "http" or key is None:
            await self.app(scope, receive, send)
        elif self.lock is not None:
            async with self.lock:
                await self._handle(key, scope, receive, send)
        else:
            await self._handle(key, scope, receive, send)

    async def _handle(self, key: bytes, scope: Scope, receive: Receive, send: Send) -> None:
        await asyncio.sleep(0)  # GET: a round trip to the store
        if key in self.seen:
            status, headers, body = self.seen[key]
            body = body + b" " if self.tamper else body
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [*headers, (b"idempotent-replayed", b"true")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        start: Message = {}
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, capture)
        await asyncio.sleep(0)  # SET: another round trip
        self.seen[key] = (start["status"], list(start.get("headers", [])), b"".join(chunks))


async def test_correct_fastapi_app_passes_every_fault(caplog: pytest.LogCaptureFixture) -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges)
    report = await storm(app, path="/payments", json={"amount": 1230}, key="pay-ok", probe=lambda: charges.total())
    report.assert_ok()
    assert "could not store" not in caplog.text  # the injected failure's expected complaint is filtered out
    assert [k.scenario for k in report.keys] == ["storm", *FAULTS]
    assert report.executions == {"pay-ok": 1, **{f"pay-ok-{f}": 1 for f in FAULTS}}
    labels = Counter(a.label for a in report["storm"].answers)
    assert labels["201"] == 1 and labels["422 fingerprint-mismatch"] == 1
    assert labels["201-replay"] + labels["409 request-in-progress"] == 54
    assert labels["409 request-in-progress"] > 0  # the 50 requests really overlapped
    assert {a.label for a in report["store_fails_after_claim"].answers} == {"201", "409 request-in-progress"}
    assert report["cancel_first"].answers[0].label == "cancelled"  # mid-handler, after it counted
    assert "contract held" in str(report)


@pytest.mark.parametrize("kind", ["mapping", "callable-mapping", "async-int"])
async def test_probe_forms(kind: str) -> None:
    charges: Counter[str] = Counter()

    async def total() -> int:
        return charges.total()

    probes: dict[str, Any] = {"mapping": charges, "callable-mapping": lambda: charges, "async-int": total}
    report = await storm(payments_app(charges), json={"amount": 5}, concurrency=10, repeats=2, probe=probes[kind])
    report.assert_ok()
    assert set(report.executions.values()) == {1}


async def test_check_then_set_app_fails_naming_key_and_count() -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges, middleware=CheckThenSet)
    report = await storm(
        app, json={"amount": 1}, key="broken-1", concurrency=2, repeats=1, faults=(), probe=lambda: charges.total()
    )
    assert charges["broken-1"] == 2
    with pytest.raises(AssertionError, match=r"key broken-1: handler ran 2 times \(expected 1\); answers: 201 x2"):
        report.assert_ok()


async def test_check_then_set_app_fails_every_scenario_it_cannot_survive() -> None:
    charges: Counter[str] = Counter()
    report = await storm(
        payments_app(charges, middleware=CheckThenSet), json={"amount": 1}, key="broken-2", probe=charges
    )
    assert not report.ok
    message = str(report)
    # The handler counted before it read (and failed on) the half-arrived body.
    assert "the handler ran 1 time for the request whose client left mid-body" in message
    # A cancelled request never reached SET: its retry ran the handler again.
    assert "key broken-2-cancel_first: handler ran 2 times (expected 1)" in message
    assert "could not inject the store failure: no IdempotencyMiddleware found in the app" in message
    assert "no IdempotencyMiddleware was found in the app" in message  # the hint
    with pytest.raises(AssertionError, match=r"(?s)key broken-2: handler ran \d+ times \(expected 1\).*cancel_first"):
        report.assert_ok()


async def test_replay_that_differs_and_ignored_body_are_reported() -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges, middleware=CheckThenSet, atomic=True, tamper=True)
    report = await storm(app, json={"amount": 1}, key="tampered", concurrency=5, repeats=1, faults=(), probe=charges)
    assert report["tampered"].executions == 1
    with pytest.raises(AssertionError) as failed:
        report.assert_ok()
    assert "key tampered: handler ran 1 time (expected 1)" in str(failed.value)
    assert "replay is not byte-identical to the first answer: body" in str(failed.value)
    assert "mismatch requests got 201-replay x1; expected 422 fingerprint-mismatch" in str(failed.value)


async def test_an_exception_from_the_middleware_itself_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    charges: Counter[str] = Counter()
    inner = payments_app(charges, middleware=lambda app: app)  # bare FastAPI app; we wrap it ourselves
    mw = IdempotencyMiddleware(inner, backend=MemoryBackend(), routes=ROUTES)

    async def broken_replay(*args: Any) -> None:
        raise RuntimeError("replay exploded")

    monkeypatch.setattr(Protected, "_replay", broken_replay)
    report = await storm(mw, json={"amount": 1}, key="mw500", concurrency=3, repeats=1, faults=(), probe=charges)
    with pytest.raises(AssertionError, match=r"idem_asgi itself raised RuntimeError\('replay exploded'\)"):
        report.assert_ok()


async def test_a_handler_failing_before_its_effect_is_the_apps_error_and_its_retries_may_run() -> None:
    from fastapi import FastAPI

    attempts = charged = 0
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=ROUTES)

    @app.post("/payments")
    async def pay() -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("card network refused the connection")  # before any charge

    report = await storm(app, json={}, concurrency=5, repeats=2, probe=lambda: charged)
    report.assert_ok()  # released after each failure, so a retry runs again: the contract holds
    assert attempts > 5 and all(a.kind in ("failed", "problem", "none") for k in report.keys for a in k.answers)
    assert "the app itself failed" in report["storm"].explain()


def charging_then_500(*, mark: bool) -> tuple[Any, Counter[str]]:
    """A FastAPI endpoint that charges, then answers 500 (its ledger write failed), optionally marking the effect."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    charges: Counter[str] = Counter()
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(), routes=ROUTES)

    @app.post("/payments")
    async def pay(request: Request) -> JSONResponse:
        charges[request.headers["idempotency-key"]] += 1
        if mark:
            request.state.idempotency.mark_effect()
        return JSONResponse({"error": "ledger unavailable"}, status_code=500)

    return app, charges


async def test_an_app_that_charges_and_then_answers_500_fails_the_storm() -> None:
    app, charges = charging_then_500(mark=False)
    report = await storm(app, json={"amount": 1}, key="c500", probe=charges)
    assert not report.ok
    assert max(charges.values()) > 1  # the middleware released after each 500: the retries charged again
    message = str(report)
    assert "handler ran 6 times for one key; the contract allows 1" in message
    assert "mark_effect()" in message
    marked, marked_charges = charging_then_500(mark=True)
    fixed = await storm(marked, json={"amount": 1}, key="c500m", probe=marked_charges)
    fixed.assert_ok()  # the effect is marked: every key charged once, the rest is outcome-unknown
    assert set(marked_charges.values()) == {1}
    assert "409 outcome-unknown" in fixed["storm"].answer_summary()


class UnlocksBeforeStoring(MemoryBackend):
    """A store whose completion frees the key first and writes the answer one round trip later."""

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        if not await self.release(key, token):
            return False
        await asyncio.sleep(0.02)  # writing the answer takes a round trip: the key is free meanwhile
        claimed = await self.claim(key, b"", lease=1, ttl=ttl)
        return isinstance(claimed, Claimed) and await super().complete(key, claimed.token, response, ttl=ttl)


class NeverReleases(MemoryBackend):
    """A store whose release says yes and keeps the claim (409 forever after any failure)."""

    async def release(self, key: RecordKey, token: int) -> bool:
        return True


async def test_a_store_that_unlocks_before_the_answer_is_stored_fails_the_storm() -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges, middleware=IdempotencyMiddleware, backend=UnlocksBeforeStoring(), routes=ROUTES)
    report = await storm(app, json={"amount": 1}, key="unl", probe=charges)
    assert not report.ok
    during = report["retry_during_write"]
    assert during.executions > 1 and not during.ok
    assert "the key stays held until its answer is stored" in during.explain()


async def test_a_store_that_never_releases_after_a_failure_fails_the_storm() -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges, middleware=IdempotencyMiddleware, backend=NeverReleases(), routes=ROUTES)
    report = await storm(app, json={"amount": 1}, key="nrl", probe=charges)
    assert not report.ok
    failing = report["app_fails_before_effect"]
    assert "the key must be released so the retry runs" in failing.explain()
    assert failing.answers[1].label == "409 request-in-progress"


async def test_a_layer_that_frees_the_key_when_the_client_is_gone_fails_response_lost() -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges, middleware=CheckThenSet, atomic=True)  # an exception from send skips its SET
    report = await storm(app, json={"amount": 1}, key="lost", faults=("response_lost",), probe=charges)
    lost = report["response_lost"]
    assert not lost.ok and lost.executions == 2
    assert lost.answers[0].label == "raised OSError (lost)"


async def test_a_per_process_store_fails_the_storm_at_several_workers() -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges)
    one = await storm(app, json={"amount": 1}, faults=(), probe=charges)
    one.assert_ok()
    assert any("MemoryBackend" in h for h in one.hints)
    several = await storm(app, json={"amount": 1}, faults=(), probe=charges, workers=4)
    assert not several.ok and "at 4 workers a retry that reaches another worker runs again" in str(several)
    with pytest.raises(AssertionError, match="MemoryBackend"):
        several.assert_ok()


async def test_store_failure_injected_through_backend_when_middleware_is_hidden() -> None:
    charges: Counter[str] = Counter()
    inner = payments_app(charges, middleware=lambda app: app)
    store = MemoryBackend()
    mw = IdempotencyMiddleware(inner, backend=store, routes=ROUTES)
    hidden = functools.partial(_forward, mw)  # the walk cannot see through a partial
    assert find_middleware(hidden) == []
    report = await storm(
        hidden,
        json={"amount": 1},
        concurrency=5,
        repeats=2,
        faults=("store_fails_after_claim",),
        backend=store,
        probe=charges,
    )
    report.assert_ok()
    assert [a.label for a in report["store_fails_after_claim"].answers] == ["201", *["409 request-in-progress"] * 2]
    assert "complete" not in vars(store)  # restored
    # Pointing at the middleware explicitly works too.
    again = await storm(
        hidden,
        json={"amount": 2},
        concurrency=5,
        repeats=2,
        faults=("store_fails_after_claim",),
        middleware=mw,
        probe=charges,
    )
    again.assert_ok()
    assert mw.backend is store


async def _forward(mw: IdempotencyMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
    await mw(scope, receive, send)


async def test_a_hung_handler_is_reported_and_leaves_no_task_behind() -> None:
    runs = 0

    async def hangs(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal runs
        while (await receive()).get("more_body", False):
            pass
        runs += 1
        await asyncio.sleep(3600)

    app = IdempotencyMiddleware(hangs, backend=MemoryBackend(), routes=ROUTES)
    report = await storm(
        app, concurrency=3, repeats=1, faults=("response_lost",), request_timeout=0.2, probe=lambda: runs
    )
    with pytest.raises(AssertionError, match=r"1 request \(concurrent\) got no answer within 0.2s: hung"):
        report.assert_ok()
    assert "1 request (lost) got no answer within 0.2s" in str(report)
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_unknown_fault_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        await storm(payments_app(Counter()), faults=("meteor",), probe=lambda: 0)


async def _post_twice(app: Any) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return [
            await client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "same"}) for _ in range(2)
        ]


async def test_disable_switch_lets_every_request_run(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("IDEM_ASGI_DISABLED", "1")
    charges: Counter[str] = Counter()
    with caplog.at_level(logging.WARNING, logger="idem_asgi"):
        first, second = await _post_twice(payments_app(charges))  # FastAPI builds the middleware here
    assert first.status_code == second.status_code == 201
    assert "idempotent-replayed" not in second.headers and first.content != second.content
    assert charges["same"] == 2
    assert "IDEM_ASGI_DISABLED is set" in caplog.text
    # The storm notices, and says why.
    report = await storm(payments_app(charges), json={"amount": 1}, concurrency=3, repeats=1, faults=(), probe=charges)
    with pytest.raises(AssertionError, match="IDEM_ASGI_DISABLED is set in this process"):
        report.assert_ok()


async def test_disabled_middleware_still_hands_the_key_to_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi import FastAPI, Request

    from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency

    monkeypatch.setenv("IDEM_ASGI_DISABLED", "1")
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, routes=[RoutePolicy("/payments", single_tenant=True)])
    seen: list[tuple[str, str | None]] = []

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict[str, str]:
        info = current_idempotency()
        seen.append((request.state.idempotency.key, info.key if info else None))
        return {}

    await _post_twice(app)
    assert seen == [("same", "same"), ("same", "same")]


async def test_switch_is_read_when_the_middleware_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    charges: Counter[str] = Counter()
    app = payments_app(charges)
    await _post_twice(app)  # builds the stack with idempotency on
    monkeypatch.setenv("IDEM_ASGI_DISABLED", "1")
    await _post_twice(app)
    assert charges["same"] == 1
    monkeypatch.setenv("IDEM_ASGI_DISABLED", "0")
    await _post_twice(payments_app(charges))  # a fresh app and store: runs once, then replays
    assert charges["same"] == 2  # "0" does not disable


USER_TEST = """
from collections import Counter

import httpx
import pytest
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import MemoryBackend
from idem_asgi.records import Claimed, RecordKey, StoredResponse

charges = Counter()


def make_app():
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, backend=MemoryBackend(),
                       routes=[RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True)])

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict:
        charges[request.headers["idempotency-key"]] += 1
        return {"charged": (await request.json())["amount"]}

    return app


@pytest.mark.asyncio
async def test_payment_runs_once(idem_storm):
    report = await idem_storm(make_app(), path="/payments", json={"amount": 1230}, probe=charges)
    report.assert_ok()


@pytest.mark.asyncio
async def test_unrelated_test_without_idempotency(idem_disabled):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make_app()), base_url="http://t") as client:
        for _ in range(2):
            await client.post("/payments", json={"amount": 1}, headers={"Idempotency-Key": "same"})
    assert charges["same"] == 2
"""


def _plugin_args() -> tuple[str, ...]:
    """`-p idem_asgi.testing` unless the installed entry point already loads it (pytest refuses both)."""
    installed = any(ep.value == "idem_asgi.testing" for ep in importlib.metadata.entry_points(group="pytest11"))
    return () if installed else ("-p", "idem_asgi.testing")


def test_fixtures_work_from_a_users_test_file(pytester: pytest.Pytester) -> None:
    """One subprocess (plugins autoload as in a user's run): two passing tests and one readable failure."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_user_payments=USER_TEST + FORGOT_THE_MIDDLEWARE)
    result = pytester.runpytest_subprocess(*_plugin_args(), "-W", "error")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*key storm-*: handler ran 4 times (expected 1); answers: 201 x4",
            "*no IdempotencyMiddleware was found in the app*",
        ]
    )
    assert "test_forgot_the_middleware" in result.stdout.str()


FORGOT_THE_MIDDLEWARE = """

unprotected = FastAPI()  # no IdempotencyMiddleware: every retry charges again
unprotected_charges = []


@unprotected.post("/payments", status_code=201)
async def pay_unprotected() -> dict:
    unprotected_charges.append(1)
    return {"charge": len(unprotected_charges)}


@pytest.mark.asyncio
async def test_forgot_the_middleware(idem_storm):
    report = await idem_storm(unprotected, json={}, concurrency=3, repeats=1, mismatch=False, faults=(),
                              probe=lambda: len(unprotected_charges))
    report.assert_ok()
"""
