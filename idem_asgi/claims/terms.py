"""What a claim is made with: its lease, TTL and wait (the one shape every surface's terms have)."""

from __future__ import annotations

from typing import Protocol


class Terms(Protocol):
    """A claim's terms: a `Route`, or a job's `JobTerms`; `label` is what its events name as their route."""

    @property
    def label(self) -> str: ...
    @property
    def lease(self) -> float: ...
    @property
    def ttl(self) -> float: ...
    @property
    def wait(self) -> float: ...
    @property
    def replay_ttl(self) -> float | None:
        """Seconds after completion its answer is replayed, when shorter than `ttl` (None: as long)."""
        ...
