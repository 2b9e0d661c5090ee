"""Parsing the Idempotency-Key header, and ready-made scope callables.

A key is a bare token or the IETF draft's structured-field string (`"abc"` means `abc`),
and after unquoting it is 1 to 255 visible ASCII characters (0x21-0x7E).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Final

from ._types import Scope

MAX_KEY_LENGTH: Final = 255
_VISIBLE: Final = re.compile(rb"[\x21-\x7e]{1,255}")
_SF_STRING: Final = re.compile(rb'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_ESCAPE: Final = re.compile(rb'\\(["\\])')

ScopeFunc = Callable[[Scope], "str | None"]


class MalformedKey(ValueError):
    """The header value is not a valid idempotency key."""


def parse_key(value: bytes) -> str:
    """Return the key carried by one header value, or raise `MalformedKey` saying why."""
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


def scope_from_header(name: str) -> ScopeFunc:
    """Scope records by a request header set by a trusted proxy (e.g. a tenant or API key id)."""
    raw = name.lower().encode("latin-1")

    def scope_of(scope: Scope) -> str | None:
        for k, v in scope["headers"]:
            if k == raw:
                return str(v.decode("latin-1"))
        return None

    return scope_of


def scope_from_state(attribute: str) -> ScopeFunc:
    """Scope records by `scope["state"][attribute]`, set by an auth middleware that runs first."""

    def scope_of(scope: Scope) -> str | None:
        value = scope.get("state", {}).get(attribute)
        return None if value is None else str(value)

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
