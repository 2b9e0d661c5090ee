"""What is stored per idempotency key: msgspec Structs and the one encoder/decoder pair.

The record is a versioned schema: new fields are only ever appended, with defaults,
because records written by an older release must still decode (array_like layout).
"""

from __future__ import annotations

import hashlib

try:  # CPython's own sha256: the same digest as OpenSSL's, half the cost for short inputs (no EVP
    # context to set up), but several times slower per byte: for keys and small bodies only
    from _sha256 import sha256 as _builtin_sha256  # type: ignore[import-not-found]  # no stubs for the C module
except ImportError:  # pragma: no cover - other interpreters, or Python 3.12+ (_sha2)
    _builtin_sha256 = hashlib.sha256
from typing import Final, Literal

import msgspec

short_sha256: Final = _builtin_sha256
"""sha256 for short inputs (keys, small bodies); OpenSSL's `hashlib.sha256` for long ones."""

IN_PROGRESS: Final = "in_progress"
COMPLETED: Final = "completed"
State = Literal["in_progress", "completed"]

JOB_MARK: Final = (b"x-idem-job", b"1")
"""The header a job's stored result carries (`jobs.stored_result`): a job has no client that got
its answer over the wire, its result is its only outcome."""


class StoredResponse(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The application's answer, verbatim: status, header pairs in order, body bytes.

    `replayable` is False when the body exceeded the route's storable limit: the first
    client got every byte, later repeats get a `response-not-stored` problem.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    replayable: bool = True
    trailers: list[tuple[bytes, bytes]] | None = None
    """HTTP trailers the app sent after the body (`http.response.trailers`), or None when it sent none."""
    sealed: bool = False
    """Stored through the middleware's `transform` (`idem_asgi.transform.seal`): only its `load` opens it.
    False for an answer stored in clear (no transform, or one written before it was turned on)."""
    replay_for: float | None = None
    """Seconds after completion the answer's bytes are replayed (the route's `replay_ttl`, when shorter
    than its `ttl`); after them a store may shrink the record to its `tombstone()`. None: as long as
    the record lives."""
    tombstone: bool = False
    """The answer's bytes are gone (its first horizon passed): only its status and `Location` remain,
    and the record still refuses a second run of its key until it expires."""

    def tombstoned(self) -> StoredResponse:
        """What is kept of this answer after its first horizon: status, `Location` (when it is stored
        in clear: a transform that seals the headers leaves none to keep), nothing else."""
        kept = [(k, v) for k, v in self.headers if k == b"location"]
        return StoredResponse(self.status, kept, b"", False, None, False, self.replay_for, True)


class Record(msgspec.Struct, frozen=True, gc=False):
    """One idempotency record as the middleware sees it, whatever the store's own layout.

    Times are seconds since the epoch on the *store's* clock.
    """

    state: State
    fingerprint: bytes
    token: int
    lease_until: float
    expires_at: float
    response: StoredResponse | None = None
    checkpoint: str | None = None
    """The last step a handler recorded on its claim (Postgres `checkpoint()`), for recovery."""
    effect_committed: bool = False
    """In progress, and the holder's `transaction()` committed (Postgres): the effect happened once."""
    holder_failed: bool = False
    """In progress, and its holder failed after its answer started or after it marked an effect: the
    lease was ended at once, and `reclaim` never re-runs it (only recovery resolves it)."""
    ttl: float | None = None
    """The TTL (seconds) the record was claimed with, so a resolved answer is kept as long as the
    route would keep it; None for records written by a version that did not store it."""
    uncommitted: bool = False
    """In progress, and its holder was inside a `transaction()` that had not committed, with no effect
    marked before it (Postgres): if the holder is gone, nothing happened, so it is run again."""


_namespaces: dict[str, bytes] = {}  # namespace -> its length-prefixed bytes (a handful per process)


class RecordKey(msgspec.Struct, frozen=True, gc=False):
    """(namespace, scope, key) plus the digest the stores index by.

    The digest hashes a length-prefixed encoding, so `a:b`+`c` and `a`+`b:c` never collide
    and client-chosen characters (`{`, `*`, `:`) never reach a Redis key or a glob.
    """

    namespace: str
    scope: str
    key: str
    digest: str
    hidden: bool = False
    """Read back from a store that keeps only the digest: `scope` and `key` are "?" (not known)."""
    stored_raw: bool = False
    """Read back from a row that holds the raw scope and key (Postgres `store_keys=True`, or a row
    written before keys were hashed): the store finds it by them, whatever it was told to write."""

    @classmethod
    def hashed(cls, namespace: str, digest: str) -> RecordKey:
        """A record known only by its digest (stores keep no raw key unless `store_keys=True`)."""
        return cls(namespace, "?", "?", digest, True)

    @classmethod
    def build(cls, namespace: str, scope: str | None, key: str) -> RecordKey:
        """Make the key for (namespace, scope, key); a scope of None or "" means unscoped."""
        scope = scope or ""
        head = _namespaces.get(namespace)
        if head is None:
            ns = namespace.encode("utf-8", "surrogateescape")
            head = _namespaces[namespace] = len(ns).to_bytes(4, "big") + ns
        sc = scope.encode("utf-8", "surrogateescape") if scope else b""
        k = key.encode("utf-8", "surrogateescape")
        # One sha256 call over the joined bytes: the same digest as feeding them piece by piece,
        # with one hashlib call instead of seven (each goes through OpenSSL's EVP layer).
        data = b"".join((head, len(sc).to_bytes(4, "big"), sc, len(k).to_bytes(4, "big"), k))
        return cls(namespace, scope, key, short_sha256(data).hexdigest())


_response_encoder: Final = msgspec.msgpack.Encoder()
_response_decoder: Final = msgspec.msgpack.Decoder(StoredResponse)


def encode_response(response: StoredResponse) -> bytes:
    """Serialise a response for a store that keeps it as one blob."""
    return _response_encoder.encode(response)


def decode_response(data: bytes) -> StoredResponse:
    """Inverse of `encode_response`."""
    return _response_decoder.decode(data)


class Claimed(msgspec.Struct, frozen=True, gc=False):
    """The caller now owns the key; every later write must carry this fencing token."""

    token: int


class Existing(msgspec.Struct, frozen=True, gc=False):
    """The key was already held; `now` is the store's clock, to judge the lease by."""

    record: Record
    now: float


ClaimResult = Claimed | Existing


class StaleRecord(msgspec.Struct, frozen=True, gc=False):
    """An in-progress record whose lease ended: its holder stopped and nobody resolved it yet.

    Listed by a backend's `stale()` for the reconcile tool; `key` is the full (namespace, scope,
    key) with its digest, usable with `takeover`/`complete`/`release`.
    """

    key: RecordKey
    record: Record
    effect_committed: bool = False
    """The holder's `transaction()` committed (Postgres only): the effect happened once, only the answer was lost."""
