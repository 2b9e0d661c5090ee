"""Group commit: the claims (or completions) that arrive while one is on the wire go as one statement.

No timer: a call that finds a free lane (fewer than `LANES` statements of its kind in flight) sends
today's one-row statement at once (a batch of one costs nothing extra); calls that arrive while
every lane is busy queue, and when a statement returns, everything queued goes as one statement
over arrays (`unnest`) on that lane, one round trip and one commit for the lot. Three rules keep
a batch as safe as its rows sent one by one:

- rows are sorted by key, so two batches that touch overlapping keys lock them in one order and
  never deadlock;
- results are matched to their callers by token (each claim's own, unique), never by position;
- one bad row fails the whole statement, so a batch that fails on its data (not on the store being
  unavailable) is sent again row by row, and only the bad row's caller gets the error.

The statement runs in a task of its own: a caller cancelled while it waits leaves the batch and
the other callers alone (its claim, if made, is swept like any claim whose answer was lost).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from ...errors import BackendError, BackendUnavailable

Row = TypeVar("Row")
Args = tuple[Any, ...]

MAX_BATCH: Final = 256
"""Rows per statement at most; what is queued beyond it goes in the next one."""
LANES: Final = 1
"""Statements of one kind on the wire at once. Measured (benchmarks/bench_group_commit.py, keys/s
over one-row statements, same run): one lane 0.79 / 2.83 / 4.80 at 8 / 32 / 128 in flight, two
lanes 0.92 / 2.02 / 3.12: fewer, fuller batches win from a few dozen requests in flight up."""


class Group(Generic[Row]):
    """Sends calls of one kind one by one while a lane is free, or, while every lane is busy, together
    as the next batch.

    `one(args)` runs the one-row statement; `many(batch)` the batched one, answering each row's
    result by its token (`args[token_at]`) or leaving it out (the caller then gets None, as from
    a one-row statement that lost a race it could not see).
    """

    __slots__ = ("_busy", "_many", "_one", "_queue", "_tasks", "_token_at", "sizes", "split")

    def __init__(
        self,
        one: Callable[[Args], Awaitable[tuple[Row | None, bool]]],
        many: Callable[[Sequence[Args]], Awaitable[tuple[dict[int, Row], bool]]],
        token_at: int,
    ) -> None:
        self._one = one
        self._many = many
        self._token_at = token_at
        self._busy = 0  # statements of this kind on the wire
        self._queue: list[tuple[Args, asyncio.Future[tuple[Row | None, bool]]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.sizes: dict[int, int] = {}
        """How many statements carried how many rows (batch size -> count), for the benchmarks."""
        self.split = 0
        """Batches the store refused and that were sent again row by row."""

    async def run(self, args: Args) -> tuple[Row | None, bool]:
        """The row of this call (or None), and whether its statement was run again after a broken
        connection (so a row carrying our own token may be our own earlier write)."""
        if self._busy >= LANES:
            future: asyncio.Future[tuple[Row | None, bool]] = asyncio.get_running_loop().create_future()
            self._queue.append((args, future))
            return await future
        self._busy += 1
        failed = None
        try:
            self._count(1)
            return await self._one(args)
        except BackendUnavailable as exc:
            failed = exc
            raise
        finally:
            self._next(failed)

    def _count(self, size: int) -> None:
        self.sizes[size] = self.sizes.get(size, 0) + 1

    def _next(self, failed: BackendUnavailable | None = None) -> None:
        """Hand the wire to what queued meanwhile, as one batch in a task of its own; or, when the
        store just failed a statement (down, stalled past `timeout`), fail what queued at once, as
        its own statement would have, instead of making it wait a second `timeout`."""
        queued = [(a, f) for a, f in self._queue if not f.done()]  # (a cancelled caller is dropped)
        if failed is not None:
            for _, future in queued:
                future.set_exception(_copy(failed))
            queued = []
        if not queued:
            self._queue.clear()
            self._busy -= 1
            return
        batch, self._queue = queued[:MAX_BATCH], queued[MAX_BATCH:]
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[Args, asyncio.Future[tuple[Row | None, bool]]]]) -> None:
        failed = None
        try:
            if len(batch) == 1:
                failed = await self._settle_one(*batch[0])
                return
            self._count(len(batch))
            try:
                rows, retried = await self._many(sorted((a for a, _ in batch), key=lambda a: a[: self._token_at]))
            except BackendUnavailable as exc:  # the store, not the data: every row fails as it would alone
                failed = exc
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
            self._next(failed)

    async def _settle_one(
        self, args: Args, future: asyncio.Future[tuple[Row | None, bool]]
    ) -> BackendUnavailable | None:
        """Send one row alone and answer its caller; the store's failure, if it failed that way."""
        if future.done():
            return None
        self._count(1)
        try:
            result = await self._one(args)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return exc if isinstance(exc, BackendUnavailable) else None
        if not future.done():
            future.set_result(result)
        return None

    async def aclose(self) -> None:
        """Wait for the batches on the wire (their callers are owed an answer)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _copy(exc: BackendUnavailable) -> BackendUnavailable:
    """One exception object per waiting caller (a shared one would collect every caller's traceback)."""
    fresh = BackendUnavailable(*exc.args)
    fresh.__cause__ = exc.__cause__
    return fresh
