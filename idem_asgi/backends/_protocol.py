"""The shape every store implements. Any object with these methods works; no base class needed.

Costs: `claim` is one round trip (claim-or-read), `complete`/`release`/`extend`/`mark_failed` one each.
Every write after the claim is fenced by the claim's token: a holder whose token is stale
(its lease was taken over) gets False and changes nothing.

The optional abilities are protocols of their own, so a store without them still works behind
the middleware; the code asks `isinstance(store, Ability)` once, where it is set up (the
middleware, `reconcile`, the CLI), never at each call:

- `Checkable`: `check()`, run at lifespan start-up.
- `Watchable`: `watch()`, so a held repeat in another process is told when a claim ends (Redis).
- `Maintenance`: `stale()` and `purge()`, for the ops tools (`idem_asgi.ops.reconcile`, `idem-asgi`).
- `KeyForms`: raw keys recorded, kept or rewritten to digests (`idem-asgi migrate`).
- `Histories`: each key's history (`idem_asgi.history`), written in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ..history import Step
from ..records import ClaimResult, Record, RecordKey, StaleRecord, StoredResponse


@runtime_checkable
class Backend(Protocol):
    """An idempotency store. Durations are seconds; times are judged by the store's clock."""

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        """Atomically create an in-progress record, or return the live one that exists.

        An expired record (past its TTL) counts as absent.
        """
        ...

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        """Claim a record whose lease expired, only if it still carries `stale_token`.

        None when the record is gone (released, or past its TTL): a takeover never creates one, so
        recovery can never resurrect a claim that ended meanwhile.
        """
        ...

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        """Store the response and mark the record completed; False if fenced out."""
        ...

    async def release(self, key: RecordKey, token: int) -> bool:
        """Delete an in-progress record so a retry runs again; False if fenced out."""
        ...

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        """Push the lease deadline to store-now + `lease`, and the record's expiry at least as far
        (a holder running past its TTL keeps its key); False if fenced out or completed."""
        ...

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        """The holder failed after its answer started or after it marked an effect: end the lease
        now and flag the record (`Record.holder_failed`), so a retry gets outcome-unknown, `reclaim`
        never re-runs it, and only recovery (hook, reconcile, CLI) resolves it. False if fenced out."""
        ...

    async def get(self, key: RecordKey) -> Record | None:
        """Read a record (for wait-then-replay and the tools); None if absent or expired."""
        ...

    async def aclose(self) -> None:
        """Close what the backend created (never a client or pool it was given)."""
        ...


@runtime_checkable
class Checkable(Protocol):
    """A store that can tell, at start-up, whether it can ever serve as configured."""

    async def check(self) -> None:
        """Raise `BackendMisconfigured` (wrong credentials, missing rights or table) or
        `BackendUnavailable` (not reachable now); return when a claim would work."""
        ...


@runtime_checkable
class Maintenance(Protocol):
    """What the reconcile tool and the CLI need beyond `Backend`. Safe to call while serving."""

    async def stale(
        self, older_than: float = 0.0, limit: int = 1000, *, namespace: str | None = None
    ) -> list[StaleRecord]:
        """In-progress records whose lease ended more than `older_than` seconds ago, by the store's clock.

        At most `limit`; records past their TTL are not listed. `namespace` keeps only that
        namespace's records (several apps may share one store, each with its own resolver).
        """
        ...

    async def purge(self, batch_size: int = 1000) -> int:
        """Delete records past their TTL, `batch_size` per step; returns how many were deleted.

        A store that expires records by itself (Redis) may return 0.
        """
        ...


@runtime_checkable
class Watchable(Protocol):
    """A store that tells other processes when a claim ends, so held repeats need not poll."""

    async def watch(self, key: RecordKey, token: int, on_change: Callable[[str | None], None]) -> bool | None:
        """Ask to be told (`on_change(digest)`) when claim `token` on `key` ends (`on_change(None)`:
        notices were interrupted). True: still held, its end will be told; False: it changed
        already; None: no notices now (poll)."""
        ...


@runtime_checkable
class KeyForms(Protocol):
    """How a store keeps keys at rest, for `idem-asgi migrate` (raw keys kept or rewritten to digests)."""

    async def hash_stored_keys(self) -> tuple[int, int]:
        """Rewrite raw keys to their digest: (rewritten, left because a newer record exists)."""
        ...

    async def record_raw_keys(self) -> None:
        """Record that an app keeps raw keys (`store_keys=True`), so `migrate` leaves them."""
        ...

    async def raw_keys_recorded(self) -> float | None:
        """When an app keeping raw keys was recorded, or None."""
        ...

    async def forget_raw_keys(self) -> None:
        """Drop that record (`migrate --no-store-keys`)."""
        ...


@runtime_checkable
class Histories(Protocol):
    """A store that keeps each key's history beside its record (`idem_asgi.history`)."""

    history: int
    """Steps kept per key that requests write; 0: requests write none (an operator's still are)."""

    async def write_history(self, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
        """Append each key's steps (kept at least its `ttl` seconds, and as long as its record),
        keeping the last `history` (or `KEEP`) of each; one round trip for the whole batch."""
        ...

    async def read_history(self, key: RecordKey) -> list[Step]:
        """The key's steps, oldest first (empty when none are kept or they expired)."""
        ...
