"""Writes the store failed to take at the end of a request, made again in the background for a while.

When the write that ends a claim fails (store down, reply lost), the client already has its answer;
only the record lags behind, and each kind of write leaves its own wrong state:

- a completion not taken: the effect happened, but every retry sees an in-progress claim, then
  `outcome-unknown` once the lease is over;
- a release not taken (after a 503, a 429, an exception before the answer): the client was told
  "nothing happened, retry", yet the key stays in progress, then `outcome-unknown`, for the TTL;
- a lease end not taken (`mark_failed`, after a failure mid-answer): the record looks like a crash,
  whose retry `reclaim` would run again.

A store blip of a few seconds should cost that window, not a key left for reconciliation, so the
write is retried with backoff for up to `WINDOW` seconds. Repeating it is safe: it is fenced by the
claim's token (a takeover refuses it), and a write that landed while its reply was lost is
recognised by reading the record back. Pending writes are held in memory, at most
`MAX_PENDING_BYTES` of them (an answer counts its bytes, every write `OVERHEAD` more); past that,
or past the window, the key is left to the lease and recovery, as without this.

A claim whose outcome waits here still counts as held by this process (`holds`): its repeats are
answered in progress, never recovered. A job's caller waits for its completion (`LateWrites.task`),
and closing the store (`aclose()`) waits for every pending write, up to its window (`drain`), so a
short-lived process does not exit with an answer unwritten.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Final, NamedTuple

from ..backends import Backend
from ..observe import EventName
from ..records import COMPLETED, IN_PROGRESS, Record, RecordKey, StoredResponse

logger = logging.getLogger("idem_asgi")

WINDOW: Final = 30.0
MAX_PENDING_BYTES: Final = 64 << 20
OVERHEAD: Final = 4096
"""Bytes each pending write counts for itself (its task, key and token), so releases are bounded too."""
_FIRST_DELAY: Final = 0.05
_MAX_DELAY: Final = 1.0

Emit = Callable[[EventName], None]


class _Kind(NamedTuple):
    """One kind of write: what it does and what is left undone when it is fenced out (for the log),
    its event once it lands, and how a landed write whose reply was lost shows in the record."""

    doing: str
    undone: str
    done: EventName
    landed: Callable[[Record | None, int], bool]


_COMPLETE = _Kind(
    "storing the answer",
    "this answer was not stored",
    "completed",
    lambda r, token: r is not None and r.state == COMPLETED and r.token == token,
)
_RELEASE = _Kind("releasing it", "it was not released", "released", lambda r, token: r is None)
_FAIL = _Kind(
    "ending its lease",
    "its lease was not ended",
    "unresolved",
    lambda r, token: (
        r is not None and r.state == IN_PROGRESS and r.token == token and (r.holder_failed or r.effect_committed)
    ),
)


class _Write(NamedTuple):
    """One write to retry: to the store its claim was made in, fenced by its token."""

    backend: Backend
    key: RecordKey
    token: int
    call: Callable[[], Awaitable[bool]]


class LateWrites:
    """The writes being retried for one surface (a middleware, one store's jobs); one task each,
    bounded in bytes. A pending write holds its store until it lands or gives up."""

    __slots__ = ("_by_claim", "_pending_bytes", "_tasks")

    def __init__(self) -> None:
        self._pending_bytes = 0
        self._tasks: set[asyncio.Task[bool]] = set()
        self._by_claim: dict[tuple[str, int], asyncio.Task[bool]] = {}

    def holds(self, digest: str, token: int) -> bool:
        """Whether a write ending claim `token` on record `digest` is still being retried."""
        return (digest, token) in self._by_claim

    def task(self, digest: str, token: int) -> asyncio.Task[bool] | None:
        """The task retrying the write that ends claim `token` on `digest`, if one runs (its result:
        whether the write landed)."""
        return self._by_claim.get((digest, token))

    async def drain(self) -> None:
        """Wait for every pending write to land or give up (each within its window)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def pending(self) -> int:
        """How many writes are still being retried."""
        return len(self._tasks)

    def complete(
        self, backend: Backend, key: RecordKey, token: int, response: StoredResponse, ttl: float, emit: Emit
    ) -> bool:
        """Retry storing `response`; False when the memory bound is reached (nothing is retried then)."""
        size = len(response.body) + sum(len(k) + len(v) for k, v in response.headers)
        write = partial(backend.complete, key, token, response, ttl=ttl)
        return self._start(_COMPLETE, _Write(backend, key, token, write), size, emit)

    def release(self, backend: Backend, key: RecordKey, token: int, emit: Emit) -> bool:
        """Retry releasing the claim, so a retry of the request runs again."""
        return self._start(_RELEASE, _Write(backend, key, token, partial(backend.release, key, token)), 0, emit)

    def mark_failed(self, backend: Backend, key: RecordKey, token: int, emit: Emit) -> bool:
        """Retry ending the lease of a claim whose holder failed mid-answer (outcome-unknown)."""
        return self._start(_FAIL, _Write(backend, key, token, partial(backend.mark_failed, key, token)), 0, emit)

    def _start(self, kind: _Kind, write: _Write, size: int, emit: Emit) -> bool:
        size += OVERHEAD
        if self._pending_bytes + size > MAX_PENDING_BYTES:
            return False
        self._pending_bytes += size
        task = asyncio.get_running_loop().create_task(self._run(kind, write, emit))
        claim = (write.key.digest, write.token)
        self._tasks.add(task)
        self._by_claim[claim] = task
        task.add_done_callback(lambda done: self._free(done, claim, size))
        return True

    def _free(self, task: asyncio.Task[bool], claim: tuple[str, int], size: int) -> None:
        self._tasks.discard(task)
        if self._by_claim.get(claim) is task:
            del self._by_claim[claim]
        self._pending_bytes -= size

    async def _run(self, kind: _Kind, write: _Write, emit: Emit) -> bool:
        backend, key, token = write.backend, write.key, write.token
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WINDOW
        delay = _FIRST_DELAY
        while True:
            await asyncio.sleep(delay)
            try:
                done = await write.call() or kind.landed(await backend.get(key), token)
            except Exception as exc:
                delay = min(delay * 2, _MAX_DELAY)
                if loop.time() + delay < deadline:
                    continue
                logger.error(
                    "idem_asgi: gave up %s for key %r after %.0f s (%r); it stays in progress until its "
                    "lease ends, then outcome-unknown",
                    kind.doing,
                    key.key,
                    WINDOW,
                    exc,
                )
                return False
            if done:
                logger.info("idem_asgi: key %r: %s succeeded on a later attempt", key.key, kind.doing)
                emit(kind.done)
            else:
                logger.warning("idem_asgi: key %r was no longer held by this request; %s", key.key, kind.undone)
                emit("lease_lost")
            return bool(done)
