"""How `Fields` reads a body: its paths, the JSON projection, and the canonical form of a form body.

Both bodies end as one canonical encoding hashed once, built by C code (msgspec, `bytes`
methods) wherever possible: Python only walks the paths a route names, never every leaf.

JSON: the body is decoded (floats kept as written, so `0.1` and `0.10000000000000000001` differ,
as they do to an app reading `Decimal`), projected onto the `only` paths, stripped of the `ignore`
paths, and re-encoded with sorted keys. Where the body does not have the shape a path expects,
the value found there is kept whole ("the value present"): `customer.id` against a string
`customer` compares that string, never nothing.

Forms: `+` and the percent-escapes of ASCII characters are decoded; other escapes stay as sent
(upper-cased), since frameworks decode them differently from raw bytes. The fields are then
sorted by name, stably: fields of one name keep their order, and so do the fields of one `[]`
array (everything up to a name's first `[]`). A body holding a raw `;` is not read as a form at
all (python-multipart, Starlette's parser, splits fields at `;`; the standard library does not).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, Final

import msgspec

from ..errors import ConfigurationError

Segment = str | int | None
"""A name, an array index, or None: every item (`[]`)."""
Path = tuple[Segment, ...]

_PART: Final = re.compile(r"\.([^.\[\]]+)|\[([^\[\]]*)\]|([^.\[\]]+)")
_INDEX: Final = re.compile(r"0|[1-9][0-9]{0,17}")


def parse_path(text: str) -> Path:
    """`customer.id`, `items[].price`, `items[0].sku`, `[].id`, `metadata[order.id]` as segments.

    `.name` and `[name]` are names (`[...]` may hold dots), `[n]` an index, `[]` every item.
    """
    segments: list[Segment] = []
    pos = 0
    while pos < len(text):
        m = _PART.match(text, pos)
        if m is None or (m.group(1) is not None and not pos) or (m.group(3) is not None and pos):
            raise ConfigurationError(
                f"bad field path {text!r}: names joined by dots, items in brackets, e.g. 'items[].price'"
            )
        dotted, bracket, first = m.groups()
        if bracket is None:
            segments.append(dotted if dotted is not None else first)
        elif bracket == "":
            segments.append(None)
        else:
            segments.append(int(bracket) if _INDEX.fullmatch(bracket) else bracket)
        pos = m.end()
    if not segments:
        raise ConfigurationError(f"empty field path {text!r}")
    return tuple(segments)


# -- JSON -----------------------------------------------------------------------------------------


class Node:
    """One step of the paths: the whole subtree (`leaf`), or the names, indexes and `[]` under it."""

    __slots__ = ("each", "flat", "indexes", "leaf", "names")

    def __init__(self) -> None:
        self.leaf = False
        self.names: dict[str, Node] = {}
        self.indexes: dict[int, Node] = {}
        self.each: Node | None = None
        self.flat: tuple[str, ...] | None = None
        """The names, when every one is a leaf and nothing else is under this node (a fast path)."""

    @property
    def items(self) -> bool:
        return self.each is not None or bool(self.indexes)


def tree(paths: Iterable[Path]) -> Node:
    """The paths as one tree; for selection, an index's node also holds what `[]` selects."""
    root = Node()
    for path in paths:
        node = root
        for seg in path:
            if node.leaf:
                break
            if seg is None:
                node.each = node.each or Node()
                node = node.each
            elif isinstance(seg, int):
                node = node.indexes.setdefault(seg, Node())
            else:
                node = node.names.setdefault(seg, Node())
        node.leaf = True
    return _finish(root)


def _finish(node: Node) -> Node:
    if node.leaf:
        node.names, node.indexes, node.each = {}, {}, None
        return node
    node.names = {k: _finish(v) for k, v in node.names.items()}
    if node.each is not None:
        node.each = _finish(node.each)
        node.indexes = {i: _merge(node.each, v) for i, v in node.indexes.items()}
    else:
        node.indexes = {i: _finish(v) for i, v in node.indexes.items()}
    if node.names and not node.items and all(v.leaf for v in node.names.values()):
        node.flat = tuple(node.names)
    return node


def _merge(a: Node, b: Node) -> Node:
    out = Node()
    out.leaf = a.leaf or b.leaf
    if not out.leaf:
        for src in (a, b):
            for k, v in src.names.items():
                out.names[k] = _merge(out.names[k], v) if k in out.names else v
            for i, v in src.indexes.items():
                out.indexes[i] = _merge(out.indexes[i], v) if i in out.indexes else v
            if src.each is not None:
                out.each = src.each if out.each is None else _merge(out.each, src.each)
    return _finish(out)


