"""`Fields`: bodies compared field by field (dotted paths, array items; JSON and form bodies), unit
by unit and through the middleware on every store."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import idem_asgi.http.fields
from idem_asgi import Fields
from idem_asgi.backends import Backend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http.problems import FINGERPRINT_MISMATCH
from tests.support.charges import Payments, post, protect
from tests.support.fields_rule import FORM, FloatText, dumps, form_equal, json_equal, json_loads, render_path
from tests.support.problems import assert_problem
from tests.test_fingerprint import fingerprint

ORDER: dict[str, Any] = {
    "amount": 1999,
    "currency": "EUR",
    "customer": {"id": "cus_1", "session": "s-1"},
    "items": [{"sku": "a", "price": 1000, "note": "x"}, {"sku": "b", "price": 999, "note": "y"}],
    "sent_at": "2026-12-01T10:00:00Z",
}


def fp(rule: Fields, doc: Any, headers: list[tuple[bytes, bytes]] | None = None) -> bytes:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return fingerprint(rule, chunks=[body], headers=headers or [])


def changed(path: list[Any], value: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(json.dumps(ORDER))
    target: Any = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return doc


def test_ignore_drops_nested_fields_and_array_items_fields() -> None:
    rule = Fields(ignore=["sent_at", "customer.session", "items[].note"])
    base = fp(rule, ORDER)
    for path in (["sent_at"], ["customer", "session"], ["items", 0, "note"], ["items", 1, "note"]):
        assert fp(rule, changed(path, "other")) == base, path
    for path in (["amount"], ["customer", "id"], ["items", 1, "price"], ["items", 0, "sku"]):
        assert fp(rule, changed(path, "other")) != base, path


def test_only_compares_just_the_listed_fields() -> None:
    rule = Fields(only=["amount", "currency", "items[].price", "customer.id"])
    base = fp(rule, ORDER)
    for path in (["sent_at"], ["customer", "session"], ["items", 0, "note"], ["items", 1, "sku"]):
        assert fp(rule, changed(path, "other")) == base, path
    for path in (["amount"], ["currency"], ["items", 0, "price"], ["customer", "id"]):
        assert fp(rule, changed(path, 5)) != base, path
    assert fp(Fields(only=["items[1].price"]), changed(["items", 0, "price"], 1)) == fp(
        Fields(only=["items[1].price"]), ORDER
    )


def test_semantic_json_equality_but_types_order_and_absence_count() -> None:
    rule = Fields(ignore=["sent_at"])
    reordered = json.dumps(dict(reversed(list(ORDER.items()))), indent=4).encode()
    assert fp(rule, reordered) == fp(rule, ORDER)  # key order, whitespace
    assert fp(rule, changed(["amount"], "1999")) != fp(rule, ORDER)  # a string is not a number
    swapped = changed(["items"], list(reversed(ORDER["items"])))
    assert fp(rule, swapped) != fp(rule, ORDER)  # array order matters
    missing = {k: v for k, v in ORDER.items() if k != "currency"}
    assert fp(rule, missing) != fp(rule, changed(["currency"], None))  # absent is not null


def test_form_bodies_are_compared_by_fields() -> None:
    rule = Fields(ignore=["metadata[nonce]", "expand[]"])
    body = b"amount=1999&currency=eur&metadata[order_id]=o_1&metadata[nonce]=n1&expand[]=customer"
    same = b"currency=eur&metadata[nonce]=n2&amount=1999&metadata[order_id]=o_1"  # reordered, nonce differs
    other = b"amount=2000&currency=eur&metadata[order_id]=o_1"
    assert fp(rule, body, FORM) == fp(rule, same, FORM)
    assert fp(rule, other, FORM) != fp(rule, body, FORM)
    only = Fields(only=["amount", "items[].price"])
    a = b"amount=5&items[0][price]=1&items[0][note]=x&items[1][price]=2"
    b = b"items[1][price]=2&amount=5&items[0][note]=y&items[0][price]=1"
    assert fp(only, a, FORM) == fp(only, b, FORM)
    assert fp(only, a.replace(b"[1][price]=2", b"[1][price]=3"), FORM) != fp(only, a, FORM)
    stripe = b"amount=5&items%5B0%5D%5Bprice%5D=1&items%5B0%5D%5Bnote%5D=z&items%5B1%5D%5Bprice%5D=2"
    assert fp(only, stripe, FORM) == fp(only, a, FORM)  # brackets escaped, as Stripe's clients send them


# --- the collisions of issue 25: each pair is two different requests -----------------------------

COLLIDING: list[tuple[str, Fields, bytes, bytes, bool]] = [
    # (what, rule, first body, second body, form?)
    (
        "repeated form fields keep their order",
        Fields(only=["amount"]),
        b"amount=5&amount=6",
        b"amount=6&amount=5",
        True,
    ),
    ("repeated form fields, ignore=", Fields(ignore=["nonce"]), b"amount=5&amount=6", b"amount=6&amount=5", True),
    (
        "one [] array keeps its order",
        Fields(ignore=["nonce"]),
        b"i[][p]=1&i[][q]=x&i[][p]=2",
        b"i[][p]=1&i[][p]=2&i[][q]=x",
        True,
    ),
    ("null is not an empty list", Fields(only=["items[].price"]), b'{"items": null}', b'{"items": []}', False),
    ("a.b is not a[b]", Fields(ignore=["nonce"]), b"a.b=1", b"a[b]=1", True),
    (
        "only= compares the value present",
        Fields(only=["customer.id"]),
        b'{"customer": "cus_1"}',
        b'{"customer": "cus_2"}',
        False,
    ),
    ("the value present, in a form", Fields(only=["customer.id"]), b"customer=cus_1", b"customer=cus_2", True),
    (
        "an array's length counts",
        Fields(only=["items[].price"]),
        b'{"items": [{"price": 1}, {"sku": 2}]}',
        b'{"items": [{"price": 1}]}',
        False,
    ),
    (
        "floats are not rounded",
        Fields(ignore=["nonce"]),
        b'{"amount": 0.1}',
        b'{"amount": 0.10000000000000000001}',
        False,
    ),
    ("a float is not an int", Fields(ignore=["nonce"]), b'{"amount": 1e0}', b'{"amount": 1}', False),
    ("a ; splits fields for some parsers", Fields(only=["amount"]), b"a=1;amount=5", b"a=1;amount=6", True),
    ("an escaped name is the name", Fields(only=["amount"]), b"%61mount=5", b"%61mount=6", True),
    ("a newline ends no name", Fields(ignore=["a"]), b"x=1&a%0A", b"x=1", True),
]


@pytest.mark.parametrize(("what", "rule", "first", "second", "form"), COLLIDING, ids=[c[0] for c in COLLIDING])
def test_different_requests_never_share_a_fingerprint(
    what: str, rule: Fields, first: bytes, second: bytes, form: bool
) -> None:
    headers = FORM if form else []
    assert fp(rule, first, headers) != fp(rule, second, headers), what


def test_names_with_dots_are_addressed_in_brackets_and_dotted_digits_are_names() -> None:
    rule = Fields(only=["metadata[order.id]"])
    assert fp(rule, {"metadata": {"order.id": 1, "x": 1}}) == fp(rule, {"metadata": {"order.id": 1, "x": 2}})
    assert fp(rule, {"metadata": {"order.id": 1}}) != fp(rule, {"metadata": {"order.id": 2}})
    by_key = Fields(only=["m.0"])  # the key "0" of an object; `m[0]` is an array's first item
    assert fp(by_key, {"m": {"0": 1, "1": 5}}) == fp(by_key, {"m": {"0": 1, "1": 6}})
    assert fp(by_key, {"m": [1, 5]}) != fp(by_key, {"m": [1, 6]})  # not the shape named: compared whole


# --- the documented rule as a property: equal fingerprints exactly when the rule says equal --------

NAMES = ["a", "b", "items", "price", "a.b", "0", "x y"]
FLOATS = ["1.0", "1.00", "1e0", "10e-1", "0.1", "-0.0"]  # four spellings of one float, then others
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-2, 2)
    | st.sampled_from(["", "x", "0", "1", "é"])
    | st.sampled_from(FLOATS).map(FloatText)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(NAMES), inner, max_size=3),
    max_leaves=8,
)
segments = st.sampled_from(NAMES) | st.sampled_from([0, 1, None])
paths = st.lists(segments, min_size=1, max_size=3).map(tuple)
rules = st.tuples(st.lists(paths, max_size=2), st.lists(paths, max_size=2)).filter(lambda r: bool(r[0] or r[1]))
Rule = tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]


def along(draw: st.DrawFn, path: tuple[Any, ...]) -> Any:
    """A value with something at `path`, or (sometimes) another shape on the way."""
    if not path or draw(st.integers(0, 6)) == 0:
        return draw(values)
    seg, rest = path[0], path[1:]
    if isinstance(seg, str):
        out = draw(st.dictionaries(st.sampled_from(NAMES), values, max_size=1))
        out[seg] = along(draw, rest)
        return out
    size = draw(st.integers(0, 3)) if seg is None else seg + draw(st.integers(0, 2))
    return [along(draw, rest) for _ in range(size)]


def merged(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {**b, **{k: merged(v, b[k]) if k in b else v for k, v in a.items()}}
    return a


def nodes(value: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            found += nodes(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += nodes(v, (*at, i))
    return found


def get(value: Any, at: tuple[Any, ...]) -> Any:
    for step in at:
        value = value[step]
    return value


def changed_at(value: Any, at: tuple[Any, ...], change: Any) -> Any:
    if not at:
        return change(value)
    head, rest = at[0], at[1:]
    if isinstance(value, dict):
        out = dict(value)
        if not rest and change is None:
            del out[head]
        else:
            out[head] = changed_at(value[head], rest, change)
        return out
    return [changed_at(v, rest, change) if i == head else v for i, v in enumerate(value)]


@st.composite
def json_pair(draw: st.DrawFn, rule: Rule) -> tuple[Any, Any]:
    """A body built along the rule's paths, and the same body with one node changed (or not)."""
    doc = draw(values)
    for path in rule[0] + rule[1]:
        doc = merged(along(draw, path), doc)
    how = draw(st.sampled_from(["replace", "respell", "empty", "delete", "reorder", "append"]))
    kind = {"respell": FloatText, "reorder": dict, "append": list}.get(how, object)
    fitting = [at for at in nodes(doc) if isinstance(get(doc, at), kind)]  # where the change can bite
    at = draw(st.sampled_from(fitting or nodes(doc)))
    if how == "delete" and at and isinstance(at[-1], str):  # a key of an object
        return doc, changed_at(doc, at, None)
    if how == "respell":  # the same float, written another way (or, for the rest, an equal value)
        return doc, changed_at(
            doc, at, lambda v: FloatText(draw(st.sampled_from(FLOATS[:4]))) if isinstance(v, FloatText) else v
        )
    if how == "empty":
        return doc, changed_at(doc, at, lambda v: draw(st.sampled_from([None, [], {}, ""])))
    if how == "reorder":
        return doc, changed_at(doc, at, lambda v: dict(reversed(list(v.items()))) if isinstance(v, dict) else v)
    if how == "append":
        return doc, changed_at(doc, at, lambda v: [*v, draw(values)] if isinstance(v, list) else v)
    return doc, changed_at(doc, at, lambda v: draw(values))


