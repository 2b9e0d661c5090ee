"""`RoutePolicy(advertise_expiry=True)`: the first answer and every replay say until when the answer
is replayed (`Idempotency-Expires`, an HTTP-date), on every store; the stored answer never holds it."""

from __future__ import annotations

import time
import uuid
from email.utils import parsedate_to_datetime

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
