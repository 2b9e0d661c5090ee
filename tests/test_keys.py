"""Parsing the Idempotency-Key header, and the ready-made scope callables."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idem_asgi.errors import MalformedKey
from idem_asgi.http.keys import (
    MAX_KEY_LENGTH,
    parse_key,
    scope_from_header,
    scope_from_state,
    scope_from_token_hash,
)

VISIBLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
OUTSIDE = st.characters(max_codepoint=0xFF).filter(lambda c: not 0x21 <= ord(c) <= 0x7E)
keys = st.text(VISIBLE, min_size=1, max_size=MAX_KEY_LENGTH)


def sf_string(key: str) -> bytes:
    """The key as an RFC 8941 structured-field string."""
    return b'"' + key.replace("\\", "\\\\").replace('"', '\\"').encode("ascii") + b'"'


# --- properties ------------------------------------------------------------------------------


@given(keys.filter(lambda k: not k.startswith('"')))
def test_any_visible_token_is_accepted_unchanged(key: str) -> None:
    assert parse_key(key.encode("ascii")) == key


@given(keys)
def test_quoted_sf_string_round_trips(key: str) -> None:
    assert parse_key(sf_string(key)) == key


@given(st.text(VISIBLE, min_size=1, max_size=40), OUTSIDE, st.text(VISIBLE, min_size=1, max_size=40))
def test_a_character_outside_the_range_is_rejected(prefix: str, bad: str, suffix: str) -> None:
    with pytest.raises(MalformedKey):
        parse_key((prefix + bad + suffix).encode("latin-1"))


@given(st.text(VISIBLE, max_size=20), OUTSIDE.filter(lambda c: c not in " \t"), st.text(VISIBLE, max_size=20))
def test_a_character_outside_the_range_is_rejected_anywhere(prefix: str, bad: str, suffix: str) -> None:
    with pytest.raises(MalformedKey):
        parse_key((prefix + bad + suffix).encode("latin-1"))


@given(st.text(VISIBLE, min_size=MAX_KEY_LENGTH + 1, max_size=MAX_KEY_LENGTH + 300))
def test_longer_than_255_is_rejected_bare_or_quoted(key: str) -> None:
    if not key.startswith('"'):
        with pytest.raises(MalformedKey, match="longer"):
            parse_key(key.encode("ascii"))
    with pytest.raises(MalformedKey, match="longer"):
        parse_key(sf_string(key))


# --- examples --------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b" ", b"\t", b'""', b'" "'])
def test_empty_key_is_rejected(raw: bytes) -> None:
    with pytest.raises(MalformedKey):
        parse_key(raw)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'"abc"', "abc"),
        (b'"a\\"b"', 'a"b'),
        (b'"a\\\\b"', "a\\b"),
        (b'a"b', 'a"b'),  # a quote inside a bare token is just a character
        (b"8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"),
        (b"  padded\t", "padded"),  # surrounding whitespace is not part of an HTTP field value
    ],
)
def test_examples_parse(raw: bytes, key: str) -> None:
    assert parse_key(raw) == key


@pytest.mark.parametrize(
    "raw",
    [
        b'"unterminated',
        b'"a"b',  # trailing junk after the closing quote
        b'"bad \\x escape"',
        b'"caf\xe9"',
        b'"two words"',  # a valid sf-string, but the key it carries holds a space
        b'"\\"',
    ],
)
def test_a_broken_quoted_string_is_rejected_not_guessed(raw: bytes) -> None:
    # A value that opens a quote is read as a structured-field string; a broken one is refused
    # rather than reinterpreted as a bare token, so `"abc` can never be the same key as `abc`.
    with pytest.raises(MalformedKey):
        parse_key(raw)


def test_exactly_255_characters_is_accepted_bare_and_quoted() -> None:
    key = "k" * MAX_KEY_LENGTH
    assert parse_key(key.encode()) == key
    assert parse_key(sf_string(key)) == key


# --- scope callables -------------------------------------------------------------------------


def scope_with(headers: list[tuple[bytes, bytes]], state: dict[str, Any] | None = None) -> dict[str, Any]:
    scope: dict[str, Any] = {"type": "http", "headers": headers}
    if state is not None:
        scope["state"] = state
    return scope


def test_scope_from_header_reads_the_named_header() -> None:
    of = scope_from_header("X-Tenant-Id")
    assert of(scope_with([(b"x-other", b"no"), (b"x-tenant-id", b"acme")])) == "acme"
    assert of(scope_with([])) is None


def test_scope_from_state_reads_what_an_auth_middleware_set() -> None:
    of = scope_from_state("user_id")
    assert of(scope_with([], {"user_id": 42})) == "42"
    assert of(scope_with([], {})) is None
    assert of(scope_with([])) is None


def test_scope_from_token_hash_hides_the_credential() -> None:
    of = scope_from_token_hash()
    token = b"Bearer s3cret"
    owner = of(scope_with([(b"authorization", token)]))
    assert owner == hashlib.sha256(token).hexdigest()
    assert owner != of(scope_with([(b"authorization", b"Bearer other")]))
    assert of(scope_with([])) is None