@settings(max_examples=400, deadline=None)
@given(st.data(), rules)
def test_json_fingerprints_are_equal_exactly_when_the_documented_rule_says(data: st.DataObject, rule: Rule) -> None:
    only, ignore = rule
    fields = Fields(only=[render_path(p) for p in only], ignore=[render_path(p) for p in ignore])
    doc, other = data.draw(json_pair(rule))
    a, b = dumps(doc).encode(), dumps(other).encode()
    same = json_equal(json_loads(a), json_loads(b), only, ignore)
    assert (fp(fields, a) == fp(fields, b)) == same, (a, b, only, ignore)


def form_name(draw: st.DrawFn, path: tuple[Any, ...]) -> str:
    """A form field name along `path` (cut short or run on, sometimes), or an odd one."""
    if not path or not isinstance(path[0], str) or draw(st.integers(0, 5)) == 0:
        return draw(
            st.sampled_from(
                ["a", "a[]", "a[][p]", "a.b", "b", "", "a[", "a]b", "[x]", "a[b]c", "a[00]", "a[x.y]", "a\n"]
            )
        )
    cut = draw(st.integers(1, len(path)))
    name = path[0]
    for seg in path[1:cut]:
        name += (
            "["
            + (
                ""
                if seg is None and draw(st.booleans())
                else str(draw(st.sampled_from([0, 1])))
                if seg is None
                else str(seg)
            )
            + "]"
        )
    return name + "".join(f"[{s}]" for s in draw(st.lists(st.sampled_from(["", "", "0", "p"]), max_size=2)))


