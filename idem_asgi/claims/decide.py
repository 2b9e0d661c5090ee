"""The pure decision: given what the claim found, what to do. No I/O, so it is unit-tested alone."""

from __future__ import annotations

import enum

from ..records import COMPLETED, Claimed, ClaimResult
from .surfaces import legacy_match


class Action(enum.Enum):
    """What the middleware does with this request."""

    RUN = "run"
    """We own the key: run the app."""
    REPLAY = "replay"
    """Send the stored response."""
    NOT_STORED = "not_stored"
    """Completed, but the response was too large to store."""
    ANSWER_EXPIRED = "answer_expired"
    """Completed longer ago than its answer is kept (a route's `replay_ttl`): only its tombstone is left."""
    IN_PROGRESS = "in_progress"
    """Another request holds a live lease."""
    MISMATCH = "mismatch"
    """Same key, different operation."""
    EXPIRED = "expired"
    """The holder's lease ran out: outcome unknown."""


# The members as module constants: reading `Action.X` goes through the enum's metaclass (~80 ns a
# time), and `decide` runs for every repeat.
RUN, REPLAY, NOT_STORED, ANSWER_EXPIRED = Action.RUN, Action.REPLAY, Action.NOT_STORED, Action.ANSWER_EXPIRED
IN_PROGRESS, MISMATCH, EXPIRED = Action.IN_PROGRESS, Action.MISMATCH, Action.EXPIRED


def decide(result: ClaimResult, fingerprint: bytes) -> Action:
    """Map a claim outcome to an action; a fingerprint mismatch wins over every state."""
    if isinstance(result, Claimed):
        return RUN
    record = result.record
    if record.fingerprint != fingerprint and not legacy_match(record.fingerprint, fingerprint):
        return MISMATCH
    if record.state == COMPLETED:
        response = record.response
        if response is not None and response.replayable:
            return REPLAY
        return ANSWER_EXPIRED if response is not None and response.tombstone else NOT_STORED
    if result.now < record.lease_until:
        return IN_PROGRESS
    return EXPIRED