def select(value: Any, node: Node) -> Any:
    """`value` reduced to what the `only` paths name. Items a path does not name become None (their
    positions stay, so array lengths count); a value of another shape than the paths expect is kept."""
    if node.leaf:
        return value
    kind = type(value)
    if kind is dict and node.names:
        if node.flat is not None:
            return {k: value[k] for k in node.flat if k in value}
        return {k: select(value[k], child) for k, child in node.names.items() if k in value}
    if kind is list and node.items:
        each = node.each
        if each is None:
            out: list[Any] = [None] * len(value)
        elif each.flat is not None and len(each.flat) == 1:
            (k,) = each.flat
            out = [({k: v[k]} if k in v else {}) if type(v) is dict else v for v in value]
        elif each.flat is not None:
            flat = each.flat
            out = [{k: v[k] for k in flat if k in v} if type(v) is dict else v for v in value]
        else:
            out = [select(v, each) for v in value]
        for i, child in node.indexes.items():
            if i < len(value):
                out[i] = select(value[i], child)
        return out
    return value  # not the shape the paths expect: the value present is what counts


def drop(value: Any, node: Node) -> None:
    """Remove what the `ignore` paths name from `value`, in place; an ignored item becomes None."""
    kind = type(value)
    if kind is dict:
        for k, child in node.names.items():
            if k in value:
                if child.leaf:
                    del value[k]
                else:
                    drop(value[k], child)
    elif kind is list:
        each = node.each
        if each is not None:
            if each.leaf:
                value[:] = [None] * len(value)
            elif each.flat is not None:
                for v in value:
                    if type(v) is dict:
                        for k in each.flat:
                            v.pop(k, None)
            else:
                for v in value:
                    drop(v, each)
        for i, child in node.indexes.items():
            if i < len(value):
                if child.leaf:
                    value[i] = None
                else:
                    drop(value[i], child)


def _float(text: str) -> msgspec.Raw:
    return msgspec.Raw(text.encode("ascii"))


json_decode: Final = msgspec.json.Decoder(float_hook=_float).decode
"""JSON with every float kept as written: never rounded, never equal to an int."""
json_encode: Final = msgspec.json.Encoder(order="sorted").encode


# -- forms ----------------------------------------------------------------------------------------

_KEPT_ESCAPES: Final = frozenset(b"%&=")
"""Escapes never decoded: `&` and `=` would split the body differently, `%` could make new escapes."""
_HEX: Final = frozenset(b"0123456789ABCDEFabcdef")


def _escape_pattern(allowed: Iterable[int]) -> re.Pattern[bytes]:
    by_high: dict[int, list[str]] = {}
    for byte in allowed:
        by_high.setdefault(byte >> 4, []).append(f"{byte & 15:X}")
    alternatives = []
    for high, lows in sorted(by_high.items()):
        chars = "".join(sorted({c for low in lows for c in (low, low.lower())}))
        alternatives.append(f"{high:X}[{chars}]")
    return re.compile(("%(?:" + "|".join(alternatives) + ")").encode("ascii"))


_SAFE_ESCAPE: Final = _escape_pattern(b for b in range(128) if b not in _KEPT_ESCAPES | _HEX)
"""Escapes decoded across the whole body at once: their byte is no `%`, `&`, `=` or hex digit, so
decoding them cannot change the fields, nor turn a neighbour into an escape (`%4%31` is not `%41`)."""
_ANY_ESCAPE: Final = re.compile(rb"%([0-9A-Fa-f]{2})?")


def _token(m: re.Match[bytes]) -> bytes:
    hexes = m.group(1)
    if hexes is None:
        return b"%25"  # a `%` that starts no escape: the character itself
    byte = int(hexes, 16)
    return bytes((byte,)) if byte < 0x80 and byte not in _KEPT_ESCAPES else b"%" + hexes.upper()


def canonical_field(field: bytes) -> bytes:
    """One field with every ASCII escape decoded but those of `_KEPT_ESCAPES`; those, the other
    escapes and a lone `%` as upper-case escapes. Equal for equal meanings, never a new `&` or `=`."""
    return _ANY_ESCAPE.sub(_token, field)


def _decode_safe(body: bytes) -> bytes:
    """The `_SAFE_ESCAPE`s decoded across the whole body, one `bytes.replace` (C) per distinct one."""
    pos = 0
    while (m := _SAFE_ESCAPE.search(body, pos)) is not None:
        escape = m.group()
        body = body.replace(escape, bytes((int(escape[1:], 16),)))
        pos = m.start()
    return body


_RUNS: Final = re.compile(rb"&{2,}")
_ARRAY_KEY: Final = re.compile(rb"&((?:[^&=\[]|\[(?!\]))*(?:\[\])?)")
"""Per field, what it sorts by: its name, or the name up to its first `[]` (one array's fields)."""


