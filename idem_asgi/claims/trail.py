"""The history writer of one store in this process: steps queued, written in the background.

A session's step (`note`) is a dict lookup and an append: no await, no store call. The first step
queued starts one flush task, which waits `LINGER` (20 ms) and writes what queued meanwhile, then
again while steps keep coming: one store round trip per batch, however many keys, and at most one
batch per 20 ms and store in a busy process. Repeats of one kind in a
row on one key (replays, refusals, renewals) count into one step. Bounded: past `MAX_KEYS` keys
waiting, steps are dropped and counted (`dropped`); a batch the store fails is dropped and logged
once a minute. Closing the store writes what is queued first (`drain`, bounded by `DRAIN`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Final

from .._logging import throttled
from ..history import COUNTED, Step, this_process, token_prefix

if TYPE_CHECKING:
    from ..backends._protocol import Histories
    from ..records import RecordKey

MAX_KEYS: Final = 10_000
"""Keys with steps waiting to be written, at most; more are dropped (counted in `dropped`)."""
DRAIN: Final = 5.0
"""Seconds `drain` (the store closing) waits for the last batch."""
LINGER: Final = 0.02
"""Seconds a flush waits before its first batch, so a busy process writes one batch per 20 ms, not
one per step: each write costs the process a statement or script call, whatever its size."""

_STEP_OF: Final[dict[str, str]] = {
    "lease_extended": "renewed",
    "unresolved": "kept",
}
_SKIPPED: Final = frozenset({"claimed", "store_error", "rejected"})
"""Not steps: `claimed` is noted with its token when the work begins; the rest touch no record."""


class Trail:
    """Queues steps per key and writes them to `store` in background batches."""

    __slots__ = ("_flushing", "batches", "dropped", "failed", "pending", "store", "written")

    def __init__(self, store: Histories) -> None:
        self.store = store
        self.pending: dict[str, tuple[RecordKey, float, list[Step]]] = {}
        self._flushing: asyncio.Task[None] | None = None
        self.batches = 0  # writes sent to the store (one round trip each)
        self.written = 0  # steps the store took
        self.dropped = 0  # steps dropped: too many keys waiting
        self.failed = 0  # steps the store failed to take

    def event(self, key: RecordKey, name: str, token: int, status: int | None, ttl: float) -> None:
        """A session's event, as a step of its key's history (or nothing: see `_SKIPPED`)."""
        if name not in _SKIPPED:
            self.note(key, _STEP_OF.get(name, name), token, status, ttl)

    def note(self, key: RecordKey, what: str, token: int, status: int | None, ttl: float) -> None:
        """Queue one step for `key` (kept `ttl` seconds at least); no await, no store call."""
        waiting = self.pending.get(key.digest)
        if waiting is None:
            if len(self.pending) >= MAX_KEYS:
                self.dropped += 1
                return
            waiting = self.pending[key.digest] = (key, ttl, [])
        steps = waiting[2]
        prefix = token_prefix(token) if token else ""
        if steps and what in COUNTED:
            last = steps[-1]
            if last.what == what and last.token == prefix:
                last.n += 1  # a repeat of the last step: counted, no step made
                return
        steps.append(Step(time.time(), what, token=prefix, status=status))
        if self._flushing is None:
            # (no running loop: a synchronous caller; the next step's flush takes it)
            with contextlib.suppress(RuntimeError):
                self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self, linger: float = LINGER) -> None:
        try:
            while self.pending:
                if linger:
                    await asyncio.sleep(linger)
                batch, self.pending = self.pending, {}
                by = this_process()
                count = 0
                for _, _, steps in batch.values():
                    for step in steps:
                        step.by = step.by or by
                    count += len(steps)
                self.batches += 1
                try:
                    await self.store.write_history(list(batch.values()))
                except Exception as exc:
                    self.failed += count
                    throttled(logging.WARNING, f"idem_asgi: key histories not written (the store failed: {exc!r})")
                else:
                    self.written += count
        finally:
            self._flushing = None

    async def drain(self) -> None:
        """Write what is queued (the store is closing), waiting at most `DRAIN` seconds."""
        if self.pending and self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush(0.0))
        task = self._flushing
        if task is not None:
            # Timed out or failed: what was queued is lost, as it would be in a crash.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), DRAIN)
