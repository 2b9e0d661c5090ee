"""In-process store: the embedded default, for development, tests and single-process apps.

Each operation runs without an await, so it is atomic under asyncio; a threading lock keeps it
safe when several event loops share one instance. Records leave at their expiry, and only then:
an unexpired record (running or completed) is never evicted to make room, since its duplicate would
then run a second time. The store is bounded instead: by `max_entries` records, by `max_bytes` of
stored answers, and per scope by `scope_share` of both (one tenant cannot fill it for the others).
A full store refuses new claims (503; 429 for a scope over its share); an answer that does not fit
the byte budget is kept as "completed, not replayable" (the first client has it; repeats get 409
`response-not-stored`, never a second run); a job's result that does not fit keeps its claim as
outcome-unknown instead (its lease ended), which `stale()` lists for `reconcile`. Records are per
process: two workers never see each other's keys, so use Redis or Postgres as soon as you run more
than one process.
"""

from __future__ import annotations

import asyncio
import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from ..errors import ConfigurationError, StoreFull
from ..history import KEEP, Step, counted_into
from ..records import (
    COMPLETED,
    IN_PROGRESS,
    JOB_MARK,
    Claimed,
    ClaimResult,
    Existing,
    Record,
    RecordKey,
    StaleRecord,
    StoredResponse,
    decode_response,
    encode_response,
)
from ._base import ClosingMixin, new_token

_REPLAYED = 256
"""Completed records whose decoded answers the memory store keeps at once (see `_answered`)."""


