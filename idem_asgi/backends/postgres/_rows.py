"""Rows of the Postgres table read back as records and keys."""

from __future__ import annotations

from typing import Any

import msgspec

from ...records import COMPLETED, IN_PROGRESS, Record, RecordKey, StoredResponse
from ...sealed_keys import KeySeal, opened
from ._keys import HASHED

_headers_decode = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]]).decode


def row_key(
    namespace: str, scope: str, key: str, store_keys: bool, seal: KeySeal | None, sealed: str | None
) -> RecordKey:
    """The key of a row: known by its digest (and its sealed key, opened with `seal`), or by raw
    columns (marked, where this backend would look it up by the digest: a row of an earlier
    version, or of an app that keeps raw keys)."""
    if key.startswith(HASHED) and not scope:
        return opened(seal, namespace, key[1:], sealed)
    built = RecordKey.build(namespace, scope, key)
    return built if store_keys else RecordKey(namespace, built.scope, key, built.digest, stored_raw=True)


def as_claimed(record: Record, token: int, fingerprint: bytes) -> bool:
    """Whether `record` is exactly the claim a statement of ours (re-run after a broken connection)
    made: our token, our fingerprint, in progress and untouched since. Only then is a stored token
    equal to ours proof of ownership; a completed or failed record never is."""
    return (
        record.token == token
        and record.fingerprint == fingerprint
        and record.state == IN_PROGRESS
        and not record.holder_failed
        and not record.effect_committed
        and not record.uncommitted
    )


def record_of(row: Any) -> Record:
    state = row[1]
    response = None
    if state == b"c" and row[6] is not None:
        trailers = None if row[12] is None else _headers_decode(row[12])
        if row[8] is None:  # shrunk to its tombstone (its replay_ttl passed): status and kept headers
            response = StoredResponse(row[6], _headers_decode(row[7]), b"", False, tombstone=True)
        else:
            response = StoredResponse(row[6], _headers_decode(row[7]), row[8], row[9], trailers, bool(row[14]))
    return Record(
        COMPLETED if state == b"c" else IN_PROGRESS,
        row[2],
        row[3],
        row[4],
        row[5],
        response,
        row[11],
        effect_committed=state in (b"e", b"f"),
        holder_failed=state in (b"u", b"f"),
        ttl=row[13],
        uncommitted=state == b"t",
    )
