"""Turning `transform=EncryptBody(...)` on, rotating its key and turning it off are ordinary deploys, on
every store: a record says whether its answer was sealed, so an answer stored before the transform
replays as it was stored, an old key stays readable, and a sealed answer the app can no longer open
is refused (500 `store-misconfigured`), never run again."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet, MultiFernet

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend
from idem_asgi.http.problems import STORE_MISCONFIGURED
from idem_asgi.records import StoredResponse
from idem_asgi.transform import AnswerTransform, EncryptBody
from tests.support.charges import KEY, LEASE, Payments, crash_first_request, post, rk
from tests.support.problems import assert_problem
from tests.test_transform import CARD, Charges


def deploy(
    app: Any, backend: Backend, namespace: str, transform: AnswerTransform | None, **policy: Any
) -> IdempotencyMiddleware:
    """One release of the app: the same route and store, this release's transform."""
    return IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True, **policy)],
        transform=transform,
    )


def sealing(key: bytes) -> EncryptBody:
    fernet = Fernet(key)
    return EncryptBody(fernet.encrypt, fernet.decrypt)


def assert_replay_of(replay: httpx.Response, first: httpx.Response) -> None:
    assert replay.status_code == first.status_code == 201, replay.text
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == first.content
    assert [(k, v) for k, v in replay.headers.items() if k != "idempotent-replayed"] == list(first.headers.items())


async def sealed_flag(backend: Backend, namespace: str, key: str) -> bool:
    record = await backend.get(rk(namespace, key))
    assert record is not None and record.response is not None
    return record.response.sealed


async def test_answers_stored_before_encryption_was_turned_on_replay_as_stored(
    backend: Backend, namespace: str
) -> None:
    app = Charges()
    key = uuid.uuid4().hex
    first = await post(deploy(app, backend, namespace, None), key=key)
    assert first.status_code == 201 and not await sealed_flag(backend, namespace, key)
    encrypted = deploy(app, backend, namespace, sealing(Fernet.generate_key()))  # the next deploy
    assert_replay_of(await post(encrypted, key=key), first)
    assert app.calls == 1
    fresh = uuid.uuid4().hex  # and what it stores now is sealed
    assert (await post(encrypted, key=fresh)).status_code == 201 and await sealed_flag(backend, namespace, fresh)
    assert app.calls == 2


@pytest.mark.parametrize("form", ["list of decrypters", "MultiFernet"])
async def test_a_rotated_key_still_opens_answers_sealed_under_the_old_one(
    backend: Backend, namespace: str, form: str
) -> None:
    app = Charges()
    old, new = Fernet(Fernet.generate_key()), Fernet(Fernet.generate_key())
    before, after = uuid.uuid4().hex, uuid.uuid4().hex
    first = await post(deploy(app, backend, namespace, EncryptBody(old.encrypt, old.decrypt)), key=before)
    rotated = (
        EncryptBody(new.encrypt, [new.decrypt, old.decrypt])  # newest first
        if form == "list of decrypters"
        else EncryptBody(MultiFernet([new, old]).encrypt, MultiFernet([new, old]).decrypt)
    )
    mw = deploy(app, backend, namespace, rotated)
    assert_replay_of(await post(mw, key=before), first)
    second = await post(mw, key=after)
    assert second.status_code == 201 and app.calls == 2
    record = await backend.get(rk(namespace, after))
    assert record is not None and record.response is not None
    assert new.decrypt(record.response.body)  # sealed under the new key
    assert_replay_of(await post(mw, key=after), second)
    assert app.calls == 2


async def test_turning_encryption_off_opens_sealed_answers_and_stores_new_ones_in_clear(
    backend: Backend, namespace: str
) -> None:
    """The documented way off: a release with `EncryptBody(None, decrypt)` (open, never seal) for one TTL."""
    app = Charges()
    fernet = Fernet(Fernet.generate_key())
    sealed_key, clear_key = uuid.uuid4().hex, uuid.uuid4().hex
    first = await post(deploy(app, backend, namespace, EncryptBody(fernet.encrypt, fernet.decrypt)), key=sealed_key)
    opening = deploy(app, backend, namespace, EncryptBody(None, fernet.decrypt))
    assert_replay_of(await post(opening, key=sealed_key), first)
    plain = await post(opening, key=clear_key)
    assert plain.status_code == 201 and not await sealed_flag(backend, namespace, clear_key)
    record = await backend.get(rk(namespace, clear_key))
    assert record is not None and record.response is not None and CARD in record.response.body  # in clear now
    without = deploy(app, backend, namespace, None)  # the release after: no transform at all
    assert_replay_of(await post(without, key=clear_key), plain)
    assert app.calls == 2


async def test_a_sealed_answer_an_app_without_its_transform_cannot_open_is_refused_never_run_again(
    backend: Backend, namespace: str
) -> None:
    app = Charges()
    key = uuid.uuid4().hex
    assert (await post(deploy(app, backend, namespace, sealing(Fernet.generate_key())), key=key)).status_code == 201
    refused = await post(deploy(app, backend, namespace, None), key=key)  # encryption dropped too early
    assert_problem(refused, STORE_MISCONFIGURED)
    assert CARD not in refused.content and app.calls == 1


@pytest.mark.parametrize("sealed", [False, True], ids=["reconciled in clear", "reconciled sealed"])
async def test_reconciled_answers_carry_the_marker_and_replay_under_the_apps_transform(
    backend: Backend, namespace: str, sealed: bool
) -> None:
    """`reconcile` with the app's transform seals what it stores; without one it stores the answer in clear,
    marked so: the app, which seals, replays both (it was 500 `store-misconfigured` for the clear one)."""
    from idem_asgi.ops.reconcile import reconcile

    app = Payments(hang_first=True)
    transform = sealing(Fernet.generate_key())
    mw = deploy(app, backend, namespace, transform, lease=LEASE)
    await crash_first_request(mw, app)  # the holder died mid-operation: a stale claim
    found = StoredResponse(201, [(b"content-type", b"application/json")], b'{"charge":"ch_found"}')
    resolve: Callable[[Any], StoredResponse] = lambda s: found  # noqa: E731
    options: dict[str, Any] = {"transform": transform} if sealed else {}
    report = await reconcile(backend, resolve, older_than=0, namespace=namespace, ttl=600, **options)  # type: ignore[arg-type]
    assert report.completed == 1
    assert await sealed_flag(backend, namespace, KEY) is sealed
    replay = await post(mw)
    assert replay.status_code == 201 and replay.headers["idempotent-replayed"] == "true", replay.text
    assert replay.content == found.body and app.calls == 1