class MemoryBackend(ClosingMixin):
    """Records in a dict, bounded by entries, bytes and a per-scope share; never evicted before expiry.

    Args:
        max_entries: Most records held at once (running and completed).
        max_bytes: Most bytes of stored answers held at once, as the store keeps them (bodies,
            headers, trailers, and a few bytes of framing each).
        scope_share: The fraction of `max_entries` and of `max_bytes` one scope may hold (the
            unscoped key space of single-tenant routes is exempt).
        clock: Seconds since the epoch (tests pass a fake one).
        history: Keep the last `history` steps of each key's history (`idem_asgi.history`); 0
            (the default): requests write none. Histories count towards no bound but their own:
            at most `max_entries` keys' histories are held, the oldest dropped first.
    """

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MemoryBackend:
        """`memory://`: a fresh store (the URL carries nothing else); `options` go to the constructor."""
        return cls(**options)

    def __init__(
        self,
        *,
        max_entries: int = 100_000,
        max_bytes: int = 256 << 20,
        scope_share: float = 0.25,
        clock: Callable[[], float] = time.time,
        history: int = 0,
    ) -> None:
        if history < 0:
            raise ConfigurationError(f"history must be 0 (none) or more steps, got {history!r}")
        if max_entries < 1:
            raise ConfigurationError(f"max_entries must be at least 1, got {max_entries!r}")
        if max_bytes < 1:
            raise ConfigurationError(f"max_bytes must be at least 1, got {max_bytes!r}")
        if not 0 < scope_share <= 1:
            raise ConfigurationError(f"scope_share must be in (0, 1], got {scope_share!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.scope_share = scope_share
        self._scope_entries = max(1, int(max_entries * scope_share))
        self._scope_bytes = max(1, int(max_bytes * scope_share))
        self._clock = clock
        self._records: dict[str, Record] = {}
        self._keys: dict[str, RecordKey] = {}  # digest -> its (namespace, scope, key), for stale()
        self._scopes: dict[str, list[int]] = {}  # scope -> [records, bytes]
        self._sizes: dict[str, int] = {}  # digest -> bytes of its stored answer (completed records only)
        # digest -> the stored answer, encoded: one bytes object per answer, which the garbage
        # collector never traverses (a held StoredResponse's header list would be, on every full
        # collection, so pauses would grow with the store)
        self._answers: dict[str, bytes] = {}
        # digest -> (its completed record, as callers see it): the answers replayed lately, decoded
        # once (a retry storm replays one answer many times); bounded, so the collector's work is too
        self._replayed: dict[str, tuple[Record, Record]] = {}
        self._bytes = 0
        self._expiry: list[tuple[float, str]] = []
        # (when, digest, token): completed answers to shrink to their tombstone (`replay_for`)
        self._shrinks: list[tuple[float, str, int]] = []
        self._lock = threading.Lock()
        self.history = history
        self._histories: dict[str, tuple[tuple[Step, ...], float]] = {}  # digest -> (steps, expires at)

    def __len__(self) -> int:
        return len(self._records)

    @property
    def stored_bytes(self) -> int:
        """Bytes of stored answers held now."""
        return self._bytes

    def _live(self, digest: str, now: float) -> Record | None:
        rec = self._records.get(digest)
        if rec is not None and rec.expires_at <= now:
            self._drop(digest)
            return None
        return rec

    def _answered(self, digest: str, rec: Record) -> Record:
        """`rec` as callers see it: a completed record carries its answer, decoded (once per record
        while it is among the last `_REPLAYED` replayed: callers never change what they are handed)."""
        if rec.state != COMPLETED:
            return rec
        seen = self._replayed.get(digest)
        if seen is not None and seen[0] is rec:
            return seen[1]
        answered = msgspec.structs.replace(rec, response=decode_response(self._answers[digest]))
        if len(self._replayed) >= _REPLAYED:
            self._replayed.clear()
        self._replayed[digest] = (rec, answered)
        return answered

    def _drop(self, digest: str) -> None:
        del self._records[digest]
        key = self._keys.pop(digest)
        size = self._sizes.pop(digest, 0)
        self._answers.pop(digest, None)
        self._replayed.pop(digest, None)
        self._bytes -= size
        if key.scope:
            usage = self._scopes[key.scope]
            usage[0] -= 1
            usage[1] -= size
            if usage[0] == 0:
                del self._scopes[key.scope]

    def _set(self, digest: str, rec: Record) -> None:
        """Replace an in-progress record in place (it holds no answer: no bytes change)."""
        old = self._records[digest]
        self._records[digest] = rec
        if rec.expires_at != old.expires_at:
            heapq.heappush(self._expiry, (rec.expires_at, digest))

    def _admit(self, key: RecordKey, now: float) -> None:
        """Raise StoreFull unless a new record fits the bounds (after dropping expired ones)."""
        expiry = self._expiry
        if expiry and expiry[0][0] <= now:
            self._expire(now, None)
        if self._shrinks and self._shrinks[0][0] <= now:
            self._shrink(now)
        if len(self._records) >= self.max_entries:
            raise StoreFull(f"memory store full: {len(self._records)} unexpired records (max_entries)")
        if self._bytes >= self.max_bytes:
            raise StoreFull(f"memory store full: {self._bytes} bytes of stored answers (max_bytes)")
        usage = self._scopes.get(key.scope) if key.scope else None
        if usage is not None and (usage[0] >= self._scope_entries or usage[1] >= self._scope_bytes):
            raise StoreFull("this caller holds its full share of the memory store (scope_share)", scope_quota=True)

    def _fits(self, key: RecordKey, size: int) -> bool:
        if self._bytes + size > self.max_bytes:
            return False
        usage = self._scopes.get(key.scope) if key.scope else None
        return usage is None or usage[1] + size <= self._scope_bytes

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        with self._lock:
            now = self._clock()
            digest = key.digest
            records = self._records
            rec = records.get(digest)
            if rec is not None:
                if rec.expires_at > now:
                    return Existing(self._answered(digest, rec), now)
                self._drop(digest)  # expired: treated as absent
            expiry = self._expiry
            if (
                len(records) >= self.max_entries
                or self._bytes >= self.max_bytes
                or (expiry and expiry[0][0] <= now)
                or (self._shrinks and self._shrinks[0][0] <= now)
                or (key.scope and key.scope in self._scopes)
            ):
                self._admit(key, now)  # drops what expired, then checks every bound (StoreFull)
            token = new_token()
            expires_at = now + ttl
            records[digest] = Record(IN_PROGRESS, fingerprint, token, now + lease, expires_at, ttl=ttl)
            self._keys[digest] = key
            if key.scope:
                self._scopes.setdefault(key.scope, [0, 0])[0] += 1
            heapq.heappush(expiry, (expires_at, digest))
            if len(expiry) > 2 * len(records) + 1024:
                self._expiry = [(r.expires_at, d) for d, r in records.items()]
                heapq.heapify(self._expiry)
            return Claimed(token)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        with self._lock:
            now = self._clock()
            rec = self._live(key.digest, now)
            if rec is None:
                return None  # gone: nothing to take over, and nothing is created
            token = new_token()
            fresh = Record(IN_PROGRESS, fingerprint, token, now + lease, now + ttl, ttl=ttl)
            if rec.state != IN_PROGRESS or rec.effect_committed or rec.token != stale_token or rec.lease_until > now:
                return Existing(self._answered(key.digest, rec), now)
            self._set(key.digest, fresh)
            return Claimed(token)

    def _held(self, key: RecordKey, token: int, now: float) -> Record | None:
        rec = self._live(key.digest, now)
        if rec is None or rec.state != IN_PROGRESS or rec.token != token:
            return None
        return rec

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        with self._lock:
            now = self._clock()
            digest = key.digest
            rec = self._records.get(digest)
            if rec is None or rec.expires_at <= now or rec.state != IN_PROGRESS or rec.token != token:
                if rec is not None and rec.expires_at <= now:
                    self._drop(digest)
                return False
            encoded = encode_response(response)
            size = len(encoded)  # what it holds: body, headers, trailers, and a few bytes of framing
            if not self._fits(key, size):
                if JOB_MARK in response.headers:  # a job's result is its only outcome: reconcile it
                    self._set(
                        digest, msgspec.structs.replace(rec, lease_until=min(rec.lease_until, now), holder_failed=True)
                    )
                    return True
                # Over the byte budget: keep the outcome (never run it twice), not the bytes.
                encoded, size = encode_response(StoredResponse(response.status, [], b"", replayable=False)), 0
            expires_at = now + ttl
            self._records[digest] = Record(COMPLETED, rec.fingerprint, token, now, expires_at, ttl=rec.ttl)
            self._answers[digest] = encoded
            if size:
                self._sizes[digest] = size
                self._bytes += size
                if key.scope:
                    self._scopes[key.scope][1] += size
            if expires_at < rec.expires_at:  # sooner than the claim's entry says (a shorter TTL)
                heapq.heappush(self._expiry, (expires_at, digest))
            if response.replay_for is not None and response.replay_for < ttl and size and response.replayable:
                heapq.heappush(self._shrinks, (now + response.replay_for, digest, token))
            # (later, the usual case: the claim's entry is pushed again when it comes up, in `_expire`)
            return True

    async def release(self, key: RecordKey, token: int) -> bool:
        with self._lock:
            rec = self._held(key, token, self._clock())
            if rec is None or rec.holder_failed or rec.effect_committed:
                return False
            self._drop(key.digest)
            return True

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        with self._lock:
            now = self._clock()
            rec = self._held(key, token, now)
            if rec is None or rec.holder_failed:
                return False
            deadline = now + lease
            # (and the record outlives its TTL while its holder still runs: it keeps its key)
            lease_until, expires_at = max(rec.lease_until, deadline), max(rec.expires_at, deadline)
            self._set(key.digest, msgspec.structs.replace(rec, lease_until=lease_until, expires_at=expires_at))
            return True

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        with self._lock:
            now = self._clock()
            rec = self._held(key, token, now)
            if rec is None:
                return False
            failed = msgspec.structs.replace(rec, lease_until=min(rec.lease_until, now), holder_failed=True)
            self._set(key.digest, failed)
            return True

    async def get(self, key: RecordKey) -> Record | None:
        with self._lock:
            rec = self._live(key.digest, self._clock())
            return None if rec is None else self._answered(key.digest, rec)

    def _shrink(self, now: float) -> None:
        """Keep only the tombstone of each answer past its `replay_for` (its key still refuses)."""
        heap, records = self._shrinks, self._records
        while heap and heap[0][0] <= now:
            _, digest, token = heapq.heappop(heap)
            rec = records.get(digest)
            if rec is None or rec.state != COMPLETED or rec.token != token or digest not in self._sizes:
                continue  # expired, or another record of the key since
            tomb = encode_response(decode_response(self._answers[digest]).tombstoned())
            size = self._sizes.pop(digest)
            self._answers[digest] = tomb
            self._replayed.pop(digest, None)
            self._bytes -= size
            key = self._keys[digest]
            if key.scope:
                self._scopes[key.scope][1] -= size

    def _expire(self, now: float, limit: int | None) -> int:
        """Delete up to `limit` (None: all) records past their expiry, soonest first; returns how many."""
        heap, records = self._expiry, self._records
        deleted = 0
        while heap and heap[0][0] <= now and (limit is None or deleted < limit):
            _, digest = heapq.heappop(heap)
            rec = records.get(digest)
            if rec is not None:
                if rec.expires_at <= now:
                    self._drop(digest)
                    deleted += 1
                else:  # completed (or extended) since this entry was pushed: due later
                    heapq.heappush(heap, (rec.expires_at, digest))
        return deleted

    async def stale(
        self, older_than: float = 0.0, limit: int = 1000, *, namespace: str | None = None
    ) -> list[StaleRecord]:
        """In-progress records whose lease ended more than `older_than` seconds ago, oldest first.

        A full pass over the records (under the lock): fine for the sizes this store is for.
        """
        with self._lock:
            now = self._clock()
            cutoff = now - older_than
            found = [
                StaleRecord(self._keys[digest], rec, rec.effect_committed)
                for digest, rec in self._records.items()
                if rec.state == IN_PROGRESS
                and rec.lease_until <= cutoff
                and rec.expires_at > now
                and (namespace is None or self._keys[digest].namespace == namespace)
            ]
        return heapq.nsmallest(limit, found, key=lambda s: s.record.lease_until)

    async def purge(self, batch_size: int = 1000) -> int:
        """Delete expired records, `batch_size` at a time (yielding to the event loop between batches).

        Expired records are already invisible and are dropped as new keys arrive; this only frees
        their memory sooner.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        total = 0
        while True:
            with self._lock:
                deleted = self._expire(self._clock(), batch_size)
            total += deleted
            if deleted < batch_size:
                with self._lock:
                    self._shrink(self._clock())
                    self._forget_histories(self._clock(), expired_only=True)
                return total
            await asyncio.sleep(0)

    async def write_history(self, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
        """Append each key's steps, kept as long as its record and at least `ttl` seconds.

        Kept as (tuple of steps, expiry): tuples of untracked objects, which the garbage collector
        stops traversing, so a store holding many histories costs its collections nothing."""
        with self._lock:
            now = self._clock()
            keep = self.history or KEEP
            histories = self._histories
            for key, ttl, steps in batch:
                digest = key.digest
                found = histories.get(digest)
                kept: tuple[Step, ...] = () if found is None or found[1] <= now else found[0]
                if found is None and len(histories) >= self.max_entries:
                    self._forget_histories(now)
                for step in steps:
                    step = msgspec.structs.replace(step)  # a copy: the caller's steps stay theirs
                    if not (kept and counted_into(kept[-1], step)):
                        kept = (*kept, step)
                rec = self._records.get(digest)
                until = max(now + ttl, rec.expires_at if rec is not None else 0.0)
                histories[digest] = (kept[-keep:], until if found is None or found[1] <= now else max(found[1], until))

    def _forget_histories(self, now: float, *, expired_only: bool = False) -> None:
        """Drop expired histories; if that left the bound reached, the oldest-written tenth."""
        histories = self._histories
        for digest in [d for d, (_, until) in histories.items() if until <= now]:
            del histories[digest]
        if not expired_only and len(histories) >= self.max_entries:
            for digest in list(histories)[: max(1, len(histories) // 10)]:
                del histories[digest]

    async def read_history(self, key: RecordKey) -> list[Step]:
        with self._lock:
            found = self._histories.get(key.digest)
            if found is None or found[1] <= self._clock():
                return []
            return [msgspec.structs.replace(step) for step in found[0]]  # copies: the kept ones stay the store's

    async def aclose(self) -> None:
        """Nothing to close but the writes still pending in this process (`on_close`)."""
        await self._before_close()
