"""In-process store: the embedded default, for development, tests and single-process apps.

Each operation runs without an await, so it is atomic under asyncio; a threading lock keeps it
safe when several event loops share one instance. Records are evicted at their expiry, and the
oldest completed answer goes first once `max_entries` is reached (in-progress records are never
evicted; a store full of them answers 503). Records are per process: two workers never see each
other's keys, so use Redis or Postgres as soon as you run more than one process.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Callable
from types import TracebackType

from ..errors import BackendUnavailable, ConfigurationError
from ..records import COMPLETED, IN_PROGRESS, Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse


class MemoryBackend:
    """Records in a dict, bounded by TTL eviction and `max_entries`."""

    def __init__(self, *, max_entries: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        if max_entries < 1:
            # With no room at all, eviction would loop over an empty dict (StopIteration in a coroutine).
            raise ConfigurationError(f"max_entries must be at least 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._clock = clock
        self._records: dict[str, Record] = {}
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
            del self._records[digest]
            return None
        return rec

    def _put(self, digest: str, rec: Record, now: float) -> None:
        if digest not in self._records:
            self._evict(now)
        self._records[digest] = rec
        heapq.heappush(self._expiry, (rec.expires_at, digest))

    def _evict(self, now: float) -> None:
        heap, records = self._expiry, self._records
        while heap and heap[0][0] <= now:
            _, digest = heapq.heappop(heap)
            rec = records.get(digest)
            if rec is not None and rec.expires_at <= now:
                del records[digest]
        if len(records) >= self.max_entries:
            # Forget the oldest *completed* answer; a running operation is never forgotten, since
            # its duplicate would then run a second time. Full of running operations: refuse (503).
            victim = next((d for d, r in records.items() if r.state == COMPLETED), None)
            if victim is None:
                raise BackendUnavailable(f"memory store full: {len(records)} operations in progress")
            del records[victim]
        if len(heap) > 2 * len(records) + 1024:
            self._expiry = [(r.expires_at, d) for d, r in records.items()]
            heapq.heapify(self._expiry)

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        with self._lock:
            now = self._clock()
            rec = self._live(key.digest, now)
            if rec is not None:
                return Existing(rec, now)
            token = random.getrandbits(62) + 1
            self._put(key.digest, Record(IN_PROGRESS, fingerprint, token, now + lease, now + ttl), now)
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
            self._put(key.digest, Record(IN_PROGRESS, fingerprint, token, now + lease, now + ttl), now)
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
            heapq.heappush(self._expiry, (now + ttl, key.digest))
            return True

    async def release(self, key: RecordKey, token: int) -> bool:
        with self._lock:
            if self._held(key, token, self._clock()) is None:
                return False
            del self._records[key.digest]
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

    async def aclose(self) -> None:
        """Nothing to close; kept for the protocol."""
