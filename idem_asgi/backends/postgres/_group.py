"""Group commit: the claims (or completions) that arrive while one is on the wire go as one statement.

No batching timer: a call that finds the wire free sends today's one-row statement at once (a batch
of one costs nothing extra); calls that arrive while a statement of their kind is on the wire queue,
and when it returns, everything queued goes as one statement over arrays (`unnest`), one round trip
and one commit for the lot. Three rules keep a batch as safe as its rows sent one by one:

- rows are sorted by key, so two batches that touch overlapping keys lock them in one order and
  never deadlock;
- results are matched to their callers by token (each claim's own, unique), never by position;
- one bad row fails the whole statement, so a batch that fails on its data (not on the store being
  unavailable) is sent again row by row, and only the bad row's caller gets the error.

One slow statement must not hold every other request of the process: when every statement on the
wire has been there longer than `STUCK_AFTER`, what queued goes at once on a lane of its own (a
lost reply, a connection stalled behind a pooler, cost one request, as without batching). The
statement runs in a task of its own: a caller cancelled while it waits leaves the batch and the
other callers alone (its claim, if made, is swept like any claim whose answer was lost).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from ...errors import BackendError, BackendUnavailable

Row = TypeVar("Row")
Args = tuple[Any, ...]
Waiting = tuple[Args, "asyncio.Future[Any]"]

MAX_BATCH: Final = 256
"""Rows per statement at most; what is queued beyond it goes in the next one."""
STUCK_AFTER: Final = 0.05
"""Seconds a statement may hold the wire before queued calls stop waiting for it. Claims and
completions answer in about a millisecond (a full batch of 256 in under 10 ms on this project's
benchmarks), so 50 ms means that statement is stuck, not busy."""


class Group(Generic[Row]):
    """Sends calls of one kind one by one while the wire is free, or, while a statement is on it,
    together as the next batch.

    `one(args)` runs the one-row statement; `many(batch)` the batched one, answering each row's
    result by its token (`args[token_at]`) or leaving it out (the caller then gets None, as from
    a one-row statement that lost a race it could not see).
    """

    __slots__ = ("_ids", "_lanes", "_many", "_one", "_queue", "_tasks", "_timer", "_token_at", "sizes", "split")

    def __init__(
        self,
        one: Callable[[Args], Awaitable[tuple[Row | None, bool]]],
        many: Callable[[Sequence[Args]], Awaitable[tuple[dict[int, Row], bool]]],
        token_at: int,
    ) -> None:
        self._one = one
        self._many = many
        self._token_at = token_at
        self._lanes: dict[int, float] = {}  # statements of this kind on the wire: id -> when sent
        self._ids = itertools.count()
        self._queue: list[Waiting] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.sizes: dict[int, int] = {}
        """How many statements carried how many rows (batch size -> count), for the benchmarks."""
        self.split = 0
        """Batches the store refused and that were sent again row by row."""

    async def run(self, args: Args) -> tuple[Row | None, bool]:
        """The row of this call (or None), and whether its statement was run again after a broken
        connection (so a row carrying our own token may be our own earlier write)."""
        if self._lanes:
            future: asyncio.Future[tuple[Row | None, bool]] = asyncio.get_running_loop().create_future()
            self._queue.append((args, future))
            if self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(STUCK_AFTER, self._unstick)
            return await future
        lane = self._open()
        try:
            self._count(1)
            return await self._one(args)
        finally:
            self._close(lane)

    def _open(self) -> int:
        lane = next(self._ids)
        self._lanes[lane] = time.monotonic()
        return lane

    def _close(self, lane: int) -> None:
        """The statement on `lane` returned: hand the wire to what queued meanwhile, as one batch."""
        del self._lanes[lane]
        self._launch()

    def _launch(self) -> None:
        queued = [w for w in self._queue if not w[1].done()]  # (a cancelled caller is dropped)
        self._queue.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not queued:
            return
        batch, rest = queued[:MAX_BATCH], queued[MAX_BATCH:]
        self._queue.extend(rest)
        lane = self._open()
        task = asyncio.get_running_loop().create_task(self._send(lane, batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if rest:
            self._timer = asyncio.get_running_loop().call_later(STUCK_AFTER, self._unstick)

    def _unstick(self) -> None:
        """Queued calls have waited `STUCK_AFTER`: if every statement on the wire is older than that,
        send them on a lane of their own; otherwise look again when the youngest one turns stuck."""
        self._timer = None
        if not self._queue:
            return
        youngest = max(self._lanes.values(), default=0.0)
        wait = youngest + STUCK_AFTER - time.monotonic()
        if wait > 0:
            self._timer = asyncio.get_running_loop().call_later(wait, self._unstick)
            return
        self._launch()

    def _count(self, size: int) -> None:
        self.sizes[size] = self.sizes.get(size, 0) + 1

    async def _send(self, lane: int, batch: list[Waiting]) -> None:
        try:
            if len(batch) == 1:
                await self._settle_one(*batch[0])
                return
            self._count(len(batch))
            try:
                rows, retried = await self._many(sorted((a for a, _ in batch), key=lambda a: a[: self._token_at]))
            except BackendUnavailable as exc:  # the store, not the data: every row fails as it would alone
                for _, future in batch:
                    if not future.done():
                        future.set_exception(_copy(exc))
                return
            except BackendError:  # a row the store refused: each row alone, so only its caller fails
                self.split += 1
                for args, future in batch:
                    await self._settle_one(args, future)
                return
            except BaseException as exc:  # cancelled (the store closing) or a bug: nobody is left waiting
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc if isinstance(exc, Exception) else BackendUnavailable(repr(exc)))
                raise
            for args, future in batch:
                if not future.done():
                    future.set_result((rows.get(args[self._token_at]), retried))
        finally:
            self._close(lane)

    async def _settle_one(self, args: Args, future: asyncio.Future[Any]) -> None:
        """Send one row alone and answer its caller."""
        if future.done():
            return
        self._count(1)
        try:
            result = await self._one(args)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)

    async def aclose(self) -> None:
        """Wait for the batches on the wire (their callers are owed an answer)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _copy(exc: BackendUnavailable) -> BackendUnavailable:
    """One exception object per waiting caller (a shared one would collect every caller's traceback)."""
    fresh = BackendUnavailable(*exc.args)
    fresh.__cause__ = exc.__cause__
    return fresh
