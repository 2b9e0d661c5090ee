"""What makes two requests "the same operation": a hash over method, path, query, headers, body.

A rule has `begin(scope)` returning a hasher fed the body chunk by chunk as they arrive, so
the default rule hashes incrementally and never joins the body for hashing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol

import anyio
import msgspec

from .._types import Scope
from ..errors import ConfigurationError
from ..records import short_sha256
from .fields import (
    canonical_form,
    drop,
    form_drop,
    form_matcher,
    form_order,
    form_select,
    json_decode,
    json_encode,
    parse_path,
    select,
    tree,
)


class Hasher(Protocol):
    """Incremental digest of one request."""

    def update(self, chunk: bytes, /) -> None: ...
    def digest(self) -> bytes: ...


class FingerprintRule(Protocol):
    """Anything with `begin(scope) -> Hasher`; see `RawBody`, `JsonIgnoring`, `Fields` and `custom`."""

    def begin(self, scope: Scope) -> Hasher: ...


_prefixes: dict[tuple[str, str, bytes], bytes] = {}
"""(method, path, query) -> its length-prefixed bytes: most requests of a route repeat them."""


def _prefix(method: str, path: str, query: bytes) -> bytes:
    found = _prefixes.get((method, path, query))
    if found is None:
        m = method.encode("ascii")
        p = path.encode("utf-8", "surrogateescape")
        found = b"".join(
            (len(m).to_bytes(4, "big"), m, len(p).to_bytes(4, "big"), p, len(query).to_bytes(4, "big"), query)
        )
        if len(_prefixes) >= 4096:
            _prefixes.clear()  # bounded: paths with ids in them never stop coming
        _prefixes[method, path, query] = found
    return found


def _head(scope: Scope, headers: tuple[bytes, ...]) -> Any:
    """A sha256 already fed the length-prefixed method, path, query and chosen headers."""
    prefix = _prefix(scope["method"], scope["path"], scope["query_string"])
    if not headers:
        return hashlib.sha256(prefix)
    data = [prefix]
    if headers:
        present: dict[bytes, list[bytes]] = {}
        for k, v in scope["headers"]:
            if k in headers:
                present.setdefault(k, []).append(v)
        for name in headers:
            p = name + b":" + b",".join(present.get(name, ()))
            data += (len(p).to_bytes(4, "big"), p)
    # One hashlib call over the joined prefix instead of two per part: the same digest.
    return hashlib.sha256(b"".join(data))


def _lower(headers: Iterable[str]) -> tuple[bytes, ...]:
    return tuple(h.lower().encode("latin-1") for h in headers)


class RawBody:
    """Default: the body bytes exactly as sent, plus method, path, query and `headers`."""

    __slots__ = ("headers",)

    def __init__(self, headers: Iterable[str] = ()) -> None:
        self.headers = _lower(headers)

    def begin(self, scope: Scope) -> Hasher:
        if self.headers:
            h: Hasher = _head(scope, self.headers)
            return h
        return hashlib.sha256(_prefix(scope["method"], scope["path"], scope["query_string"]))  # (`_head`, inline)

    def whole(self, scope: Scope, body: bytes) -> bytes:
        """The digest of a body that came in one piece (the usual case): `begin`, `update`, `digest`
        in one call, by CPython's own sha256 for a short body (OpenSSL's setup costs more than
        hashing a few hundred bytes). The same digest either way."""
        if self.headers or len(body) >= SHORT_BODY:
            h = self.begin(scope)
            h.update(body)
            return h.digest()
        prefix = _prefix(scope["method"], scope["path"], scope["query_string"])
        digest: bytes = short_sha256(prefix + body).digest()
        return digest

    def __repr__(self) -> str:
        return f"RawBody(headers={self.headers!r})"


class _Buffered:
    """Collects the body, then hands it whole to `finish`."""

    __slots__ = ("_chunks", "_finish")

    def __init__(self, finish: Callable[[bytes], bytes]) -> None:
        self._chunks: list[bytes] = []
        self._finish = finish

    def update(self, chunk: bytes, /) -> None:
        self._chunks.append(chunk)

    def digest(self) -> bytes:
        return self._finish(b"".join(self._chunks))


class JsonIgnoring:
    """JSON bodies compared without the given top-level fields (timestamps, client nonces).

    Semantically equal bodies match: keys are sorted and whitespace dropped before hashing; numbers
    count as written (`1.0` is not `1`, and no float is rounded). A body that is not JSON (or nests
    deeper than the decoder allows) is hashed as raw bytes.
    """

    __slots__ = ("fields", "headers")

    def __init__(self, *fields: str, headers: Iterable[str] = ()) -> None:
        self.fields = frozenset(fields)
        self.headers = _lower(headers)

    def begin(self, scope: Scope) -> Hasher:
        head = _head(scope, self.headers)

        def finish(body: bytes) -> bytes:
            try:
                doc = json_decode(body)
                if isinstance(doc, dict):
                    doc = {k: v for k, v in doc.items() if k not in self.fields}
                canonical = json_encode(doc)
            except (msgspec.DecodeError, msgspec.EncodeError, RecursionError, UnicodeError):
                # RecursionError: nesting deeper than msgspec will decode. Hashing the raw bytes
                # keeps such a body comparable instead of failing the request with a 500.
                head.update(b"raw")
                head.update(body)
            else:
                head.update(b"json")
                head.update(canonical)
            return bytes(head.digest())

        return _Buffered(finish)

    def __repr__(self) -> str:
        return f"JsonIgnoring(*{sorted(self.fields)!r})"


class Fields:
    """Bodies compared field by field: `only` these paths, or all `but` these (`ignore`), for JSON
    and for `application/x-www-form-urlencoded` bodies (what Stripe's clients send).

    A path is names joined by dots, with array items in brackets: `amount`, `customer.id`,
    `items[].price` (every item's price), `items[0].sku`, `[].id` (a top-level array),
    `metadata[order_id]` (`[name]` is a name too, and may hold dots). A path selects its whole
    subtree. Comparison is semantic: key order and whitespace do not matter; array order, array
    length, value types and numbers as written do, and a missing field differs from a null one.

    With `only`, a path the body does not follow is compared by what the body has where the path
    stops: `customer.id` against `"customer": "cus_1"` compares that string, `items[].price`
    against `"items": null` that null. A path missing from both bodies matches.

    Form names are paths as sent (`items[0][price]`; `a.b` is one name, never `a[b]`). Fields may
    come in any order, but fields of one name keep theirs (`amount=5&amount=6` is not
    `amount=6&amount=5`), as do the fields of one `[]` array. A body that is neither JSON nor a form
    (or nests deeper than the decoder allows, or is a form with a raw `;`) is compared as raw bytes.
    """

    __slots__ = ("_form_ignore", "_form_only", "_ignore", "_only", "headers", "ignore", "only")

    def __init__(self, *, only: Iterable[str] = (), ignore: Iterable[str] = (), headers: Iterable[str] = ()) -> None:
        for name, given in (("only", only), ("ignore", ignore)):
            if isinstance(given, str):
                raise ConfigurationError(f"Fields({name}=...) takes a list of paths, got the string {given!r}")
        self.only = tuple(parse_path(p) for p in only)
        self.ignore = tuple(parse_path(p) for p in ignore)
        if not self.only and not self.ignore:
            raise ConfigurationError("Fields needs only=[...] or ignore=[...] (JsonIgnoring() for neither)")
        self.headers = _lower(headers)
        self._only = tree(self.only) if self.only else None
        self._ignore = tree(self.ignore) if self.ignore else None
        self._form_only = form_matcher(self._only, on_the_way=True)
        self._form_ignore = form_matcher(self._ignore, on_the_way=False)

    def begin(self, scope: Scope) -> Hasher:
        head = _head(scope, self.headers)
        types = [v for k, v in scope["headers"] if k == b"content-type"]
        form = len(types) == 1 and types[0].split(b";", 1)[0].strip().lower() == _FORM_TYPE

        def finish(body: bytes) -> bytes:
            canonical = None if len(types) > 1 else self._form(body) if form else self._json(body)
            if canonical is None:  # not a body these rules read: every byte counts
                head.update(b"raw")
                head.update(body)
            else:
                head.update(canonical)
            return bytes(head.digest())

        return _Buffered(finish)

    def _json(self, body: bytes) -> bytes | None:
        try:
            doc = json_decode(body)
            if self._only is not None:
                doc = select(doc, self._only)
            if self._ignore is not None:
                drop(doc, self._ignore)
            return b"json" + json_encode(doc)
        except (msgspec.DecodeError, msgspec.EncodeError, RecursionError, UnicodeError):
            return None

    def _form(self, body: bytes) -> bytes | None:
        form = canonical_form(body)
        if form is None:
            return None
        if self._only is not None:
            form = form_select(form, self._form_only)
        if self._form_ignore is not None:
            form = form_drop(form, self._form_ignore)
        return b"form" + form_order(form)

    def __repr__(self) -> str:
        return f"Fields(only={self.only!r}, ignore={self.ignore!r})"


_FORM_TYPE: Final = b"application/x-www-form-urlencoded"


class custom:
    """Wrap `func(scope, body) -> bytes` as a rule; the body is passed whole (from a worker thread
    for bodies of `OFFLOAD_BYTES` and more, like the other rules that read the whole body)."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Scope, bytes], bytes]) -> None:
        self.func = func

    def begin(self, scope: Scope) -> Hasher:
        return _Buffered(lambda body: self.func(scope, body))


SHORT_BODY: Final = 4096
"""Bodies shorter than this are hashed by CPython's sha256, longer ones by OpenSSL's (`RawBody.whole`)."""
OFFLOAD_BYTES: Final = 64 * 1024
"""From this size on, rules that read the whole body (`JsonIgnoring`, `Fields`, `custom`) run in a
worker thread: at ~15 ms per MiB, a larger body would hold the event loop for more than a ms."""


async def digest(hasher: Hasher, size: int) -> bytes:
    """`hasher.digest()`, off the event loop when it parses a body of `size` >= `OFFLOAD_BYTES`."""
    if size >= OFFLOAD_BYTES and isinstance(hasher, _Buffered):
        return await anyio.to_thread.run_sync(hasher.digest)
    return hasher.digest()
