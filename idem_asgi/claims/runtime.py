"""One claim machinery per process and store, shared by every surface that claims in that store.

A process that serves HTTP and runs jobs or consumers on one store has one lease renewer, one
late-write retrier, one table of held repeats and one history writer for it, built here and nowhere else. That is what
lets the lease rule hold across surfaces: a claim this process holds (renewed, or its answer waiting
to be written) is known to every session in the process, so none of them ever recovers it or takes
it over while its holder lives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..backends._base import ClosingMixin
from ..backends._protocol import Histories
from .late_writes import LateWrites
from .leases import Leases
from .trail import Trail
from .waiting import Waiters

if TYPE_CHECKING:
    from ..backends import Backend


@dataclass(frozen=True, slots=True)
class Machinery:
    """What every claim made in one store by this process shares."""

    leases: Leases
    late: LateWrites
    waiters: Waiters
    trail: Trail | None
    """Each key's history, when the store keeps one (`history=N`)."""

    def holds(self, digest: str, token: int) -> bool:
        """Whether this process holds claim `token` on record `digest`: its work still runs (its lease
        is renewed), or its outcome is written but the store has not taken it yet."""
        return self.leases.held(digest, token) or self.late.holds(digest, token)


_by_store: weakref.WeakKeyDictionary[Backend, Machinery] = weakref.WeakKeyDictionary()
"""Per store, held weakly: nothing in the machinery refers back to the store."""


def machinery_for(store: Backend) -> Machinery:
    """The machinery of `store` in this process, built on first use. Pending late writes are
    drained when the store closes (`aclose()`: a built-in store, or one a wrapper delegates to)."""
    found = _by_store.get(store)
    if found is None:
        trail = Trail(store) if isinstance(store, Histories) and store.history > 0 else None
        found = _by_store[store] = Machinery(Leases(), LateWrites(), Waiters(), trail)
        closing = _closing(store)
        if closing is not None:
            closing.on_close(found.late.drain)
            if trail is not None:
                closing.on_close(trail.drain)
    return found


def _closing(store: object) -> ClosingMixin | None:
    """The built-in store that closes for `store`: itself, or the one a wrapper (`.wrapped`, as the
    testing plugin's fault injectors have) delegates to."""
    for _ in range(8):
        if isinstance(store, ClosingMixin):
            return store
        store = getattr(store, "wrapped", None)
        if store is None:
            return None
    return None