def canonical_form(body: bytes) -> bytes | None:
    """The form body with canonical fields (`canonical_field`) joined by `&`; None when the body
    holds a raw `;` (python-multipart, Starlette's parser, splits fields there; the stdlib does not).

    Whole-body `bytes` operations do the work; only fields with rarer escapes (`%26`, `%3D`, hex
    digits, non-ASCII bytes, a lone `%`) are rewritten one by one.
    """
    if b";" in body:
        return None
    if b"+" in body:
        body = body.replace(b"+", b" ")
    if b"%" in body:
        body = _decode_safe(body)
        if b"%" in body:
            body = b"&".join(canonical_field(f) if b"%" in f else f for f in body.split(b"&"))
    if b"&&" in body or body[:1] == b"&" or body[-1:] == b"&":
        body = _RUNS.sub(b"&", body).strip(b"&")  # empty fields are no fields
    return body


def form_order(body: bytes) -> bytes:
    """Canonical fields sorted by name, stably: fields of one name, and of one `[]` array, keep
    their order (`amount=5&amount=6` is not `amount=6&amount=5`)."""
    if not body:
        return body
    fields = body.split(b"&")
    keys = _ARRAY_KEY.findall(b"&" + body) if b"[]" in body else [f.partition(b"=")[0] for f in fields]
    return b"&".join(map(fields.__getitem__, sorted(range(len(fields)), key=keys.__getitem__)))


_EACH: Final = r"\[(?:|0|[1-9][0-9]*)\]"
_UNDER: Final = r"(?:\[[^\[\]&=]*\])*"
"""Any brackets after a selected name: the whole subtree."""


def _name_text(name: str) -> str:
    """A name as a regex over canonical form names (bytes, read as latin-1 here): a non-ASCII byte
    raw or as its escape, `%`, `&` and `=` as their escapes."""
    return "".join(
        f"(?:{re.escape(chr(b))}|%{b:02X})" if b >= 0x80 else f"%{b:02X}" if b in _KEPT_ESCAPES else re.escape(chr(b))
        for b in name.encode("utf-8", "surrogateescape")
    )


def _under(node: Node, *, first: bool, on_the_way: bool) -> str | None:
    """The regex for the rest of a form name from `node` on (names shared by paths are factored)."""
    if node.leaf:
        return _UNDER
    alternatives: list[str] = []
    steps: list[tuple[str, Node]] = [
        (_name_text(k) if first else rf"\[{_name_text(k)}\]", c) for k, c in node.names.items()
    ]
    if not first:
        steps += ((rf"\[{i}\]", c) for i, c in node.indexes.items())
        if node.each is not None:
            steps.append((_EACH, node.each))
    for step, child in steps:
        rest = _under(child, first=False, on_the_way=on_the_way)
        if rest is not None:
            alternatives.append(step + rest)
    if not alternatives:
        return None if first or not on_the_way else ""
    pattern = "(?:" + "|".join(alternatives) + ")"
    return pattern + "?" if on_the_way and not first else pattern


def form_matcher(root: Node | None, *, on_the_way: bool) -> re.Pattern[bytes] | None:
    """A regex over `&` + a canonical form that matches each field the paths of `root` select
    (`&name=value` for the name and every name under it), and with `on_the_way` also the names on
    a path's way (`customer` for `customer.id`). None when no form name can match."""
    names = None if root is None else _under(root, first=True, on_the_way=on_the_way)
    if names is None:
        return None
    # The whole name must match, up to `=`, the next field or the very end (`\Z`: `$` would also
    # match before a final newline): `a` selects neither `a.b` nor `a<LF>`.
    return re.compile(("&(" + names + r"(?=[=&]|\Z)[^&]*+)").encode("latin-1"))


_SLICE: Final = 64 * 1024


def _slices(body: bytes) -> Iterator[bytes]:
    """`body` in `&`-prefixed pieces of whole fields, ~64 KiB each: a regex call holds the GIL
    (and so the event loop, from a worker thread) for one piece at a time, never for the body."""
    start = 0
    while start < len(body):
        end = body.find(b"&", start + _SLICE)
        if end < 0:
            end = len(body)
        yield b"&" + body[start:end]
        start = end + 1


def form_select(body: bytes, only: re.Pattern[bytes] | None) -> bytes:
    """The fields `only` matches, in order."""
    if only is None:
        return b""
    return b"&".join(field for piece in _slices(body) for field in only.findall(piece))


def form_drop(body: bytes, ignore: re.Pattern[bytes]) -> bytes:
    """The fields `ignore` does not match, in order."""
    return b"".join(ignore.sub(b"", piece) for piece in _slices(body))[1:]
