"""The shape every store implements. Any object with these methods works; no base class needed.

Costs: `claim` is one round trip (claim-or-read), `complete`/`release`/`extend` one each.
Every write after the claim is fenced by the claim's token: a holder whose token is stale
(its lease was taken over) gets False and changes nothing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..records import ClaimResult, Record, RecordKey, StoredResponse


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
    ) -> ClaimResult:
        """Claim a record whose lease expired, only if it still carries `stale_token`."""
        ...

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        """Store the response and mark the record completed; False if fenced out."""
        ...

    async def release(self, key: RecordKey, token: int) -> bool:
        """Delete an in-progress record so a retry runs again; False if fenced out."""
        ...

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        """Push the lease deadline to store-now + `lease`; False if fenced out or completed."""
        ...

    async def get(self, key: RecordKey) -> Record | None:
        """Read a record (for wait-then-replay and the tools); None if absent or expired."""
        ...

    async def aclose(self) -> None:
        """Close what the backend created (never a client or pool it was given)."""
        ...
