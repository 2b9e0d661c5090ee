"""Fingerprints: what makes two requests the same operation."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from idem_asgi.http.fingerprint import SHORT_BODY, FingerprintRule, JsonIgnoring, RawBody, custom

methods = st.text(string.ascii_uppercase, min_size=1, max_size=8)
paths = st.text(min_size=1, max_size=40).map(lambda p: "/" + p)
queries = st.binary(max_size=40)
bodies = st.binary(max_size=300)
requests = st.tuples(methods, paths, queries, bodies)


def fingerprint(
    rule: FingerprintRule,
    method: str = "POST",
    path: str = "/payments",
    query: bytes = b"",
    chunks: Sequence[bytes] = (b"",),
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> bytes:
    """Feed a request to a rule the way the middleware does: scope first, then body chunks."""
    scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": list(headers)}
    hasher = rule.begin(scope)
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.digest()


def split(body: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(body) + 1) for c in cuts})
    return [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]


# --- RawBody (the default) -------------------------------------------------------------------


@given(requests)
def test_equal_inputs_give_equal_digests(request: tuple[str, str, bytes, bytes]) -> None:
    method, path, query, body = request
    assert fingerprint(RawBody(), method, path, query, [body]) == fingerprint(RawBody(), method, path, query, [body])


@given(requests, requests)
def test_any_change_of_method_path_query_or_body_changes_it(
    a: tuple[str, str, bytes, bytes], b: tuple[str, str, bytes, bytes]
) -> None:
    assume(a != b)
    assert fingerprint(RawBody(), a[0], a[1], a[2], [a[3]]) != fingerprint(RawBody(), b[0], b[1], b[2], [b[3]])


@pytest.mark.parametrize("part", ["method", "path", "query", "body"])
@given(base=requests, other=requests)
def test_changing_one_part_alone_changes_it(
    part: str, base: tuple[str, str, bytes, bytes], other: tuple[str, str, bytes, bytes]
) -> None:
    index = ["method", "path", "query", "body"].index(part)
    assume(base[index] != other[index])
    m, p, q, b = base
    m2, p2, q2, b2 = (
        other[0] if index == 0 else m,
        other[1] if index == 1 else p,
        other[2] if index == 2 else q,
        other[3] if index == 3 else b,
    )
    assert fingerprint(RawBody(), m, p, q, [b]) != fingerprint(RawBody(), m2, p2, q2, [b2])


@given(bodies, st.lists(st.integers(min_value=0), max_size=8))
def test_chunking_of_the_body_never_changes_it(body: bytes, cuts: list[int]) -> None:
    for rule in (RawBody(), JsonIgnoring("ts")):
        assert fingerprint(rule, chunks=split(body, cuts)) == fingerprint(rule, chunks=[body])


@given(requests, st.integers(min_value=0, max_value=2 * SHORT_BODY), st.lists(st.integers(min_value=0), max_size=8))
def test_a_body_in_one_piece_gets_the_digest_it_gets_in_chunks(
    request: tuple[str, str, bytes, bytes], size: int, cuts: list[int]
) -> None:
    """`RawBody.whole` (one message: CPython's sha256 below SHORT_BODY, OpenSSL's above) and the
    incremental hasher (a body in chunks) must agree, or a retry sent in other chunks would get 422."""
    method, path, query, body = request
    body = (body * (size // max(len(body), 1) + 1))[:size] if body else bytes(size)
    for rule in (RawBody(), RawBody(headers=["X-Account"])):
        headers = [(b"x-account", b"7")]
        scope = {"type": "http", "method": method, "path": path, "query_string": query, "headers": headers}
        chunked = fingerprint(rule, method, path, query, split(body, cuts), headers)
        assert rule.whole(scope, body) == chunked


def test_parts_cannot_slide_into_each_other() -> None:
    rule = RawBody()
    assert fingerprint(rule, path="/a", query=b"b") != fingerprint(rule, path="/ab", query=b"")
    assert fingerprint(rule, path="/a", query=b"") != fingerprint(rule, path="/", query=b"a")
    assert fingerprint(rule, query=b"x", chunks=[b""]) != fingerprint(rule, query=b"", chunks=[b"x"])


def test_listed_headers_count_and_others_do_not() -> None:
    rule = RawBody(headers=["X-Account"])
    base = fingerprint(rule, headers=[(b"x-account", b"1")])
    assert fingerprint(rule, headers=[(b"x-account", b"2")]) != base
    assert fingerprint(rule, headers=[]) != base
    assert fingerprint(rule, headers=[(b"x-account", b"1"), (b"x-request-id", b"abc")]) == base
    assert fingerprint(RawBody(), headers=[(b"x-account", b"1")]) == fingerprint(RawBody(), headers=[])


# --- JsonIgnoring ----------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=10)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
)
documents = st.dictionaries(st.text(string.ascii_lowercase, min_size=1, max_size=6), json_values, max_size=6)


@given(documents, json_values, json_values, st.randoms(use_true_random=False))
def test_json_ignoring_ignores_listed_fields_key_order_and_whitespace(
    doc: dict[str, Any], ts_a: Any, ts_b: Any, rnd: Any
) -> None:
    rule = JsonIgnoring("ts", "nonce")
    a = {**doc, "ts": ts_a, "nonce": "n-1"}
    items = list({**doc, "ts": ts_b}.items())
    rnd.shuffle(items)
    b = dict(items)  # other key order, other ts, no nonce at all
    compact = json.dumps(a, separators=(",", ":")).encode()
    spaced = json.dumps(b, indent=3).encode()
    assert fingerprint(rule, chunks=[compact]) == fingerprint(rule, chunks=[spaced])


@given(documents, json_values)
def test_json_ignoring_still_sees_every_other_field(doc: dict[str, Any], value: Any) -> None:
    assume(doc.get("amount", object()) != value)
    rule = JsonIgnoring("ts")
    changed = {**doc, "amount": value}
    assume(json.dumps(changed, sort_keys=True) != json.dumps(doc, sort_keys=True))
    assert fingerprint(rule, chunks=[json.dumps(doc).encode()]) != fingerprint(
        rule, chunks=[json.dumps(changed).encode()]
    )


def test_json_ignoring_only_ignores_top_level_fields() -> None:
    rule = JsonIgnoring("ts")
    a = fingerprint(rule, chunks=[b'{"amount":1,"meta":{"ts":1}}'])
    b = fingerprint(rule, chunks=[b'{"amount":1,"meta":{"ts":2}}'])
    assert a != b


def test_json_ignoring_hashes_a_non_json_body_as_raw_bytes() -> None:
    rule = JsonIgnoring("ts")
    assert fingerprint(rule, chunks=[b"amount=1"]) == fingerprint(rule, chunks=[b"amount=", b"1"])
    assert fingerprint(rule, chunks=[b"amount=1"]) != fingerprint(rule, chunks=[b"amount=2"])
    assert fingerprint(rule, chunks=[b"not json {"]) != fingerprint(rule, chunks=[b"not json  {"])


def test_json_ignoring_still_covers_method_path_and_query() -> None:
    rule = JsonIgnoring("ts")
    body = [b'{"a":1}']
    base = fingerprint(rule, chunks=body)
    assert fingerprint(rule, method="PATCH", chunks=body) != base
    assert fingerprint(rule, path="/refunds", chunks=body) != base
    assert fingerprint(rule, query=b"dry_run=1", chunks=body) != base


@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 50_000, b"1" * 10_000, b"1e999999"])
def test_json_ignoring_survives_hostile_bodies(body: bytes) -> None:
    # Never an exception (the middleware would answer 500): deep nesting, huge numbers.
    assert len(fingerprint(JsonIgnoring("ts"), chunks=[body])) == 32


# --- custom ----------------------------------------------------------------------------------


def test_custom_rule_gets_the_scope_and_the_whole_body() -> None:
    seen: list[tuple[str, bytes]] = []

    def rule(scope: Any, body: bytes) -> bytes:
        seen.append((scope["path"], body))
        return b"fixed"

    assert fingerprint(custom(rule), path="/x", chunks=[b"ab", b"cd"]) == b"fixed"
    assert seen == [("/x", b"abcd")]
