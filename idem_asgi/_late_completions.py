"""Answers the store failed to take, written again in the background for a while.

When the completion write fails (store down, reply lost), the client already has its answer and
the effect happened; only the record is missing. Until it lands, every retry of the key sees an
in-progress claim, then `outcome-unknown` once the lease is over. A store blip of a few seconds
should cost that window, not a key left for reconciliation, so the write is retried with backoff
for up to `WINDOW` seconds. Repeating it is safe: it is fenced by the claim's token (a takeover
refuses it), and a completion that landed while its reply was lost is recognised by reading the
record back. Pending answers are held in memory, at most `MAX_PENDING_BYTES` of them; past that,
or past the window, the key is left to the lease and recovery, as without this.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from .backends import Backend
from .observe import EventName
from .records import COMPLETED, RecordKey, StoredResponse

logger = logging.getLogger("idem_asgi")

WINDOW: Final = 30.0
MAX_PENDING_BYTES: Final = 64 << 20
_FIRST_DELAY: Final = 0.05
_MAX_DELAY: Final = 2.0


class LateCompletions:
    """The completions being retried by one middleware; one task each, bounded in bytes."""

    __slots__ = ("_backend", "_pending_bytes", "_tasks")

    def __init__(self, backend: Callable[[], Backend]) -> None:
        self._backend = backend  # looked up at each attempt: the store may be wrapped later (testing)
        self._pending_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        """How many completions are still being retried."""
        return len(self._tasks)

    def retry(
        self, key: RecordKey, token: int, response: StoredResponse, ttl: float, emit: Callable[[EventName], None]
    ) -> bool:
        """Start retrying; False when the memory bound is reached (nothing is retried then)."""
        size = len(response.body) + sum(len(k) + len(v) for k, v in response.headers)
        if self._pending_bytes + size > MAX_PENDING_BYTES:
            return False
        self._pending_bytes += size
        task = asyncio.get_running_loop().create_task(self._run(key, token, response, ttl, emit, size))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _run(
        self,
        key: RecordKey,
        token: int,
        response: StoredResponse,
        ttl: float,
        emit: Callable[[EventName], None],
        size: int,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WINDOW
        delay = _FIRST_DELAY
        try:
            while True:
                await asyncio.sleep(delay)
                try:
                    stored = await self._backend().complete(key, token, response, ttl=ttl) or await self._landed(
                        key, token
                    )
                except Exception as exc:
                    delay = min(delay * 2, _MAX_DELAY)
                    if loop.time() + delay < deadline:
                        continue
                    logger.error(
                        "idem_asgi: gave up storing the answer for key %r after %.0f s (%r); it stays "
                        "in progress until its lease ends, then outcome-unknown",
                        key.key,
                        WINDOW,
                        exc,
                    )
                    return
                if stored:
                    logger.info("idem_asgi: stored the answer for key %r on a later attempt", key.key)
                    emit("completed")
                else:
                    logger.warning(
                        "idem_asgi: key %r was no longer held by this request; this answer was not stored", key.key
                    )
                    emit("lease_lost")
                return
        finally:
            self._pending_bytes -= size

    async def _landed(self, key: RecordKey, token: int) -> bool:
        """An earlier attempt whose reply was lost may have stored it: the record says."""
        record = await self._backend().get(key)
        return record is not None and record.state == COMPLETED and record.token == token
