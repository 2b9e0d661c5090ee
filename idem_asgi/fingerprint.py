"""What makes two requests "the same operation": a hash over method, path, query, headers, body.

A rule has `begin(scope)` returning a hasher fed the body chunk by chunk as they arrive, so
the default rule hashes incrementally and never joins the body for hashing.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol
from urllib.parse import parse_qsl

import msgspec

from ._types import Scope
from .errors import ConfigurationError


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
        h: Hasher = _head(scope, self.headers)
        return h

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


_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder(order="sorted").encode


class JsonIgnoring:
    """JSON bodies compared without the given top-level fields (timestamps, client nonces).

    Semantically equal bodies match: keys are sorted and whitespace dropped before hashing.
    A body that is not JSON (or nests deeper than the decoder allows) is hashed as raw bytes.
    """

    __slots__ = ("fields", "headers")

    def __init__(self, *fields: str, headers: Iterable[str] = ()) -> None:
        self.fields = frozenset(fields)
        self.headers = _lower(headers)

    def begin(self, scope: Scope) -> Hasher:
        head = _head(scope, self.headers)

        def finish(body: bytes) -> bytes:
            try:
                doc = _json_decode(body)
            except (msgspec.DecodeError, RecursionError):
                # RecursionError: nesting deeper than msgspec will decode. Hashing the raw bytes
                # keeps such a body comparable instead of failing the request with a 500.
                head.update(b"raw")
                head.update(body)
            else:
                if isinstance(doc, dict):
                    doc = {k: v for k, v in doc.items() if k not in self.fields}
                head.update(b"json")
                head.update(_json_encode(doc))
            return bytes(head.digest())

        return _Buffered(finish)

    def __repr__(self) -> str:
        return f"JsonIgnoring(*{sorted(self.fields)!r})"


_SEGMENT = re.compile(r"\[\d*\]|[^.\[\]]+")
Path = tuple["str | int | None", ...]  # a name, an array index, or None: any index ("[]")


def _path(text: str) -> Path:
    """`customer.id`, `items[].price`, `items[0].sku`, `[].id`, `metadata[order_id]` as segments."""
    segments: list[str | int | None] = []
    for part in _SEGMENT.findall(text):
        if part == "[]":
            segments.append(None)
        elif part.startswith("["):
            segments.append(int(part[1:-1]))
        else:
            segments.append(int(part) if part.isdigit() else part)
    if not segments:
        raise ConfigurationError(f"empty field path {text!r}")
    return tuple(segments)


def _covers(path: Path, leaf: tuple[str | int, ...]) -> bool:
    """`path` selects `leaf` (the leaf itself or anything under it)."""
    if len(path) > len(leaf):
        return False
    return all(p == s or (p is None and isinstance(s, int)) for p, s in zip(path, leaf, strict=False))


def _leaves(doc: Any, at: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    if isinstance(doc, dict) and doc:
        for name, value in doc.items():
            yield from _leaves(value, (*at, name))
    elif isinstance(doc, list) and doc:
        for i, value in enumerate(doc):
            yield from _leaves(value, (*at, i))
    else:
        yield at, doc  # a scalar, or an empty object or array


def _form_leaves(body: bytes) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """`a=1&metadata[order]=x&items[0][price]=5&expand[]=p&expand[]=q` as (segments, value) pairs;
    `[]` numbers a name's repeats in order (what Stripe's and Rails' encoders send)."""
    seen: dict[str, int] = {}
    # Strict UTF-8 (raw and percent-encoded): a body that is not is compared as raw bytes instead.
    for name, value in parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict"):
        leaf: list[str | int] = []
        # A name with no segment at all ("", ".", "[]"...) is one field named as sent.
        for segment in _path(name) if _SEGMENT.search(name) and name.strip(".") else (name,):
            if segment is None:  # "expand[]": the nth repeat of this name
                segment = seen[name] = seen.get(name, -1) + 1
            leaf.append(segment)
        yield tuple(leaf), value


class Fields:
    """Bodies compared field by field: `only` these paths, or all `but` these (`ignore`), for JSON
    and for `application/x-www-form-urlencoded` bodies (what Stripe's clients send).

    A path is dotted names with array items: `amount`, `customer.id`, `items[].price` (every item's
    price), `items[0].sku`, `[].id` (a top-level array), `metadata[order_id]` (form names are paths
    as sent). A path selects its whole subtree. Comparison is semantic: key order and whitespace do
    not matter, array order and value types do, and a missing field differs from a null one. Field
    names holding `.`, `[` or `]` cannot be addressed. A body that is neither JSON nor a form (or
    nests deeper than the decoder allows) is compared as raw bytes.
    """

    __slots__ = ("headers", "ignore", "only")

    def __init__(self, *, only: Iterable[str] = (), ignore: Iterable[str] = (), headers: Iterable[str] = ()) -> None:
        for name, given in (("only", only), ("ignore", ignore)):
            if isinstance(given, str):
                raise ConfigurationError(f"Fields({name}=...) takes a list of paths, got the string {given!r}")
        self.only = tuple(_path(p) for p in only)
        self.ignore = tuple(_path(p) for p in ignore)
        if not self.only and not self.ignore:
            raise ConfigurationError("Fields needs only=[...] or ignore=[...] (JsonIgnoring() for neither)")
        self.headers = _lower(headers)

    def _kept(self, leaf: tuple[str | int, ...]) -> bool:
        if self.only and not any(_covers(p, leaf) for p in self.only):
            return False
        return not any(_covers(p, leaf) for p in self.ignore)

    def begin(self, scope: Scope) -> Hasher:
        head = _head(scope, self.headers)
        form = any(
            k == b"content-type" and v.split(b";", 1)[0].strip().lower() == b"application/x-www-form-urlencoded"
            for k, v in scope["headers"]
        )

        def finish(body: bytes) -> bytes:
            try:
                kind, leaves = (
                    (b"form", list(_form_leaves(body))) if form else (b"json", list(_leaves(_json_decode(body))))
                )
            except (msgspec.DecodeError, RecursionError, UnicodeError):
                head.update(b"raw")
                head.update(body)
                return bytes(head.digest())
            kept = sorted(_json_encode([list(leaf), value]) for leaf, value in leaves if self._kept(leaf))
            head.update(kind)
            for item in kept:
                head.update(len(item).to_bytes(4, "big"))
                head.update(item)
            return bytes(head.digest())

        return _Buffered(finish)

    def __repr__(self) -> str:
        return f"Fields(only={self.only!r}, ignore={self.ignore!r})"


class custom:
    """Wrap `func(scope, body) -> bytes` as a rule; the body is passed whole."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Scope, bytes], bytes]) -> None:
        self.func = func

    def begin(self, scope: Scope) -> Hasher:
        return _Buffered(lambda body: self.func(scope, body))
