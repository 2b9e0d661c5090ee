"""`IdempotencyMiddleware(transform=...)`: answers are transformed on their way into the store and
back, on every store; with `EncryptBody` over Fernet no card number sits in the store in clear and
replays stay byte-identical."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from cryptography.fernet import Fernet

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http.problems import STORE_MISCONFIGURED
from idem_asgi.transform import EncryptBody, unseal
from tests.support.charges import post, rk
from tests.support.problems import assert_problem

CARD = b"4242424242424242"


class Charges:
    """Answers with the card number in its body and in a header."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        self.calls += 1
        body = b'{"card":"' + CARD + b'","charge":' + str(self.calls).encode() + b"}"
        headers = [(b"content-type", b"application/json"), (b"x-card", CARD)]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def protect(app: Any, backend: Backend, namespace: str, key: bytes) -> IdempotencyMiddleware:
    fernet = Fernet(key)
    return IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True)],
        transform=EncryptBody(fernet.encrypt, fernet.decrypt),
    )


async def test_no_card_data_at_rest_and_replays_are_byte_identical(backend: Backend, namespace: str) -> None:
    app = Charges()
    mw = protect(app, backend, namespace, Fernet.generate_key())
    key = uuid.uuid4().hex
    first = await post(mw, key=key)
    replay = await post(mw, key=key)
    assert first.status_code == 201 and replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content and CARD in first.content
    assert replay.headers["x-card"] == first.headers["x-card"] == CARD.decode()
    assert app.calls == 1
    record = await backend.get(rk(namespace, key))
    assert record is not None and record.response is not None
    stored = record.response
    assert CARD not in stored.body and all(CARD not in v for _, v in stored.headers)  # sealed, headers too
    assert stored.status == 201  # the status stays in clear for the ops tools


async def test_a_store_read_with_the_wrong_key_is_refused_never_run_again(backend: Backend, namespace: str) -> None:
    app = Charges()
    key = uuid.uuid4().hex
    assert (await post(protect(app, backend, namespace, Fernet.generate_key()), key=key)).status_code == 201
    other = await post(protect(app, backend, namespace, Fernet.generate_key()), key=key)  # a rotated-away key
    assert_problem(other, STORE_MISCONFIGURED)
    assert app.calls == 1


def test_a_transform_without_both_methods_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="store\\(response\\) and load\\(response\\)"):
        IdempotencyMiddleware(Charges(), routes=[], transform=object())  # type: ignore[arg-type]


async def test_reconciled_answers_go_through_the_same_transform(backend: Backend, namespace: str) -> None:
    from idem_asgi.ops.reconcile import reconcile
    from idem_asgi.records import Claimed, StoredResponse

    secret = Fernet.generate_key()
    fernet = Fernet(secret)
    key = uuid.uuid4().hex
    assert isinstance(await backend.claim(rk(namespace, key), b"fp", lease=0.05, ttl=600), Claimed)  # a dead holder
    found = StoredResponse(201, [(b"content-type", b"application/json")], b'{"card":"' + CARD + b'"}')
    await asyncio.sleep(0.15)
    report = await reconcile(
        backend,  # type: ignore[arg-type]
        lambda s: found,
        older_than=0,
        namespace=namespace,
        ttl=600,
        transform=EncryptBody(fernet.encrypt, fernet.decrypt),
    )
    assert report.completed == 1
    record = await backend.get(rk(namespace, key))
    assert record is not None and record.response is not None and CARD not in record.response.body
    assert record.response.sealed and unseal(EncryptBody(fernet.encrypt, fernet.decrypt), record.response) == found
