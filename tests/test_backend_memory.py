"""MemoryBackend only: its bounds (TTL expiry, entries, bytes, per-scope share) and its injectable clock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from idem_asgi.backends import MemoryBackend
from idem_asgi.claims.decide import Action, decide
from idem_asgi.errors import BackendUnavailable, ConfigurationError, StoreFull
from idem_asgi.records import COMPLETED, Claimed, Existing, RecordKey, StoredResponse, encode_response

RESPONSE = StoredResponse(201, [(b"content-type", b"text/plain")], b"ok")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def k(i: int | str) -> RecordKey:
    return RecordKey.build("mem", None, f"key-{i}")


async def test_max_entries_bound_holds_under_a_flood_of_keys_and_the_store_refuses_past_it() -> None:
    clock = Clock()
    backend = MemoryBackend(max_entries=100, scope_share=1.0, clock=clock)
    admitted = refused = 0
    for i in range(5_000):
        try:
            result = await backend.claim(k(i), b"fp", lease=30, ttl=60)
        except StoreFull as exc:
            assert not exc.scope_quota
            refused += 1
        else:
            assert isinstance(result, Claimed)
            assert await backend.complete(k(i), result.token, RESPONSE, ttl=60)
            admitted += 1
        assert len(backend) <= 100
        if i % 1_000 == 999:
            clock.now += 61  # every answer so far expires: room again
    assert admitted == 500 and refused == 4_500
    # The expiry index stays bounded too, not just the dict.
    assert len(backend._expiry) <= 2 * 100 + 1024 + 1


async def test_a_full_store_never_evicts_a_live_completed_record_to_make_room() -> None:
    backend = MemoryBackend(max_entries=10, scope_share=1.0)
    tokens = []
    for i in range(10):
        claimed = await backend.claim(k(i), b"fp", lease=30, ttl=3_600)
        assert isinstance(claimed, Claimed)
        tokens.append(claimed.token)
        await backend.complete(k(i), claimed.token, RESPONSE, ttl=3_600)
    with pytest.raises(StoreFull, match="full"):
        await backend.claim(k("new"), b"fp", lease=30, ttl=3_600)
    # Every completed answer is still there and replayable: a repeat never runs a second time.
    for i in range(10):
        rec = await backend.get(k(i))
        assert rec is not None and rec.state == COMPLETED and rec.response == RESPONSE
        assert decide(Existing(rec, 0.0), b"fp") is Action.REPLAY


async def test_the_byte_budget_refuses_new_claims_and_keeps_an_answer_over_it_as_not_replayable() -> None:
    big = StoredResponse(201, [(b"content-type", b"application/octet-stream")], b"x" * 600)
    backend = MemoryBackend(max_bytes=1_000, scope_share=1.0)
    first = await backend.claim(k("a"), b"fp", lease=30, ttl=3_600)
    second = await backend.claim(k("b"), b"fp", lease=30, ttl=3_600)
    assert isinstance(first, Claimed) and isinstance(second, Claimed)
    assert await backend.complete(k("a"), first.token, big, ttl=3_600)
    assert await backend.complete(k("b"), second.token, big, ttl=3_600)  # does not fit: outcome kept, not bytes
    kept = await backend.get(k("b"))
    assert kept is not None and kept.state == COMPLETED and kept.response is not None
    assert kept.response.replayable is False and kept.response.body == b""
    assert decide(Existing(kept, 0.0), b"fp") is Action.NOT_STORED  # 409 response-not-stored, never a re-run
    assert backend.stored_bytes <= 1_000
    room = 1_000 - backend.stored_bytes
    framing = len(encode_response(StoredResponse(201, [], b"y" * room))) - room
    more = StoredResponse(201, [], b"y" * (room - framing))  # fills it exactly, as encoded
    third = await backend.claim(k("c"), b"fp", lease=30, ttl=3_600)
    assert isinstance(third, Claimed)
    assert await backend.complete(k("c"), third.token, more, ttl=3_600)
    with pytest.raises(StoreFull, match="bytes"):
        await backend.claim(k("d"), b"fp", lease=30, ttl=3_600)


async def test_one_scope_cannot_take_more_than_its_share_and_others_keep_working() -> None:
    backend = MemoryBackend(max_entries=100, scope_share=0.1)

    def key(scope: str, i: int) -> RecordKey:
        return RecordKey.build("mem", scope, f"key-{i}")

    for i in range(10):
        assert isinstance(await backend.claim(key("greedy", i), b"fp", lease=30, ttl=3_600), Claimed)
    with pytest.raises(StoreFull) as raised:
        await backend.claim(key("greedy", 10), b"fp", lease=30, ttl=3_600)
    assert raised.value.scope_quota
    for i in range(10):  # another tenant is not affected
        assert isinstance(await backend.claim(key("modest", i), b"fp", lease=30, ttl=3_600), Claimed)
    # The unscoped key space of single-tenant routes is one tenant: the share does not apply.
    for i in range(50):
        assert isinstance(await backend.claim(k(i), b"fp", lease=30, ttl=3_600), Claimed)


async def test_a_store_full_of_running_operations_refuses_new_claims() -> None:
    backend = MemoryBackend(max_entries=10)
    for i in range(10):
        assert isinstance(await backend.claim(k(i), b"fp", lease=30, ttl=3_600), Claimed)
    with pytest.raises(BackendUnavailable):
        await backend.claim(k("one-too-many"), b"fp", lease=30, ttl=3_600)
    assert all([await backend.get(k(i)) is not None for i in range(10)])


@pytest.mark.parametrize("max_entries", [0, -1])
def test_max_entries_below_one_is_refused(max_entries: int) -> None:
    with pytest.raises(ConfigurationError):
        MemoryBackend(max_entries=max_entries)


async def test_ttl_eviction_drops_expired_records_without_a_read() -> None:
    clock = Clock()
    backend = MemoryBackend(clock=clock)
    for i in range(50):
        await backend.claim(k(i), b"fp", lease=5, ttl=10)
    clock.now += 9.99
    await backend.claim(k("fresh-1"), b"fp", lease=5, ttl=10)
    assert len(backend) == 51
    clock.now += 0.01  # the first 50 reach their expiry exactly
    await backend.claim(k("fresh-2"), b"fp", lease=5, ttl=10)
    assert len(backend) == 2


async def test_expired_record_reads_as_absent_and_is_claimable() -> None:
    clock = Clock()
    backend = MemoryBackend(clock=clock)
    first = await backend.claim(k(1), b"fp", lease=5, ttl=10)
    assert isinstance(first, Claimed)
    assert await backend.complete(k(1), first.token, RESPONSE, ttl=10)
    clock.now += 10
    assert await backend.get(k(1)) is None
    assert isinstance(await backend.claim(k(1), b"other", lease=5, ttl=10), Claimed)


async def test_ttl_of_a_completed_record_runs_from_completion() -> None:
    clock = Clock()
    backend = MemoryBackend(clock=clock)
    first = await backend.claim(k(1), b"fp", lease=30, ttl=10)
    assert isinstance(first, Claimed)
    clock.now += 8
    assert await backend.complete(k(1), first.token, RESPONSE, ttl=10)
    clock.now += 9  # 17 s after the claim, 9 s after completion
    rec = await backend.get(k(1))
    assert rec is not None and rec.state == COMPLETED
    clock.now += 1
    assert await backend.get(k(1)) is None


async def test_the_sweep_keeps_a_completed_record_until_its_completion_expiry_and_then_drops_it() -> None:
    """Completions push no expiry entry of their own (the claim's is pushed again when it comes
    up), so the sweep must neither drop a record completed later nor keep one past its end; a
    completion with a shorter TTL than its claim's is swept at its own, earlier, expiry."""
    clock = Clock()
    backend = MemoryBackend(clock=clock)
    late, short = (
        await backend.claim(k("late"), b"fp", lease=30, ttl=10),
        await backend.claim(k("short"), b"fp", lease=30, ttl=10),
    )
    assert isinstance(late, Claimed) and isinstance(short, Claimed)
    clock.now += 8
    assert await backend.complete(k("late"), late.token, RESPONSE, ttl=10)  # expires at 18
    assert await backend.complete(k("short"), short.token, RESPONSE, ttl=1)  # expires at 9
    clock.now += 1.5  # 9.5: the short one is due, the claims' entries are not yet
    await backend.claim(k("tick-1"), b"fp", lease=5, ttl=100)  # a claim sweeps what is due
    assert len(backend) == 2 and backend.stored_bytes == len(encode_response(RESPONSE))
    clock.now += 1  # 10.5: the claims' entries come up; "late" is completed, due at 18
    await backend.claim(k("tick-2"), b"fp", lease=5, ttl=100)
    assert len(backend) == 3
    rec = await backend.get(k("late"))
    assert rec is not None and rec.state == COMPLETED
    clock.now += 7.5  # 18
    await backend.claim(k("tick-3"), b"fp", lease=5, ttl=100)
    assert len(backend) == 3 and backend.stored_bytes == 0  # "late" swept, with its bytes