TEXTS = ["", "a", "A", "%41", "5", "a b", "a+b", "%", "%25", "%C3%A9", "é", "=", "&", "x;y"]
TWINS = {"A": "%41", "%41": "A", "%": "%25", "%25": "%", "é": "%C3%A9", "%C3%A9": "é", "a b": "a+b", "a+b": "a b"}
"""Texts that an encoding slip could confuse: the literal text of an escape, and what it stands for."""


def encoded(draw: st.DrawFn, text: str) -> str:
    """`text` percent-encoded the way some client might: each byte raw, escaped (either case) or `+`."""
    out = []
    for byte in text.encode("utf-8"):
        char = chr(byte)
        forced = char in "&=%+;" or byte >= 0x80  # would split, or is not ASCII: always escaped
        how = "escape" if forced else draw(st.sampled_from(["raw", "escape", "lower"]))
        if char == " " and draw(st.booleans()):
            out.append("+")
        elif how == "raw":
            out.append(char)
        elif how == "lower":
            out.append(f"%{byte:02x}")
        else:
            out.append(f"%{byte:02X}")
    return "".join(out)


@st.composite
def form_pair(draw: st.DrawFn, rule: Rule) -> tuple[bytes, bytes]:
    """A form body with fields along the rule's paths, and one changed (or reordered, or not)."""
    along = rule[0] + rule[1] or [()]
    field = st.builds(
        lambda p, v, has: (form_name(draw, p), v, has), st.sampled_from(along), st.sampled_from(TEXTS), st.booleans()
    )
    fields = draw(st.lists(field, max_size=5))

    def body(fields: list[tuple[str, str, bool]]) -> bytes:
        parts = [encoded(draw, n) + ("=" + encoded(draw, v) if has or v else "") for n, v, has in fields]
        if draw(st.booleans()):
            parts.insert(draw(st.integers(0, len(parts))), "")  # an empty field
        return "&".join(parts).encode("ascii")

    change = draw(st.sampled_from(["same", "swap", "reverse", "value", "twin", "drop", "copy", "repeat", "semicolon"]))
    if change == "repeat" and fields:  # one name (or one `[]` array) twice, in the other order in the other body
        arrays = [i for i, f in enumerate(fields) if "[]" in f[0]]
        i = draw(st.sampled_from(arrays or range(len(fields))))
        name = fields[i][0]
        sibling = name[: name.find("[]") + 2] + draw(st.sampled_from(["", "[p]"])) if "[]" in name else name
        fields.insert(i + 1, (sibling, draw(st.sampled_from(TEXTS)), True))
        other = list(fields)
        other[i], other[i + 1] = other[i + 1], other[i]
    else:
        other = list(fields)
    if change == "reverse":
        other.reverse()
    elif change == "swap" and len(other) > 1:
        i = draw(st.integers(0, len(other) - 2))
        other[i], other[i + 1] = other[i + 1], other[i]
    elif change == "value" and other:
        i = draw(st.integers(0, len(other) - 1))
        other[i] = (other[i][0], draw(st.sampled_from(TEXTS)), other[i][2])
    elif change == "twin" and any(v in TWINS for _, v, _ in other):
        i = draw(st.sampled_from([i for i, f in enumerate(other) if f[1] in TWINS]))
        other[i] = (other[i][0], TWINS[other[i][1]], other[i][2])
    elif change == "drop" and other:
        del other[draw(st.integers(0, len(other) - 1))]
    elif change == "copy" and other:
        other.append(other[draw(st.integers(0, len(other) - 1))])
    first, second = body(fields), body(other)
    return first, second + b";" if change == "semicolon" else second


