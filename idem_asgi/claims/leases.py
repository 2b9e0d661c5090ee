"""Lease renewal: the claims held while their work runs (requests, jobs), renewed by one shared timer."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from .._logging import store_failed

if TYPE_CHECKING:
    from ..backends import Backend
    from ..observe import EventName
    from ..records import RecordKey
    from .session import Terms

logger = logging.getLogger("idem_asgi")


class Holder(Protocol):
    """What is held: a claim session while its work runs (`claims.session.ClaimSession`)."""

    terms: Terms
    rkey: RecordKey | None
    token: int
    due: float

    @property
    def backend(self) -> Backend:
        """The store the claim was made in."""
        ...

    def emit(self, name: EventName, status: int | None = None) -> None:
        """Tell the observer."""

    def lost(self) -> None:
        """Its claim was lost while its work ran (told once, as it stops being renewed)."""


class Leases:
    """The claims held while their work runs; one timer renews the long-running ones.

    Holding a claim is a dict insert and releasing it a dict pop: no timer (`call_later` +
    `cancel`), no closure and no object per request. Claims are keyed by (record digest, token):
    two claims held at once never share an entry, even were their tokens equal. While anything is
    held, one timer ticks every third of the shortest route lease and extends each claim last
    extended a third of its own lease ago, so a live claim is extended at most two thirds of its
    lease after the previous extension (the tick shortens for a claim with a shorter lease than
    any before). An extension also keeps the record itself alive past its TTL while its work still
    runs. Each claim is extended in its own store and tells its own observer.
    """

    __slots__ = ("_held", "_loop", "_tasks", "_tick", "_timer")

    def __init__(self, tick: float) -> None:
        self._tick = tick
        self._held: dict[tuple[str, int], Holder] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def hold(self, holder: Holder) -> None:
        """Start renewing this claim until `release(holder)`."""
        loop = asyncio.get_running_loop()
        third = holder.terms.lease / 3
        holder.due = loop.time() + third
        self._held[_id(holder)] = holder
        if third < self._tick:  # a job with a shorter lease than any before
            self._tick = third
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if self._timer is None or self._loop is not loop:
            # the first claim since a tick found nothing held, or a new event loop (tests)
            self._loop = loop
            self._timer = loop.call_later(self._tick, self._fire)

    def release(self, holder: Holder) -> None:
        """Stop renewing (idempotent): the answer is final, or the claim was lost."""
        held = _id(holder)
        if self._held.get(held) is holder:
            del self._held[held]

    def holds(self, holder: Holder) -> bool:
        """Still being renewed."""
        return self._held.get(_id(holder)) is holder

    def held(self, digest: str, token: int) -> bool:
        """Whether the claim `token` on the record `digest` is held in this process, its app still running."""
        return (digest, token) in self._held

    def _fire(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        for holder in list(self._held.values()):
            if holder.due <= now:
                holder.due = now + holder.terms.lease / 3
                task = loop.create_task(self._extend(holder))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._timer = loop.call_later(self._tick, self._fire) if self._held else None

    async def _extend(self, holder: Holder) -> None:
        key = holder.rkey
        assert key is not None
        try:
            held = await holder.backend.extend(key, holder.token, lease=holder.terms.lease)
        except Exception as exc:
            store_failed(f"could not extend the lease of key {key.key!r}; will retry", exc)
            holder.emit("store_error")
            return  # still held: the next tick tries again
        if not self.holds(holder):
            return  # the work finished meanwhile
        if held:
            holder.emit("lease_extended")
        else:
            self.release(holder)
            holder.lost()
            logger.warning("idem_asgi: lease of key %r was lost while the app ran", key.key)
            holder.emit("lease_lost")


def _id(holder: Holder) -> tuple[str, int]:
    key = holder.rkey
    assert key is not None
    return key.digest, holder.token
