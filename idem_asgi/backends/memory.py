"""In-process store: the embedded default, for development, tests and single-process apps.

Each operation runs without an await, so it is atomic under asyncio; a threading lock keeps it
safe when several event loops share one instance. Records are evicted at their expiry, and the
oldest completed answer goes first once `max_entries` is reached (in-progress records are never
evicted; a store full of them answers 503). Each record's `RecordKey` is kept beside it, so
`stale()` can name the keys of stuck claims. Records are per process: two workers never see each
other's keys, so use Redis or Postgres as soon as you run more than one process.
"""

from __future__ import annotations

import asyncio
import heapq
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from types import TracebackType

from ..errors import BackendUnavailable, ConfigurationError
from ..records import (
    COMPLETED,
    IN_PROGRESS,
    Claimed,
    ClaimResult,
    Existing,
    Record,
    RecordKey,
    StaleRecord,
    StoredResponse,
)


class MemoryBackend:
    """Records in a dict, bounded by TTL eviction and `max_entries`."""

    def __init__(self, *, max_entries: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        if max_entries < 1:
            # With no room at all, eviction would loop over an empty dict (StopIteration in a coroutine).
            raise ConfigurationError(f"max_entries must be at least 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._clock = clock
        self._records: dict[str, Record] = {}
        self._keys: dict[str, RecordKey] = {}  # digest -> its (namespace, scope, key), for stale()
        # Digests of completed records, oldest completion first, so that eviction pops the front
        # in O(1). Scanning `_records` for its first completed entry walks every slot deleted
        # since the dict was last resized: once the store is full, 50-100 us per claim at 100k.
        self._completed: OrderedDict[str, None] = OrderedDict()
        self._expiry: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    async def __aenter__(self) -> MemoryBackend:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __len__(self) -> int:
        return len(self._records)

    def _live(self, digest: str, now: float) -> Record | None:
        rec = self._records.get(digest)
        if rec is not None and rec.expires_at <= now:
            self._drop(digest)
            return None
        return rec

    def _drop(self, digest: str) -> None:
        del self._records[digest]
        self._keys.pop(digest, None)
        self._completed.pop(digest, None)

    def _put(self, key: RecordKey, rec: Record, now: float) -> None:
        digest = key.digest
        if digest not in self._records:
            self._evict(now)
        self._records[digest] = rec
        self._keys[digest] = key
        heapq.heappush(self._expiry, (rec.expires_at, digest))

    def _evict(self, now: float) -> None:
        records = self._records
        self._expire(now, None)
        if len(records) >= self.max_entries:
            # Forget the oldest *completed* answer; a running operation is never forgotten, since
            # its duplicate would then run a second time. Full of running operations: refuse (503).
            completed = self._completed
            while completed:
                victim, _ = completed.popitem(last=False)
                rec = records.get(victim)
                if rec is not None and rec.state == COMPLETED:
                    self._drop(victim)
                    break
            else:
                raise BackendUnavailable(f"memory store full: {len(records)} operations in progress")
        if len(self._expiry) > 2 * len(records) + 1024:
            self._expiry = [(r.expires_at, d) for d, r in records.items()]
            heapq.heapify(self._expiry)

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        with self._lock:
            now = self._clock()
            rec = self._records.get(key.digest)
            if rec is not None:
                if rec.expires_at > now:
                    return Existing(rec, now)
                self._drop(key.digest)  # expired: treated as absent
            token = random.getrandbits(62) + 1
            self._put(key, Record(IN_PROGRESS, fingerprint, token, now + lease, now + ttl), now)
            return Claimed(token)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult:
        with self._lock:
            now = self._clock()
            rec = self._live(key.digest, now)
            if rec is not None and not (
                rec.state == IN_PROGRESS and rec.token == stale_token and rec.lease_until <= now
            ):
                return Existing(rec, now)
            token = random.getrandbits(62) + 1
            self._put(key, Record(IN_PROGRESS, fingerprint, token, now + lease, now + ttl), now)
            return Claimed(token)

    def _held(self, key: RecordKey, token: int, now: float) -> Record | None:
        rec = self._live(key.digest, now)
        if rec is None or rec.state != IN_PROGRESS or rec.token != token:
            return None
        return rec

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        with self._lock:
            now = self._clock()
            rec = self._held(key, token, now)
            if rec is None:
                return False
            self._records[key.digest] = Record(COMPLETED, rec.fingerprint, token, now, now + ttl, response)
            self._completed[key.digest] = None
            heapq.heappush(self._expiry, (now + ttl, key.digest))
            return True

    async def release(self, key: RecordKey, token: int) -> bool:
        with self._lock:
            if self._held(key, token, self._clock()) is None:
                return False
            self._drop(key.digest)
            return True

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        with self._lock:
            now = self._clock()
            rec = self._held(key, token, now)
            if rec is None:
                return False
            self._records[key.digest] = Record(
                IN_PROGRESS, rec.fingerprint, token, max(rec.lease_until, now + lease), rec.expires_at
            )
            return True

    async def get(self, key: RecordKey) -> Record | None:
        with self._lock:
            return self._live(key.digest, self._clock())

    def _expire(self, now: float, limit: int | None) -> int:
        """Delete up to `limit` (None: all) records past their expiry, soonest first; returns how many."""
        heap, records = self._expiry, self._records
        deleted = 0
        while heap and heap[0][0] <= now and (limit is None or deleted < limit):
            _, digest = heapq.heappop(heap)
            rec = records.get(digest)
            if rec is not None and rec.expires_at <= now:
                self._drop(digest)
                deleted += 1
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
                StaleRecord(self._keys[digest], rec)
                for digest, rec in self._records.items()
                if rec.state == IN_PROGRESS
                and rec.lease_until <= cutoff
                and rec.expires_at > now
                and (namespace is None or self._keys[digest].namespace == namespace)
            ]
        return heapq.nsmallest(limit, found, key=lambda s: s.record.lease_until)

    async def purge(self, batch_size: int = 1000) -> int:
        """Delete expired records, `batch_size` at a time (yielding to the event loop between batches).

        Expired records are already invisible and are evicted as new keys arrive; this only frees
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
                return total
            await asyncio.sleep(0)

    async def aclose(self) -> None:
        """Nothing to close; kept for the protocol."""
