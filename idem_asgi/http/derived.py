"""Keys the server derives from the request, for retries that carry no (or a useless) header key.

- `intent_key(...)`: the user's intent from JSON body fields, so three clicks on "Pay" that each
  minted a fresh header key are still one payment within the route's TTL (the intent window).
- `event_id(...)`: a webhook's event id (header or JSON field), so a provider's redelivery is
  applied once and answered with the stored 2xx.

A source is any `fn(scope, body, header_key) -> str | None`; None means "no key".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Final

import msgspec

from .._types import Scope
from ..errors import MalformedKey
from .fingerprint import Hasher
from .keys import parse_key

KeySource = Callable[[Scope, bytes, "str | None"], "str | None"]
_decode: Final = msgspec.json.Decoder().decode
_encode: Final = msgspec.json.Encoder(order="sorted").encode
_MISSING: Final = object()


def _json(body: bytes) -> Any:
    try:
        return _decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None


def _field(doc: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return _MISSING
        doc = doc[part]
    return doc


class _Constant:
    """A fingerprint rule for derived keys: the key already says what the operation is."""

    __slots__ = ()

    def begin(self, scope: Scope) -> Hasher:
        return _ConstantHasher()


class _ConstantHasher:
    __slots__ = ()

    def update(self, chunk: bytes, /) -> None:
        pass

    def digest(self) -> bytes:
        return b"derived"


class intent_key:
    """Key = hash of (method, path, the given JSON fields); the client's header key is ignored.

    `intent_key("user_id", "booking.id", "amount", "currency")` with `ttl=300` makes every request
    carrying the same values within 5 minutes of the first one the same operation: no bucket
    boundary, so two clicks a second apart always match. The trade-off: a genuine second purchase
    with the same values inside the window is refused as a repeat (answered with the first one's
    response). A request missing a field has no key (400 if the route requires one).
    """

    __slots__ = ("fields",)

    def __init__(self, *fields: str) -> None:
        if not fields:
            raise ValueError("intent_key needs at least one JSON field")
        self.fields = fields

    fingerprint: Final = _Constant()

    def __call__(self, scope: Scope, body: bytes, header_key: str | None) -> str | None:
        doc = _json(body)
        values = [_field(doc, f) for f in self.fields]
        if any(v is _MISSING for v in values):
            return None
        h = hashlib.sha256(_encode([scope["method"], scope["path"], list(self.fields), values]))
        return "intent:" + h.hexdigest()


class event_id:
    """Key = the webhook event id from a header (`header="webhook-id"`) or a JSON field (`field="id"`).

    The fingerprint is the event id alone: redeliveries that differ in a delivery counter or a
    signature timestamp still match, so a duplicate always gets the stored answer, never a 422.
    """

    __slots__ = ("field", "header")

    def __init__(self, *, header: str | None = None, field: str | None = None) -> None:
        if (header is None) == (field is None):
            raise ValueError("event_id needs exactly one of header= or field=")
        self.header = None if header is None else header.lower().encode("latin-1")
        self.field = field

    fingerprint: Final = _Constant()

    def __call__(self, scope: Scope, body: bytes, header_key: str | None) -> str | None:
        raw: Any
        if self.header is not None:
            raw = next((v for k, v in scope["headers"] if k == self.header), None)
        else:
            value = _field(_json(body), self.field or "")
            raw = None if value is _MISSING or value is None else str(value).encode("utf-8")
        if not raw:
            return None
        try:
            return parse_key(raw)
        except MalformedKey:
            return "event:" + hashlib.sha256(raw).hexdigest()