@settings(max_examples=400, deadline=None)
@given(st.data(), rules)
@example(data=None, rule=([], [("a",), ("a.b",)]))  # `a` must not select the name `a.b`
def test_form_fingerprints_are_equal_exactly_when_the_documented_rule_says(data: Any, rule: Rule) -> None:
    only, ignore = rule
    fields = Fields(only=[render_path(p) for p in only], ignore=[render_path(p) for p in ignore])
    a, b = (b"a.b&a&a&a", b"a.b&a&a&a&a.b") if data is None else data.draw(form_pair(rule))
    assert (fp(fields, a, FORM) == fp(fields, b, FORM)) == form_equal(a, b, only, ignore), (a, b, only, ignore)


def test_a_form_larger_than_a_slice_is_read_like_a_small_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large forms are matched in pieces of whole fields (~64 KiB; 40 bytes here, so that pieces
    end everywhere): whichever field a piece starts or ends with, it is neither lost nor split."""
    monkeypatch.setattr(idem_asgi.http.fields, "_SLICE", 40)
    only: list[tuple[Any, ...]] = [("amount",), ("items", None, "price")]
    ignore: list[tuple[Any, ...]] = [("items", 1, "price")]
    rule = Fields(only=["amount", "items[].price"], ignore=["items[1].price"])
    fields = ["amount=5"] + [f"items%5B{i}%5D%5B{name}%5D={i}" for i in range(12) for name in ("price", "note")]
    body = "&".join(fields).encode()
    for i, field in enumerate(fields):
        other = "&".join([*fields[:i], field + "0", *fields[i + 1 :]]).encode()
        expected = form_equal(body, other, only, ignore)
        assert expected == ("note" in field or "%5B1%5D%5Bprice" in field), field  # the oracle agrees with us
        assert (fp(rule, body, FORM) == fp(rule, other, FORM)) == expected, field


@given(st.binary(max_size=200) | st.sampled_from([b".", b"[]", b"..", b"[", b"a.=1", b"=&=", b"%ff=1", b'"\\ud800"']))
def test_hostile_bodies_never_raise(body: bytes) -> None:
    for rule in (Fields(ignore=["a.b"]), Fields(only=["[].x"])):
        assert len(fp(rule, body)) == 32
        assert len(fp(rule, body, FORM)) == 32


def test_method_path_and_query_still_count_and_a_non_json_body_is_raw() -> None:
    rule = Fields(ignore=["sent_at"])
    body = json.dumps(ORDER).encode()
    scope = fingerprint(rule, method="PUT", chunks=[body])
    assert scope != fingerprint(rule, chunks=[body])
    assert fingerprint(rule, query=b"a=1", chunks=[body]) != fingerprint(rule, chunks=[body])
    assert fp(rule, b"not json") != fp(rule, b"not json!")
    assert fp(rule, b"not json") == fp(rule, b"not json")


def test_two_content_types_compare_the_raw_bytes() -> None:
    rule = Fields(only=["amount"])
    both = [*FORM, (b"content-type", b"application/json")]
    assert fp(rule, b'{"amount": 1, "x": 1}', both) != fp(rule, b'{"amount": 1, "x": 2}', both)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"only=\[...\] or ignore"):
        Fields()
    with pytest.raises(ConfigurationError, match="list of paths"):
        Fields(ignore="sent_at")
    with pytest.raises(ConfigurationError, match="empty field path"):
        Fields(only=[""])
    for bad in ("...", "a..b", "a.", ".a", "a[b", "a]b", "a[0]b"):
        with pytest.raises(ConfigurationError, match="bad field path"):
            Fields(only=[bad])


async def test_through_the_middleware_on_every_store(backend: Backend, namespace: str) -> None:
    mw = protect(Payments(), backend, namespace, fingerprint=Fields(ignore=["sent_at", "items[].note"]))
    key = uuid.uuid4().hex
    first = await post(mw, key=key, body=json.dumps(ORDER).encode())
    retry = await post(mw, key=key, body=json.dumps(changed(["items", 1, "note"], "retried")).encode())
    assert first.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    reused = await post(mw, key=key, body=json.dumps(changed(["items", 1, "price"], 1)).encode())
    assert_problem(reused, FINGERPRINT_MISMATCH)


async def test_the_second_of_a_colliding_pair_is_never_answered_with_the_first(
    backend: Backend, namespace: str
) -> None:
    for what, rule, first, second, form in COLLIDING:
        app = Payments()
        mw = protect(app, backend, namespace, fingerprint=rule)
        key = uuid.uuid4().hex
        headers = {"content-type": "application/x-www-form-urlencoded" if form else "application/json"}
        assert (await post(mw, key=key, body=first, headers=headers)).status_code == 201, what
        again = await post(mw, key=key, body=second, headers=headers)
        assert_problem(again, FINGERPRINT_MISMATCH)  # never the first's charge, marked as a replay
        assert app.calls == 1, what
