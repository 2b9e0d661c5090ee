"""The pure decision from a claim outcome to an action."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idem_asgi.claims.decide import Action, decide
from idem_asgi.records import COMPLETED, IN_PROGRESS, Claimed, Existing, Record, State, StoredResponse

FP = b"fingerprint-a"
RESPONSE = StoredResponse(201, [(b"content-type", b"application/json")], b"{}")
NOT_STORED = StoredResponse(200, [], b"", replayable=False)


def existing(
    state: State = IN_PROGRESS,
    *,
    fingerprint: bytes = FP,
    lease_until: float = 100.0,
    now: float = 50.0,
    response: StoredResponse | None = None,
) -> Existing:
    return Existing(Record(state, fingerprint, 7, lease_until, 1_000.0, response), now)


def test_a_claim_we_won_runs() -> None:
    assert decide(Claimed(token=1), FP) is Action.RUN
    assert decide(Claimed(token=1), b"anything") is Action.RUN


def test_completed_and_replayable_replays() -> None:
    assert decide(existing(COMPLETED, response=RESPONSE), FP) is Action.REPLAY


def test_completed_too_large_to_store_is_not_stored() -> None:
    assert decide(existing(COMPLETED, response=NOT_STORED), FP) is Action.NOT_STORED
    assert decide(existing(COMPLETED, response=None), FP) is Action.NOT_STORED


def test_live_lease_is_in_progress() -> None:
    assert decide(existing(lease_until=100.0, now=99.999), FP) is Action.IN_PROGRESS


@pytest.mark.parametrize("now", [100.0, 100.001, 10_000.0])
def test_lease_at_or_past_its_deadline_is_expired(now: float) -> None:
    assert decide(existing(lease_until=100.0, now=now), FP) is Action.EXPIRED


def test_completed_records_ignore_the_lease() -> None:
    assert decide(existing(COMPLETED, lease_until=0.0, now=5_000.0, response=RESPONSE), FP) is Action.REPLAY


@pytest.mark.parametrize(
    "result",
    [
        existing(lease_until=100.0, now=50.0),
        existing(lease_until=100.0, now=150.0),
        existing(COMPLETED, response=RESPONSE),
        existing(COMPLETED, response=NOT_STORED),
    ],
    ids=["in-progress", "expired", "completed", "not-stored"],
)
def test_a_different_fingerprint_is_a_mismatch_in_every_state(result: Existing) -> None:
    assert decide(result, b"fingerprint-b") is Action.MISMATCH


states = st.sampled_from([IN_PROGRESS, COMPLETED])
responses = st.none() | st.sampled_from([RESPONSE, NOT_STORED])
times = st.floats(min_value=0, max_value=1e10, allow_nan=False)


@given(states, st.binary(max_size=8), st.binary(max_size=8), times, times, responses)
def test_decisions_follow_the_table(
    state: State, stored: bytes, sent: bytes, lease_until: float, now: float, response: StoredResponse | None
) -> None:
    result = existing(state, fingerprint=stored, lease_until=lease_until, now=now, response=response)
    action = decide(result, sent)
    assert action is decide(result, sent)  # pure: same input, same answer
    if stored != sent:
        assert action is Action.MISMATCH
    elif state == COMPLETED:
        assert action is (Action.REPLAY if response is RESPONSE else Action.NOT_STORED)
    else:
        assert action is (Action.IN_PROGRESS if now < lease_until else Action.EXPIRED)
