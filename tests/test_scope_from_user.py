"""`scope_from_user()`: the common shapes of an authenticated user name one stable scope, in the
documented order; behind Starlette's own `AuthenticationMiddleware`, on every store."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import httpx
import pytest
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser, SimpleUser
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection

from idem_asgi import IdempotencyMiddleware, RoutePolicy, scope_from_user
from idem_asgi.backends import Backend
from idem_asgi.http.problems import SCOPE_REQUIRED
from tests.support.charges import Payments
from tests.support.problems import assert_problem

USER_ID = uuid.UUID("6f1c1b1e-0c1f-4a53-9a53-4f3a2a9e1c07")


class OlderSimpleUser(BaseUser):
    """Starlette's `SimpleUser` before it defined `identity`: `BaseUser.identity` raises."""

    def __init__(self, username: str) -> None:
        self.username = username

    @property
    def is_authenticated(self) -> bool:
        return True

    @property
    def display_name(self) -> str:
        return self.username


class AccountUser(BaseUser):
    """An app's own user: a UUID primary key, no `username`, `identity` left to the base class."""

    def __init__(self, id: uuid.UUID) -> None:
        self.id = id

    @property
    def is_authenticated(self) -> bool:
        return True


class Obj:
    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


class Raises:
    @property
    def identity(self) -> str:
        raise NotImplementedError

    username = "ann"


SHAPES: list[tuple[str, Any, str | None]] = [
    ("a user name", "ann", "ann"),
    ("an int id", 42, "42"),
    ("a UUID", USER_ID, str(USER_ID)),
    ("identity", Obj(identity="u-1", id=9), "u-1"),
    ("identity raising NotImplementedError", Raises(), "ann"),
    ("id, an int", Obj(id=7, username="ann"), "7"),
    ("id, a str", Obj(id="usr_7"), "usr_7"),
    ("id, a UUID", Obj(id=USER_ID), str(USER_ID)),
    ("pk", Obj(pk=USER_ID), str(USER_ID)),
    ("sub", Obj(sub="svc-1"), "svc-1"),
    ("user_id", Obj(user_id=3), "3"),
    ("username", Obj(username="bob"), "bob"),
    ("an empty identity: the next", Obj(identity="", username="bob"), "bob"),
    ("a bool is no id", Obj(id=True, username="bob"), "bob"),
    ("a dict", {"id": USER_ID}, str(USER_ID)),
    ("an older SimpleUser", OlderSimpleUser("ann"), "ann"),
    ("Starlette's SimpleUser", SimpleUser("ann"), "ann"),
    ("an app's user with a UUID id", AccountUser(USER_ID), str(USER_ID)),
    ("an object only", Obj(name="x"), None),
    ("unauthenticated", Obj(identity="u-1", is_authenticated=False), None),
]


@pytest.mark.parametrize(("what", "user", "expected"), SHAPES, ids=[s[0] for s in SHAPES])
def test_the_common_user_shapes_name_one_scope(what: str, user: Any, expected: str | None) -> None:
    assert scope_from_user()({"user": user}) == expected, what


def test_auth_credentials_are_permissions_not_a_principal() -> None:
    scope_of = scope_from_user()
    assert scope_of({"auth": AuthCredentials(["authenticated", "payments:write"])}) is None
    assert scope_of({"auth": "raw-bearer-token", "user": Obj(name="x")}) is None
    assert scope_of({"auth": Obj(sub=USER_ID)}) == str(USER_ID)  # a decoded token's claims


class HeaderUsers(AuthenticationBackend):
    """`x-user: <kind>:<name>` authenticates as that kind of user."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, BaseUser] | None:
        given = conn.headers.get("x-user")
        if not given:
            return None
        kind, _, name = given.partition(":")
        user: BaseUser
        if kind == "simple":
            user = SimpleUser(name)
        elif kind == "older":
            user = OlderSimpleUser(name)
        else:
            user = AccountUser(uuid.UUID(name))
        return AuthCredentials(["authenticated"]), user


@pytest.mark.parametrize("kind", ["simple", "older", "account"])
async def test_behind_starlettes_authentication_middleware(backend: Backend, namespace: str, kind: str) -> None:
    payments = Payments()
    mw = IdempotencyMiddleware(
        payments, backend=backend, namespace=namespace, scope=scope_from_user(), routes=[RoutePolicy("/payments")]
    )
    app = AuthenticationMiddleware(mw, backend=HeaderUsers())
    ann, bob = (str(uuid.uuid4()), str(uuid.uuid4())) if kind == "account" else ("ann", "bob")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

        async def pay(user: str | None) -> httpx.Response:
            headers = {"Idempotency-Key": "k"} | ({"x-user": f"{kind}:{user}"} if user else {})
            return await client.post("/payments", content=b'{"amount": 1}', headers=headers)

        first, again, other, nobody = await pay(ann), await pay(ann), await pay(bob), await pay(None)
    charges = Counter(r.headers.get("x-charge") for r in (first, again, other))
    assert first.status_code == other.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert payments.calls == 2 and charges == {"1": 2, "2": 1}  # ann once (and her replay), bob once
    assert_problem(nobody, SCOPE_REQUIRED)
