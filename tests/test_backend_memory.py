"""MemoryBackend only: its bounds (TTL eviction, max_entries) and its injectable clock."""

from __future__ import annotations

import asyncio
import threading

import pytest

from idem_asgi._decide import Action, decide
from idem_asgi.backends import MemoryBackend
from idem_asgi.errors import BackendUnavailable, ConfigurationError
from idem_asgi.records import COMPLETED, Claimed, Existing, RecordKey, StoredResponse

RESPONSE = StoredResponse(201, [(b"content-type", b"text/plain")], b"ok")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def k(i: int | str) -> RecordKey:
    return RecordKey.build("mem", None, f"key-{i}")


async def test_max_entries_bound_holds_under_a_flood_of_keys() -> None:
    backend = MemoryBackend(max_entries=100)
    for i in range(5_000):
        result = await backend.claim(k(i), b"fp", lease=30, ttl=3_600)
        assert isinstance(result, Claimed)
        assert await backend.complete(k(i), result.token, RESPONSE, ttl=3_600)
        assert len(backend) <= 100
    # The expiry index stays bounded too, not just the dict.
    assert len(backend._expiry) <= 2 * 100 + 1024 + 1


async def test_max_entries_evicts_the_oldest_completed_answer_first() -> None:
    backend = MemoryBackend(max_entries=10)
    running = await backend.claim(k("running"), b"fp", lease=30, ttl=3_600)
    for i in range(25):
        claimed = await backend.claim(k(i), b"fp", lease=30, ttl=3_600)
        assert isinstance(claimed, Claimed)
        await backend.complete(k(i), claimed.token, RESPONSE, ttl=3_600)
    assert [await backend.get(k(i)) is not None for i in range(25)] == [False] * 16 + [True] * 9
    kept = await backend.get(k("running"))
    assert isinstance(running, Claimed) and kept is not None and kept.token == running.token


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


async def test_a_full_store_evicts_in_constant_order_and_keeps_its_bound() -> None:
    backend = MemoryBackend(max_entries=1_000)
    for i in range(20_000):
        claimed = await backend.claim(k(i), b"fp", lease=30, ttl=3_600)
        assert isinstance(claimed, Claimed)
        assert await backend.complete(k(i), claimed.token, RESPONSE, ttl=3_600)
    assert len(backend) == 1_000
    assert [await backend.get(k(i)) is not None for i in (0, 18_999, 19_000, 19_999)] == [False, False, True, True]
