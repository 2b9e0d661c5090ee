"""The relay: publishes what the outbox holds, marks it sent, and survives a crash at every point.

At most one relay publishes at a time (a session advisory lock in PostgreSQL, held on the relay's
own connection): others stand by and take over when its session ends, so a SIGKILLed relay is
replaced within `standby_poll` seconds and a live one is never taken over. A crash between a
publish and its "sent" mark publishes the message again, with the same message id: consumers keyed
by it (the project's `rabbitmq_handler` / `nats_handler` by default) apply it once. One key's
messages are published in the order they were added; a message the broker refuses holds the rest
of its key back and is retried with a backoff, while other keys go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._table import Outbox, OutboxMessage
from .publishers import Publisher

logger = logging.getLogger("idem_asgi.outbox")
_LOCK = "SELECT pg_try_advisory_lock(hashtext($1))"
"""The leader's lock: session-scoped, so it ends with the leader's connection, never by a timer."""


@dataclass
class RelayStats:
    """Counters of one relay process (for metrics: read them from a gauge callback)."""

    published: int = 0  # messages the broker confirmed
    failed: int = 0  # publishes the broker refused or that timed out (each retried later)
    batches: int = 0
    purged: int = 0  # sent messages deleted after `keep_sent`
    leader: bool = False  # this relay holds the lock and publishes
    last_error: str | None = None
    last_batch_at: float = field(default=0.0)  # time.time() of the last batch (a stuck relay stops moving it)


class Relay:
    """Publish an outbox's messages through `publisher`: `await relay.run()` (until cancelled or
    `stop()`), or `async with relay:` to run it as a background task of an app's lifespan.

    `batch` messages per round trip; `poll` seconds between looks when a round found fewer than
    `batch` (a message waits `poll / 2` on average before its publish); a refused
    publish is retried after `first_retry` seconds, doubling per attempt up to `max_retry`; sent
    messages are deleted `keep_sent` seconds after they were sent (checked every `purge_every`).
    """

    def __init__(
        self,
        outbox: Outbox,
        publisher: Publisher,
        *,
        batch: int = 100,
        poll: float = 0.2,
        first_retry: float = 0.5,
        max_retry: float = 30.0,
        keep_sent: float = 86_400.0,
        purge_every: float = 300.0,
        standby_poll: float = 1.0,
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be at least 1")
        self.outbox = outbox
        self.publisher = publisher
        self.batch = batch
        self.poll = poll
        self.first_retry = first_retry
        self.max_retry = max_retry
        self.keep_sent = keep_sent
        self.purge_every = purge_every
        self.standby_poll = standby_poll
        self.stats = RelayStats()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._purged_at = 0.0
        self._pause = first_retry  # the store's backoff: doubles per failure, reset by a round

    # -- running -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Publish until `stop()` (the round in progress ends first: its publishes are marked sent)
        or cancellation. A store or broker that fails is retried with a backoff, never fatal."""
        while not self._stopping.is_set():
            try:
                await self._lead()
            except Exception as exc:  # the store went away (or refused): stand back, try again
                self.stats.leader = False
                self._failed(f"outbox store: {type(exc).__name__}: {exc}")
                await self._rest(self._pause)
                self._pause = min(self._pause * 2, self.max_retry)

    async def once(self) -> int | None:
        """Publish what is due now, as the leader, then give the lock up: how many were published,
        or None when another relay leads (it publishes them). For `idem-asgi relay --once`."""
        pool = await self.outbox._pool()
        conn = await pool.acquire()
        try:
            if not await conn.fetchval(_LOCK, self.outbox.lock_name):
                return None
            before = self.stats.published
            while True:  # until a round leaves rows behind or sends nothing (refused rows wait)
                start = self.stats.published
                if await self.round(conn) < self.batch or self.stats.published == start:
                    return self.stats.published - before
        finally:
            await asyncio.shield(self._hand_back(pool, conn))

    def stop(self) -> None:
        """Ask the relay to stop after the round in progress (a graceful stop: SIGTERM)."""
        self._stopping.set()
        self._wake.set()

    async def __aenter__(self) -> Relay:
        self._task = asyncio.create_task(self.run(), name="idem-asgi outbox relay")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, grace: float = 10.0) -> None:
        """Stop, wait up to `grace` seconds for the round in progress, then cancel; close the publisher."""
        self.stop()
        task, self._task = self._task, None
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), grace)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.publisher.aclose()

    async def _rest(self, seconds: float) -> None:
        """Sleep, cut short by `stop()`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    # -- leading -------------------------------------------------------------------------------

    async def _lead(self) -> None:
        """Hold a connection, wait for the lock, then publish rounds until stopped. The connection
        is always handed back with every advisory lock of its session released (or closed): a lock
        granted while the call was cancelled must not stay on a pooled connection."""
        pool = await self.outbox._pool()
        conn = await pool.acquire()
        try:
            while not await conn.fetchval(_LOCK, self.outbox.lock_name):
                if self._stopping.is_set():
                    return
                await self._rest(self.standby_poll)  # another relay publishes: stand by
            self.stats.leader = True
            logger.info("idem_asgi: outbox relay leads %s", self.outbox.table)
            while not self._stopping.is_set():
                published = await self.round(conn)
                self._pause = self.first_retry
                await self._maybe_purge()
                if published < self.batch:
                    await self._rest(self.poll)
        finally:
            self.stats.leader = False
            await asyncio.shield(self._hand_back(pool, conn))

    @staticmethod
    async def _hand_back(pool: Any, conn: Any) -> None:
        """Release the session's advisory locks and give the connection back; one that cannot is
        closed (its session ends, and its locks with it)."""
        try:
            with anyio.fail_after(5):
                await conn.execute("SELECT pg_advisory_unlock_all()")
                await pool.release(conn)
        except Exception:
            conn.terminate()
            with contextlib.suppress(Exception):
                await pool.release(conn)

    async def round(self, conn: Any) -> int:
        """One round: publish the due messages (keys side by side, each key's in order), then mark
        what the broker confirmed as sent and what it refused for a retry. Returns how many were due."""
        due = await self.outbox.due(conn, self.batch)
        if not due:
            return 0
        by_key: dict[str, list[OutboxMessage]] = {}
        for message in due:
            by_key.setdefault(message.key, []).append(message)
        sent: list[int] = []
        refused: list[tuple[OutboxMessage, str]] = []

        async def publish(messages: list[OutboxMessage]) -> None:
            for message in messages:
                try:
                    await self.publisher.publish(message)
                except Exception as exc:
                    refused.append((message, f"{type(exc).__name__}: {exc}"))
                    return  # the key's later messages wait behind this one
                sent.append(message.seq)

        async def settle() -> None:
            await self.outbox.mark_sent(conn, sent)
            for message, error in refused:
                await self.outbox.mark_failed(conn, message.seq, error, first=self.first_retry, most=self.max_retry)

        try:
            await asyncio.gather(*(publish(messages) for messages in by_key.values()))
        except BaseException:  # cancelled mid-round: what the broker has is still marked, so fewer go twice
            with contextlib.suppress(Exception):
                await asyncio.shield(settle())
            raise
        await asyncio.shield(settle())
        self.stats.published += len(sent)
        self.stats.batches += 1
        self.stats.last_batch_at = time.time()
        if refused:
            self.stats.failed += len(refused)
            self._failed(f"{len(refused)} of {len(due)} messages not published: {refused[0][1]}")
        return len(due)

    async def _maybe_purge(self) -> None:
        now = time.monotonic()
        if now - self._purged_at < self.purge_every:
            return
        self._purged_at = now
        self.stats.purged += await self.outbox.purge(self.keep_sent)

    def _failed(self, error: str) -> None:
        self.stats.last_error = error
        logger.warning("idem_asgi: outbox relay: %s (retried with a backoff)", error)