async def test_a_repeat_after_the_key_was_answered_anew_gets_the_new_answer_not_a_kept_one() -> None:
    """The store keeps lately replayed answers decoded; a record answered again (after its expiry,
    a new claim, a new answer) is never replayed with the answer kept for the old one."""
    clock = Clock()
    backend = MemoryBackend(clock=clock)
    older, newer = RESPONSE, StoredResponse(202, [(b"content-type", b"text/plain")], b"newer")
    first = await backend.claim(k(1), b"fp", lease=5, ttl=10)
    assert isinstance(first, Claimed) and await backend.complete(k(1), first.token, older, ttl=10)
    for _ in range(3):  # replayed, and kept decoded
        seen = await backend.claim(k(1), b"fp", lease=5, ttl=10)
        assert isinstance(seen, Existing) and seen.record.response == older
    clock.now += 10
    again = await backend.claim(k(1), b"fp", lease=5, ttl=10)
    assert isinstance(again, Claimed) and await backend.complete(k(1), again.token, newer, ttl=10)
    seen = await backend.claim(k(1), b"fp", lease=5, ttl=10)
    assert isinstance(seen, Existing) and seen.record.response == newer
    rec = await backend.get(k(1))
    assert rec is not None and rec.response == newer


async def test_leases_are_judged_by_the_injected_clock() -> None:
    clock = Clock(5_000.0)
    backend = MemoryBackend(clock=clock)
    first = await backend.claim(k(1), b"fp", lease=5, ttl=100)
    assert isinstance(first, Claimed)

    clock.now += 4.9
    live = await backend.claim(k(1), b"fp", lease=5, ttl=100)
    assert isinstance(live, Existing) and live.now == 5_004.9
    assert live.record.lease_until == 5_005.0
    assert decide(live, b"fp") is Action.IN_PROGRESS

    assert await backend.extend(k(1), first.token, lease=5)  # at 5004.9: deadline 5009.9
    clock.now = 5_009.9
    stale = await backend.claim(k(1), b"fp", lease=5, ttl=100)
    assert isinstance(stale, Existing) and decide(stale, b"fp") is Action.EXPIRED

    taken = await backend.takeover(k(1), first.token, b"fp", lease=5, ttl=100)
    assert isinstance(taken, Claimed)
    assert await backend.complete(k(1), first.token, RESPONSE, ttl=100) is False


