"""`RoutePolicy(replay="current")`: a repeat of a completed key gets the current state of what the first
request made (a GET of its `Location` through the app, as the repeat's caller), under the first
answer's status; the stored answer when there is nothing to fetch or the fetch fails; never a second
run of the operation. On memory, Redis and Postgres."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi.backends import Backend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http import current

pytestmark = pytest.mark.asyncio
ALICE = {"authorization": "Bearer alice"}


class Shop:
    """Payments an operator can capture or delete later; GET needs the caller's own credentials."""

    def __init__(self, *, location: bool = True) -> None:
        self.payments: dict[str, dict[str, Any]] = {}
        self.runs = 0
        self.reads: Counter[str] = Counter()
        self.read_headers: list[dict[str, str]] = []
        self.claimed_during_read: list[bool] = []
        self.read_fails: type[Exception] | None = None
        self.read_hangs = False
        self.read_status = 200
        self.ids = itertools.count(1)
        self.location = location

    async def create(self, request: Request) -> Response:
        self.runs += 1
        await request.body()
        pid = f"pay_{next(self.ids)}"
        self.payments[pid] = {"id": pid, "owner": request.headers["authorization"], "status": "pending"}
        headers = {"location": f"/payments/{pid}"} if self.location else {}
        return JSONResponse(self.payments[pid], status_code=201, headers=headers)

    async def read(self, request: Request) -> Response:
        pid = request.path_params["pid"]
        self.reads[pid] += 1
        self.read_headers.append(dict(request.headers))
        self.claimed_during_read.append(current_idempotency() is not None)
        if self.read_fails is not None:
            raise self.read_fails("the read model is down")
        if self.read_hangs:
            await asyncio.sleep(3600)
        payment = self.payments.get(pid)
        if payment is None:
            return JSONResponse({"error": "gone"}, status_code=404)
        if payment["owner"] != request.headers.get("authorization"):
            return JSONResponse({"error": "not yours"}, status_code=403)
        return JSONResponse(payment, status_code=self.read_status, headers={"etag": f'"{payment["status"]}"'})

    def app(self, backend: Backend, namespace: str, **policy: Any) -> IdempotencyMiddleware:
        inner = Starlette(
            routes=[
                Route("/payments", self.create, methods=["POST"]),
                Route("/payments/{pid}", self.read, methods=["GET"]),
            ]
        )
        route = RoutePolicy("/payments", scope=lambda scope: _caller(scope), replay="current", **policy)
        return IdempotencyMiddleware(inner, backend=backend, routes=[route], namespace=namespace)


def _caller(scope: Any) -> str | None:
    return dict(scope["headers"]).get(b"authorization", b"").decode() or None


