"""Parsing the Idempotency-Key header, and ready-made scope callables.

A key is a bare token or the IETF draft's structured-field string (`"abc"` means `abc`),
and after unquoting it is 1 to 255 visible ASCII characters (0x21-0x7E).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Final
from urllib.parse import quote

from .._types import Scope
from ..errors import InvalidScope, MalformedKey

MAX_KEY_LENGTH: Final = 255
_VISIBLE: Final = re.compile(rb"[\x21-\x7e]{1,255}")
_SF_STRING: Final = re.compile(rb'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_ESCAPE: Final = re.compile(rb'\\(["\\])')

ScopeFunc = Callable[[Scope], "str | None"]


_VISIBLE_BYTES: Final = bytes(range(0x21, 0x7F))


def parse_key(value: bytes) -> str:
    """Return the key carried by one header value, or raise `MalformedKey` saying why."""
    if 0 < len(value) <= MAX_KEY_LENGTH and not value.translate(None, _VISIBLE_BYTES) and value[0] != 0x22:
        return value.decode("ascii")  # a bare token of visible ASCII: the usual case, one C pass
    value = value.strip(b" \t")
    if value[:1] == b'"':
        m = _SF_STRING.fullmatch(value)
        if m is None:
            raise MalformedKey("a quoted key must be a valid structured-field string")
        value = _ESCAPE.sub(rb"\1", m.group(1))
    if not value:
        raise MalformedKey("the key is empty")
    if len(value) > MAX_KEY_LENGTH:
        raise MalformedKey(f"the key is longer than {MAX_KEY_LENGTH} characters")
    if _VISIBLE.fullmatch(value) is None:
        raise MalformedKey("the key may hold only visible ASCII characters (0x21-0x7E)")
    return value.decode("ascii")


MAX_SCOPE_LENGTH: Final = 200
"""Longer scopes are stored as a fixed-size digest (a Postgres index row has a size limit)."""
ANONYMOUS_SCOPE: Final = "~anonymous"
"""The key space of callers a scope callable found nothing for, on routes with `anonymous=True`."""


def storable_scope(value: str) -> bool:
    """Whether every store can keep `value` as it is: no NUL (Postgres text refuses it), valid UTF-8.

    Scopes often come from a request header, so a bad one is the client's 400, not a store error.
    """
    if "\x00" in value:
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def stored_scope(value: object) -> str:
    """The form a scope callable's answer is stored under; raises `InvalidScope` when there is none.

    A `str` is kept as it is, unless it is longer than `MAX_SCOPE_LENGTH` or starts with `~`
    (reserved, e.g. for `ANONYMOUS_SCOPE`): then it is stored as `~h <sha256 hex>`, a fixed size that
    no other answer can take. An `int` is its decimal text. Anything else (an object, whose text
    could differ between two retries) is refused, as is a string no store can keep.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidScope(f"the scope callable returned a {type(value).__name__}; it must return a str or None")
    text = value if isinstance(value, str) else str(value)
    if not storable_scope(text):
        raise InvalidScope("the scope holds a NUL character or is not valid Unicode")
    if len(text) > MAX_SCOPE_LENGTH or text.startswith("~"):
        return "~h " + hashlib.sha256(text.encode("utf-8")).hexdigest()
    return text


MAX_ROUTE_KEY_LENGTH: Final = 1024


def route_key(method: str, path: str, key: str) -> str:
    """The stored key of a key the route derived (`intent_key`, `event_id`, any `key=` callable).

    `"<METHOD> <path, percent-quoted> <key>"`: readable in the ops tools, unique per (method, path,
    key), and never equal to a header key (those cannot hold a space), so a client's header key can
    neither block nor answer a derived one, and the same event id on two routes is two records.
    Longer than `MAX_ROUTE_KEY_LENGTH`: `~h <sha256 hex>` of that text.
    """
    text = f"{method} {quote(path, safe=_PATH_SAFE, errors='surrogateescape')} {key}"
    if len(text) > MAX_ROUTE_KEY_LENGTH:
        return "~h " + hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
    return text


_PATH_SAFE: Final = "/:@!$&'()*+,;=-._~"


