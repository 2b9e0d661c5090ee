"""The rule `Fields` documents, written out plainly and slowly: the oracle of the property tests.

Nothing here is shared with `idem_asgi.http.fields`: JSON is read with the standard library (floats as
their text), form bodies are decoded byte by byte, and paths are followed node by node.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORM = [(b"content-type", b"application/x-www-form-urlencoded")]
Path = tuple["str | int | None", ...]


@dataclass(frozen=True)
class FloatText:
    """A JSON float as written (`1.0`, `1e0`): the rule compares numbers as written."""

    text: str


def dumps(value: Any) -> str:
    """JSON text of a value whose floats are `FloatText`s, keys in the dict's order."""
    if isinstance(value, FloatText):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def json_loads(body: bytes) -> Any:
    return json.loads(body, parse_float=FloatText)


_INDEX = re.compile(r"0|[1-9][0-9]{0,17}")


def render_path(path: Path) -> str:
    """A path as `Fields` takes it: names with dots in brackets, names that look like indexes dotted."""
    out = []
    for i, seg in enumerate(path):
        if seg is None:
            out.append("[]")
        elif isinstance(seg, int) or "." in seg:
            out.append(f"[{seg}]")
        elif i == 0:
            out.append(seg)
        else:
            out.append(f".{seg}")
    return "".join(out)


# -- JSON: the set of (where, what) a rule compares -----------------------------------------------


def _matches(p: str | int | None, s: str | int) -> bool:
    if p is None:
        return isinstance(s, int)
    return type(p) is type(s) and p == s


def _covers(path: Path, at: tuple[str | int, ...]) -> bool:
    return len(path) <= len(at) and all(_matches(p, s) for p, s in zip(path, at, strict=False))


def _before(at: tuple[str | int, ...], path: Path) -> bool:
    return len(at) < len(path) and all(_matches(p, s) for p, s in zip(path, at, strict=False))


def _what(value: Any) -> tuple[Any, ...]:
    if isinstance(value, dict):
        return ("object",)
    if isinstance(value, list):
        return ("array", len(value))
    if isinstance(value, FloatText):
        return ("float", value.text)
    return (type(value).__name__, value)


def json_compared(doc: Any, only: list[Path], ignore: list[Path]) -> set[tuple[Any, ...]]:
    """Every node the rule compares, with its kind (an array with its length) and scalar value.

    A node counts when an `only` path covers it, or when it lies on an `only` path's way; a node on
    the way whose shape no path continues into (a string where a path wants an object) counts with
    everything under it. Nodes an `ignore` path covers never count. Without `only`, all count.
    """
    out: set[tuple[Any, ...]] = set()

    def walk(value: Any, at: tuple[str | int, ...], whole: bool) -> None:
        if not whole:
            if any(_covers(p, at) for p in only):
                whole = True
            else:
                nexts = [p[len(at)] for p in only if _before(at, p)]
                if not nexts:
                    return
                fits = (isinstance(value, dict) and any(isinstance(n, str) for n in nexts)) or (
                    isinstance(value, list) and any(not isinstance(n, str) for n in nexts)
                )
                whole = not fits
        if any(_covers(p, at) for p in ignore):
            return
        out.add((at, _what(value)))
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, (*at, k), whole)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, (*at, i), whole)

    walk(doc, (), not only)
    return out


def json_equal(a: Any, b: Any, only: list[Path], ignore: list[Path]) -> bool:
    return json_compared(a, only, ignore) == json_compared(b, only, ignore)


# -- forms: fields by name, in order within a name (or within one `[]` array) ---------------------

_HEX = b"0123456789ABCDEFabcdef"


def decoded(part: bytes) -> bytes:
    """`+` is a space and an ASCII escape its character, except `%`, `&`, `=` (and every non-ASCII
    escape, and a `%` that starts none), which stay escapes, in upper case."""
    part = part.replace(b"+", b" ")
    out = bytearray()
    i = 0
    while i < len(part):
        if part[i] == 0x25:
            pair = part[i + 1 : i + 3]
            if len(pair) == 2 and all(c in _HEX for c in pair):
                byte = int(pair, 16)
                out += bytes((byte,)) if byte < 0x80 and byte not in b"%&=" else b"%" + pair.upper()
                i += 3
            else:
                out += b"%25"
                i += 1
        else:
            out.append(part[i])
            i += 1
    return bytes(out)


def _unescaped(text: bytes) -> bytes:
    return re.sub(rb"%([0-9A-F]{2})", lambda m: bytes((int(m.group(1), 16),)), text)


def name_segments(name: bytes) -> list[bytes] | None:
    """`items[0][price]` as [items, 0, price]; None for a name not of that shape (`a[b`, `[x]`)."""
    base, bracket, rest = name.partition(b"[")
    if not base or b"]" in base:
        return None
    segments = [base]
    rest = bracket + rest
    while rest:
        if not rest.startswith(b"[") or b"]" not in rest:
            return None
        inside, _, rest = rest[1:].partition(b"]")
        if b"[" in inside:
            return None
        segments.append(inside)
    return segments


def _form_matches(p: str | int | None, text: bytes, first: bool) -> bool:
    if first:
        return isinstance(p, str) and _unescaped(text) == p.encode("utf-8")
    if p is None:
        return text == b"" or re.fullmatch(rb"0|[1-9][0-9]*", text) is not None
    return _unescaped(text) == str(p).encode("utf-8")


def _form_covers(path: Path, segs: list[bytes]) -> bool:
    return len(path) <= len(segs) and all(
        _form_matches(p, s, i == 0) for i, (p, s) in enumerate(zip(path, segs, strict=False))
    )


def _form_before(segs: list[bytes], path: Path) -> bool:
    return len(segs) < len(path) and all(
        _form_matches(p, s, i == 0) for i, (p, s) in enumerate(zip(path, segs, strict=False))
    )


def form_compared(body: bytes, only: list[Path], ignore: list[Path]) -> Any:
    """The fields the rule compares, grouped by name (or by name up to its first `[]`), each
    group in body order; a body holding a raw `;` is compared as its bytes."""
    if b";" in body:
        return ("raw", body)
    groups: dict[bytes, list[tuple[bytes, bytes, bytes]]] = {}
    for field in body.split(b"&"):
        if not field:
            continue
        raw_name, sep, raw_value = field.partition(b"=")
        name, value = decoded(raw_name), decoded(raw_value)
        segs = name_segments(name)
        if only and (segs is None or not any(_form_covers(p, segs) or _form_before(segs, p) for p in only)):
            continue
        if segs is not None and any(_form_covers(p, segs) for p in ignore):
            continue
        key = name[: name.find(b"[]") + 2] if b"[]" in name else name
        groups.setdefault(key, []).append((name, sep, value))
    return ("form", groups)


def form_equal(a: bytes, b: bytes, only: list[Path], ignore: list[Path]) -> bool:
    return bool(form_compared(a, only, ignore) == form_compared(b, only, ignore))