async def pay(app: Any, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        sent = {**ALICE, "idempotency-key": key, **(headers or {})}
        return await client.post("/payments", content=b'{"amount": 10}', headers=sent)


async def test_a_repeat_gets_the_current_state_under_the_first_status(backend: Backend, namespace: str) -> None:
    shop = Shop()
    app = shop.app(backend, namespace)
    key = uuid.uuid4().hex
    first = await pay(app, key, {"content-type": "application/json"})
    assert first.status_code == 201 and first.json()["status"] == "pending"
    shop.payments["pay_1"]["status"] = "captured"  # what happened to it since
    again = await pay(app, key, {"content-type": "application/json"})
    assert again.status_code == 201 and again.json() == {"id": "pay_1", "owner": "Bearer alice", "status": "captured"}
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotent-replay-source"] == "current"
    assert again.headers["location"] == "/payments/pay_1" == again.headers["content-location"]
    assert again.headers["etag"] == '"captured"' and again.headers["content-type"] == "application/json"
    assert int(again.headers["content-length"]) == len(again.content)
    assert shop.runs == 1 and shop.reads["pay_1"] == 1
    seen = shop.read_headers[0]
    assert seen["authorization"] == "Bearer alice", "the GET carries the repeat's credentials"
    assert "idempotency-key" not in seen and "content-type" not in seen and seen.get("content-length") in (None, "0")
    assert shop.claimed_during_read == [False], "the GET runs under no claim"


async def test_a_storm_of_repeats_runs_the_operation_once_and_each_gets_the_current_state(
    backend: Backend, namespace: str
) -> None:
    shop = Shop()
    app = shop.app(backend, namespace)
    key = uuid.uuid4().hex
    answers = await asyncio.gather(*(pay(app, key) for _ in range(40)))
    assert shop.runs == 1
    shop.payments["pay_1"]["status"] = "refunded"
    repeats = await asyncio.gather(*(pay(app, key) for _ in range(40)))
    assert {(r.status_code, r.json()["status"], r.headers["idempotent-replay-source"]) for r in repeats} == {
        (201, "refunded", "current")
    }
    assert shop.runs == 1 and shop.reads["pay_1"] >= 40
    assert all(a.status_code in (201, 409) for a in answers)


@pytest.mark.parametrize("fault", ["gone", "raises", "500", "hangs", "another caller", "too big"])
async def test_when_the_current_state_cannot_be_had_the_stored_answer_is_replayed(
    backend: Backend, namespace: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gone (404), the read failing, hanging past the timeout, the caller not allowed to read it, or a
    representation over `max_stored_body`: the repeat gets the first answer byte for byte, marked
    `stored`, and the operation never runs again."""
    shop = Shop()
    app = shop.app(backend, namespace, max_stored_body=200 if fault == "too big" else 1 << 20)
    key = uuid.uuid4().hex
    first = await pay(app, key)
    if fault == "gone":
        del shop.payments["pay_1"]
    elif fault == "raises":
        shop.read_fails = RuntimeError
    elif fault == "500":
        shop.read_status = 500
    elif fault == "hangs":
        shop.read_hangs = True
        monkeypatch.setattr(current, "FETCH_TIMEOUT", 0.3)
    elif fault == "another caller":
        shop.payments["pay_1"]["owner"] = "Bearer mallory"
    else:
        shop.payments["pay_1"]["note"] = "x" * 400
    again = await pay(app, key)
    assert (again.status_code, again.content) == (201, first.content)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["idempotent-replay-source"] == "stored"
    assert shop.runs == 1 and shop.reads["pay_1"] == 1


async def test_without_a_location_the_stored_answer_is_replayed_and_locate_finds_it_elsewhere(
    backend: Backend, namespace: str
) -> None:
    shop = Shop(location=False)
    plain = shop.app(backend, namespace)
    key = uuid.uuid4().hex
    first = await pay(plain, key)
    again = await pay(plain, key)
    assert (again.content, again.headers["idempotent-replay-source"]) == (first.content, "stored")
    assert shop.reads == Counter()

    import json

    def by_id(answer: Any) -> str:
        return "/payments/" + str(json.loads(answer.body)["id"])

    located = shop.app(backend, namespace + "-located", locate=by_id)
    key = uuid.uuid4().hex
    made = await pay(located, key)
    shop.payments[made.json()["id"]]["status"] = "captured"
    again = await pay(located, key)
    assert again.json()["status"] == "captured" and again.headers["content-location"] == by_id(
        type("A", (), {"body": made.content})()
    )
    assert shop.runs == 2


async def test_a_location_on_another_host_is_not_fetched(backend: Backend, namespace: str) -> None:
    shop = Shop()
    app = shop.app(backend, namespace, locate=lambda answer: "https://elsewhere.example/payments/pay_1")
    key = uuid.uuid4().hex
    first = await pay(app, key)
    again = await pay(app, key)
    assert (again.content, again.headers["idempotent-replay-source"]) == (first.content, "stored")
    assert shop.reads == Counter()
    same_host = shop.app(backend, namespace + "-abs", locate=lambda answer: "http://shop.test/payments/pay_2")
    key = uuid.uuid4().hex
    await pay(same_host, key)
    again = await pay(same_host, key)
    assert again.headers["idempotent-replay-source"] == "current" and shop.reads["pay_2"] == 1


async def test_a_first_answer_that_is_not_a_2xx_is_replayed_as_stored(backend: Backend, namespace: str) -> None:
    async def declined(request: Request) -> Response:
        return JSONResponse({"error": "card declined"}, status_code=402, headers={"location": "/payments/pay_9"})

    reads: list[str] = []

    async def read(request: Request) -> Response:
        reads.append(request.url.path)
        return JSONResponse({})

    inner = Starlette(routes=[Route("/payments", declined, methods=["POST"]), Route("/payments/{p}", read)])
    route = RoutePolicy("/payments", single_tenant=True, replay="current")
    app = IdempotencyMiddleware(inner, backend=backend, routes=[route], namespace=namespace)
    key = uuid.uuid4().hex
    first, again = await pay(app, key), await pay(app, key)
    assert (again.status_code, again.content) == (402, first.content) and reads == []


async def test_replay_and_locate_are_checked_when_the_middleware_is_built() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="replay must be 'stored' or 'current'"):
        IdempotencyMiddleware(app, routes=[RoutePolicy("/p", single_tenant=True, replay="latest")])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="locate= is for replay='current' routes"):
        IdempotencyMiddleware(app, routes=[RoutePolicy("/p", single_tenant=True, locate=lambda a: "/x")])


async def test_the_get_gets_a_decoded_path_and_no_hidden_send_extensions(backend: Backend, namespace: str) -> None:
    """`Location: /files/a%20b` is GET `/files/a b` (raw_path as sent), and the GET, like the app's own
    run, never gets `pathsend`: every body byte must pass through the middleware's `send`."""
    seen: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        if scope["method"] == "GET":
            seen.append(scope)
            body, status, headers = b'{"state":"now"}', 200, []
        else:
            body, status, headers = b'{"state":"then"}', 201, [(b"location", b"/files/a%20b")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    route = RoutePolicy("/files", single_tenant=True, replay="current")
    mw = IdempotencyMiddleware(app, backend=backend, routes=[route], namespace=namespace)
    key = uuid.uuid4().hex

    async def post() -> tuple[int, bytes, dict[bytes, bytes]]:
        sent: list[Any] = []
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/files", "raw_path": b"/files", "query_string": b"", "root_path": "",
            "headers": [(b"host", b"shop.test"), (b"idempotency-key", key.encode())],
            "extensions": {"http.response.pathsend": {}},
        }  # fmt: skip
        messages = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

        async def receive() -> Any:
            return next(messages, {"type": "http.disconnect"})

        async def send(message: Any) -> None:
            sent.append(message)

        await mw(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), dict(sent[0]["headers"])

    await post()
    status, body, headers = await post()
    assert (status, body, headers[b"idempotent-replay-source"]) == (201, b'{"state":"now"}', b"current")
    (get,) = seen
    assert get["path"] == "/files/a b" and get["raw_path"] == b"/files/a%20b"
    assert "http.response.pathsend" not in get.get("extensions", {})
