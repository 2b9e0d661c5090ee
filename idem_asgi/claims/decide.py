"""The pure decision: given what the claim found, what to do. No I/O, so it is unit-tested alone."""

from __future__ import annotations

import enum

from ..records import COMPLETED, Claimed, ClaimResult


class Action(enum.Enum):
    """What the middleware does with this request."""

    RUN = "run"
    """We own the key: run the app."""
    REPLAY = "replay"
    """Send the stored response."""
    NOT_STORED = "not_stored"
    """Completed, but the response was too large to store."""
    IN_PROGRESS = "in_progress"
    """Another request holds a live lease."""
    MISMATCH = "mismatch"
    """Same key, different operation."""
    EXPIRED = "expired"
    """The holder's lease ran out: outcome unknown."""


def decide(result: ClaimResult, fingerprint: bytes) -> Action:
    """Map a claim outcome to an action; a fingerprint mismatch wins over every state."""
    if isinstance(result, Claimed):
        return Action.RUN
    record = result.record
    if record.fingerprint != fingerprint:
        return Action.MISMATCH
    if record.state == COMPLETED:
        if record.response is not None and record.response.replayable:
            return Action.REPLAY
        return Action.NOT_STORED
    if result.now < record.lease_until:
        return Action.IN_PROGRESS
    return Action.EXPIRED