def scope_from_header(name: str) -> ScopeFunc:
    """Scope records by a request header (a tenant id, an API key id).

    Only safe behind a gateway that sets this header itself and overwrites any value the client
    sent: a client that can choose the header can read another tenant's stored answers. A request
    carrying the header twice is refused (400 `scope-malformed`): which line would count is
    ambiguous, and gateways and apps may pick different ones.
    """
    raw = name.lower().encode("latin-1")

    def scope_of(scope: Scope) -> str | None:
        found: bytes | None = None
        for k, v in scope["headers"]:
            if k == raw:
                if found is not None:
                    raise InvalidScope(f"send exactly one {name} header")
                found = v
        return None if found is None else found.decode("latin-1")

    return scope_of


def scope_from_state(attribute: str) -> ScopeFunc:
    """Scope records by `scope["state"][attribute]`, set by an auth middleware that runs first."""

    def scope_of(scope: Scope) -> str | None:
        value = scope.get("state", {}).get(attribute)
        return None if value is None else str(value)

    return scope_of


_PRINCIPAL_ATTRIBUTES: Final = ("identity", "id", "pk", "sub", "user_id", "username")


def _read(value: object, name: str) -> object:
    """`value.name` (or `value[name]` of a mapping); None when absent, or when it raises
    `NotImplementedError`: Starlette's `BaseUser` leaves `identity` to subclasses that way."""
    try:
        return value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
    except NotImplementedError:
        return None


def _id_text(value: object) -> str | None:
    """A str, int or UUID as the stable text a scope is stored under; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str | int):
        return str(value) or None
    if isinstance(value, uuid.UUID):
        return str(value)  # one spelling: lower-case, hyphenated
    return None  # never str(obj): an object's text may change between two retries


def _principal(value: object, attributes: tuple[str, ...], *, plain: bool) -> str | None:
    if value is None or _read(value, "is_authenticated") is False:
        return None  # nobody, or Starlette's UnauthenticatedUser
    text = _id_text(value)
    if text is not None:
        # A plain user name or id; never a plain `auth` value, which is often the raw credential.
        return text if plain else None
    for name in attributes:
        text = _id_text(_read(value, name))
        if text is not None:
            return text
    return None


def scope_from_user(attribute: str | None = None) -> ScopeFunc:
    """Scope records by the authenticated principal an auth middleware put in `scope["user"]`.

    The secure default for APIs with authentication: Starlette's `AuthenticationMiddleware` and
    Litestar's auth middleware set `scope["user"]` (and `scope["auth"]`) before this middleware runs,
    so add them outside it. The principal, in this order:

    1. `scope["user"]` itself when it is a str, an int or a `uuid.UUID`;
    2. else the first of `attribute` (by default `identity`, `id`, `pk`, `sub`, `user_id`,
       `username`) on the user object (or key of a user dict) that is a non-empty str, an int or a
       UUID; one that raises `NotImplementedError` (Starlette's `BaseUser.identity`) counts as absent;
    3. else `scope["auth"]` read the same way by attributes, never as a plain value (that is often
       the raw credential, which changes when a token is refreshed). Starlette's `AuthCredentials`
       holds permission scopes shared by many users, not an identity: it never names anyone.

    A UUID is stored as its lower-case hyphenated text. An unauthenticated user (`is_authenticated`
    false) names nobody: the request is refused with 400 `scope-required`.
    """
    attributes = _PRINCIPAL_ATTRIBUTES if attribute is None else (attribute,)

    def scope_of(scope: Scope) -> str | None:
        user = _principal(scope.get("user"), attributes, plain=True)
        return user or _principal(scope.get("auth"), attributes, plain=False)

    return scope_of


def scope_from_token_hash(header: str = "authorization") -> ScopeFunc:
    """Scope records by a hash of a credential header.

    Only safe when the credential is stable across every retry of one intent: a bearer token
    refreshed between two retries makes a second record and runs the operation twice.
    """
    read = scope_from_header(header)

    def scope_of(scope: Scope) -> str | None:
        value = read(scope)
        return None if value is None else hashlib.sha256(value.encode("latin-1")).hexdigest()

    return scope_of
