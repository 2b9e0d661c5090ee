"""`RoutePolicy(advertise_expiry=True)`: the first answer and every replay say until when the answer
is replayed (`Idempotency-Expires`, an HTTP-date), on every store; the stored answer never holds it,
and an answer that is not stored (released: 5xx, 429, 401) never advertises one."""

from __future__ import annotations

import time
import uuid
from email.utils import parsedate_to_datetime

import pytest

from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from tests.support.charges import Payments, post, protect, rk


def expires(r: object) -> float:
    value = r.headers["idempotency-expires"]  # type: ignore[attr-defined]
    return parsedate_to_datetime(value).timestamp()


async def test_first_answer_and_replays_carry_the_expiry(backend: Backend, namespace: str) -> None:
    mw = protect(Payments(), backend, namespace, ttl=600, advertise_expiry=True)
    key = uuid.uuid4().hex
    before = time.time()
    first = await post(mw, key=key)
    replay = await post(mw, key=key)
    assert first.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert before + 600 - 2 <= expires(first) <= time.time() + 600 + 1
    record = await backend.get(rk(namespace, key))
    assert record is not None and record.response is not None
    assert abs(expires(replay) - record.expires_at) < 1.5  # the store's own expiry (HTTP-dates are whole seconds)
    assert all(name != b"idempotency-expires" for name, _ in record.response.headers), "never stored"
    assert replay.content == first.content


async def test_routes_without_it_send_no_expiry(backend: Backend, namespace: str) -> None:
    mw = protect(Payments(), backend, namespace)
    key = uuid.uuid4().hex
    assert "idempotency-expires" not in (await post(mw, key=key)).headers
    assert "idempotency-expires" not in (await post(mw, key=key)).headers


class Answers:
    """POST /payments answering `status` (a transient or failure status: nothing is stored)."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        self.calls += 1
        await send({"type": "http.response.start", "status": self.status, "headers": [(b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": b"try again"})


@pytest.mark.parametrize("status", [503, 500, 429, 401])
async def test_an_answer_that_is_not_stored_advertises_no_expiry(backend: Backend, namespace: str, status: int) -> None:
    """A released answer leaves nothing to replay: telling the client until when it is kept would
    be telling it to keep a key the server forgot."""
    app = Answers(status)
    mw = protect(app, backend, namespace, ttl=600, advertise_expiry=True)
    key = uuid.uuid4().hex
    first = await post(mw, key=key)
    assert first.status_code == status and "idempotency-expires" not in first.headers
    assert await backend.get(rk(namespace, key)) is None  # released: nothing stored to expire
    again = await post(mw, key=key)
    assert again.status_code == status and "idempotency-expires" not in again.headers
    assert app.calls == 2
