"""`Fields`: bodies compared field by field (dotted paths, array items; JSON and form bodies), unit
by unit and through the middleware on every store."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idem_asgi import Fields
from idem_asgi.backends import Backend
from idem_asgi.errors import ConfigurationError
from idem_asgi.problems import FINGERPRINT_MISMATCH
from tests.support.charges import Payments, post, protect
from tests.support.problems import assert_problem
from tests.test_fingerprint import fingerprint

FORM = [(b"content-type", b"application/x-www-form-urlencoded")]
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


def test_method_path_and_query_still_count_and_a_non_json_body_is_raw() -> None:
    rule = Fields(ignore=["sent_at"])
    body = json.dumps(ORDER).encode()
    scope = fingerprint(rule, method="PUT", chunks=[body])
    assert scope != fingerprint(rule, chunks=[body])
    assert fingerprint(rule, query=b"a=1", chunks=[body]) != fingerprint(rule, chunks=[body])
    assert fp(rule, b"not json") != fp(rule, b"not json!")
    assert fp(rule, b"not json") == fp(rule, b"not json")


@given(st.binary(max_size=200) | st.sampled_from([b".", b"[]", b"..", b"[", b"a.=1", b"=&=", b"%ff=1"]))
def test_hostile_bodies_never_raise(body: bytes) -> None:
    for rule in (Fields(ignore=["a.b"]), Fields(only=["[].x"])):
        assert len(fp(rule, body)) == 32
        assert len(fp(rule, body, FORM)) == 32


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"only=\[...\] or ignore"):
        Fields()
    with pytest.raises(ConfigurationError, match="list of paths"):
        Fields(ignore="sent_at")
    with pytest.raises(ConfigurationError, match="empty field path"):
        Fields(only=["..."])


async def test_through_the_middleware_on_every_store(backend: Backend, namespace: str) -> None:
    mw = protect(Payments(), backend, namespace, fingerprint=Fields(ignore=["sent_at", "items[].note"]))
    key = uuid.uuid4().hex
    first = await post(mw, key=key, body=json.dumps(ORDER).encode())
    retry = await post(mw, key=key, body=json.dumps(changed(["items", 1, "note"], "retried")).encode())
    assert first.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    reused = await post(mw, key=key, body=json.dumps(changed(["items", 1, "price"], 1)).encode())
    assert_problem(reused, FINGERPRINT_MISMATCH)
