"""Claims sent without an answer, removed in the background once the store answers again.

When a claim's reply is lost, the caller answers 503 and never runs the app, yet the claim may
have landed (or may still land: a stalled server runs the bytes waiting in its sockets when it
resumes). Left alone, that ghost claim answers the client's retry with 409 and then
`outcome-unknown` for a whole TTL although nothing ran. Both network stores therefore remember
such claims and delete them, fenced by their token, as soon as the store answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from time import monotonic
from typing import Final, Generic, TypeVar

logger = logging.getLogger("idem_asgi")
E = TypeVar("E", bound=Hashable)
MAX_PENDING: Final = 10_000
BATCH: Final = 100
DRAIN_WINDOW: Final = 10.0
"""Seconds `aclose()` spends removing unanswered claims before it gives up on them."""


class OrphanSweeper(Generic[E]):
    """Remembers unanswered claims and removes them with `remove(entry)` (a delete fenced by token).

    `remove` returns True when the entry is settled (deleted, or the key is someone else's now)
    and False when no such claim was found: that entry is checked once more after a pause before
    it is forgotten, in case its claim was still on its way to the store. Each entry is given up
    after its TTL; a `remove` that raises (store still down) is retried with backoff.
    """

    def __init__(self, remove: Callable[[E], Awaitable[bool]]) -> None:
        self._remove = remove
        self._pending: dict[E, list[float | bool]] = {}  # entry -> [give-up time, seen absent once]
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, entry: E, ttl: float) -> None:
        """Remember `entry`; start sweeping if not already."""
        if len(self._pending) >= MAX_PENDING:
            logger.warning("idem_asgi: %d unanswered claims pending; not tracking more", len(self._pending))
            return
        self._pending[entry] = [monotonic() + ttl, False]
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to sweep with
                self._task = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        delay = 0.05
        while self._pending:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0) if await self._round() else 0.5

    async def _round(self) -> bool:
        """One removal round over (a batch of) the pending claims; True when the store failed."""
        now = monotonic()
        for entry in [e for e, state in self._pending.items() if state[0] <= now]:
            del self._pending[entry]
        batch = list(self._pending.items())[:BATCH]
        results = await asyncio.gather(*(self._remove(entry) for entry, _ in batch), return_exceptions=True)
        failed = False
        for (entry, state), result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                failed = True
            elif result or state[1]:
                self._pending.pop(entry, None)
            else:
                state[1] = True  # absent: look once more next round
        return failed

    async def drain(self, within: float = DRAIN_WINDOW) -> None:
        """Remove what is pending now, round after round, for up to `within` seconds: a process that
        closes its store (a job's, exiting) must not leave a claim that nothing ran under behind,
        where it would answer `outcome-unknown` once its lease ran out."""
        deadline = monotonic() + within
        while self._pending and monotonic() < deadline:
            failed = await self._round()
            if self._pending:
                # (the store failed: try again soon; a claim not found yet: its second look, as the sweep's)
                await asyncio.sleep(min(0.25 if failed else 0.5, max(deadline - monotonic(), 0)))

    async def aclose(self) -> None:
        """Stop sweeping; say how many claims were left."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pending:
            logger.warning("idem_asgi: closing with %d unanswered claims not yet removed", len(self._pending))
