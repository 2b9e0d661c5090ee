"""The lease rule: a lease is over only when its holder is gone.

Two halves, one per side of a claim:

- **Holding** (`Leases.hold`): the claims whose work runs in this process are renewed by one shared
  timer, every third of their lease. A renewal the store does not take (down, stalled, a reply
  lost) is retried at once with a short backoff (50 ms doubling to 250 ms), not at the next tick,
  so a live holder's lease is extended as soon as the store answers again.
- **Judging** (`Leases.over`): a repeat that finds a lease past its deadline does not conclude the
  holder is gone. A claim held in this process never is (the caller checks `Machinery.holds`
  first). Any other expired lease counts as over only once it has been seen expired, with the same
  token and deadline, twice, at least `grace(lease)` apart by the store's clock: after a store
  stall every lease looks expired, and the grace is the time a live holder elsewhere gets to renew
  (its retries run every 250 ms at most once the store answers).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Final, Protocol

from .._logging import store_failed

if TYPE_CHECKING:
    from ..backends import Backend
    from ..observe import EventName
    from ..records import RecordKey
    from .terms import Terms

logger = logging.getLogger("idem_asgi")

RETRY_FIRST: Final = 0.05
RETRY_MAX: Final = 0.25
"""A failed renewal is tried again after 50 ms, doubling up to 250 ms, while its work runs."""
GRACE_MIN: Final = 1.0
GRACE_MAX: Final = 5.0
MAX_SIGHTINGS: Final = 10_000
"""Expired leases remembered for their second sighting (oldest half dropped past this)."""


def grace(lease: float) -> float:
    """How long an expired lease must stay unchanged before it counts as over: a third of the lease
    (the renewal interval), at least 1 s and at most 5 s. Renewal retries run every 250 ms at most,
    so a live holder renews well inside it once the store answers."""
    return min(max(lease / 3, GRACE_MIN), GRACE_MAX)


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
    """The claims held while their work runs, renewed by one timer; and the expired leases seen.

    Holding a claim is a dict insert and releasing it a dict pop: no timer per claim. Claims are
    keyed by (record digest, token). While anything is held, one timer ticks every third of the
    shortest lease held so far and starts the renewal of each claim last extended a third of its own
    lease ago; a renewal in progress (retrying a failed one) is left to its task. An extension also
    keeps the record itself alive past its TTL while its work still runs.
    """

    __slots__ = ("_held", "_sightings", "_tasks", "_tick", "_timers")

    def __init__(self, tick: float = 3600.0) -> None:
        self._tick = tick
        self._held: dict[tuple[str, int], tuple[Holder, asyncio.AbstractEventLoop]] = {}
        self._timers: dict[asyncio.AbstractEventLoop, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sightings: dict[tuple[str, int, float], float] = {}

    # -- holding ------------------------------------------------------------------------------------

    def hold(self, holder: Holder) -> None:
        """Start renewing this claim until `release(holder)` (on the event loop running now)."""
        loop = asyncio.get_running_loop()
        third = holder.terms.lease / 3
        holder.due = loop.time() + third
        self._held[_id(holder)] = (holder, loop)
        if third < self._tick:  # a shorter lease than any before: tick sooner (other loops from their next tick)
            self._tick = third
            timer = self._timers.pop(loop, None)
            if timer is not None:
                timer.cancel()
        if loop not in self._timers:  # the first claim on this loop since a tick found nothing held
            self._forget_closed_loops()
            self._timers[loop] = loop.call_later(self._tick, self._fire, loop)

    def _forget_closed_loops(self) -> None:
        """Drop what was held on event loops that are closed (a test's, a finished `asyncio.run`)."""
        for closed in [on for on in self._timers if on.is_closed()]:
            del self._timers[closed]
        for held in [h for h, (_, on) in self._held.items() if on.is_closed()]:
            del self._held[held]

    def release(self, holder: Holder) -> None:
        """Stop renewing (idempotent): the outcome is final, abandoned, or the claim was lost."""
        held = _id(holder)
        entry = self._held.get(held)
        if entry is not None and entry[0] is holder:
            del self._held[held]

    def holds(self, holder: Holder) -> bool:
        """Still being renewed."""
        entry = self._held.get(_id(holder))
        return entry is not None and entry[0] is holder

    def held(self, digest: str, token: int) -> bool:
        """Whether claim `token` on record `digest` is held in this process, its work still running."""
        return (digest, token) in self._held

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        mine = [holder for holder, on in list(self._held.values()) if on is loop]
        for holder in mine:
            if holder.due <= now:
                holder.due = math.inf  # its renewal task owns it until the store has answered
                task = loop.create_task(self._extend(holder))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if mine:
            self._timers[loop] = loop.call_later(self._tick, self._fire, loop)
        else:
            self._timers.pop(loop, None)

    async def _extend(self, holder: Holder) -> None:
        """Extend one lease, retrying at once (with a short backoff) while the store fails and the
        work still runs."""
        key = holder.rkey
        assert key is not None
        lease = holder.terms.lease
        delay = RETRY_FIRST
        failed = False
        while True:
            try:
                extended = await holder.backend.extend(key, holder.token, lease=lease)
                break
            except Exception as exc:
                if not failed:  # one line per outage, not one per retry
                    store_failed(f"could not extend the lease of key {key.key!r}; retrying", exc)
                    holder.emit("store_error")
                failed = True
            if not self.holds(holder):
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)
            if not self.holds(holder):
                return
        if not self.holds(holder):
            return  # the work finished meanwhile
        if extended:
            holder.due = asyncio.get_running_loop().time() + lease / 3
            if failed:
                logger.info("idem_asgi: the lease of key %r was extended again after the store failed", key.key)
            holder.emit("lease_extended")
        else:
            self.release(holder)
            holder.lost()
            logger.warning("idem_asgi: lease of key %r was lost while its work ran", key.key)
            holder.emit("lease_lost")

    # -- judging ------------------------------------------------------------------------------------

    def over(self, digest: str, token: int, lease_until: float, now: float, lease: float) -> bool:
        """Whether the expired lease (`token`, `lease_until`) of record `digest`, seen at store time
        `now`, is over: seen expired and unchanged `grace(lease)` ago already. The first sighting is
        remembered and answers False (the holder may be alive and about to renew)."""
        wait = grace(lease)
        if wait <= 0:
            return True
        sight = (digest, token, lease_until)
        first = self._sightings.get(sight)
        if first is None:
            if len(self._sightings) >= MAX_SIGHTINGS:
                for old in list(self._sightings)[: MAX_SIGHTINGS // 2]:
                    del self._sightings[old]
            self._sightings[sight] = now
            return False
        return now - first >= wait


def _id(holder: Holder) -> tuple[str, int]:
    key = holder.rkey
    assert key is not None
    return key.digest, holder.token
