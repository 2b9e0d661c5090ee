"""What makes two requests "the same operation": a hash over method, path, query, headers, body.

A rule has `begin(scope)` returning a hasher fed the body chunk by chunk as they arrive, so
the default rule hashes incrementally and never joins the body for hashing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from ._types import Scope


class Hasher(Protocol):
    """Incremental digest of one request."""

    def update(self, chunk: bytes, /) -> None: ...
    def digest(self) -> bytes: ...


class FingerprintRule(Protocol):
    """Anything with `begin(scope) -> Hasher`; see `RawBody`, `JsonIgnoring` and `custom`."""

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


class custom:
    """Wrap `func(scope, body) -> bytes` as a rule; the body is passed whole."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[Scope, bytes], bytes]) -> None:
        self.func = func

    def begin(self, scope: Scope) -> Hasher:
        return _Buffered(lambda body: self.func(scope, body))