def test_one_instance_shared_by_several_event_loops_keeps_one_winner_per_key() -> None:
    backend = MemoryBackend()
    winners: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        async def run() -> list[int]:
            results = [await backend.claim(k(i), b"fp", lease=30, ttl=60) for i in range(300)]
            return [i for i, r in enumerate(results) if isinstance(r, Claimed)]

        won = asyncio.run(run())
        with lock:
            winners.extend(won)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(winners) == list(range(300))


async def test_a_full_store_admits_in_constant_time_as_records_expire() -> None:
    clock = Clock()
    backend = MemoryBackend(max_entries=1_000, clock=clock, scope_share=1.0)
    for i in range(20_000):
        clock.now += 0.01
        claimed = await backend.claim(k(i), b"fp", lease=5, ttl=9.995)  # 1,000 live at any time
        assert isinstance(claimed, Claimed)
        assert await backend.complete(k(i), claimed.token, RESPONSE, ttl=9.995)
    assert len(backend) <= 1_000
    assert [await backend.get(k(i)) is not None for i in (0, 18_000, 19_999)] == [False, False, True]


async def test_a_claim_right_after_the_ttl_is_new_without_a_read_in_between() -> None:
    clock = Clock()
    backend = MemoryBackend(clock=clock)
    for i, fingerprint in enumerate((b"fp", b"other")):
        first = await backend.claim(k(i), b"fp", lease=5, ttl=10)
        assert isinstance(first, Claimed)
        assert await backend.complete(k(i), first.token, RESPONSE, ttl=10)
        clock.now += 9.99
        assert isinstance(await backend.claim(k(i), fingerprint, lease=5, ttl=10), Existing)  # still kept
        clock.now += 0.01  # exactly at its expiry, and no get() since
        again = await backend.claim(k(i), fingerprint, lease=5, ttl=10)
        assert isinstance(again, Claimed) and again.token != first.token, "expired: a new claim, not a replay"
    running = await backend.claim(k("running"), b"fp", lease=30, ttl=10)
    clock.now += 10  # an in-progress claim past its TTL, too
    assert isinstance(await backend.claim(k("running"), b"fp", lease=30, ttl=10), Claimed)
    assert isinstance(running, Claimed)
