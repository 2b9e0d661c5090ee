"""Lost acknowledgements between the middleware and its STORE, through `tests.faultproxy.StoreProxy`.

The middleware runs in process; its store connections go through a byte-level proxy to a throwaway
store started here (a private `redis-server`, a private PostgreSQL cluster), so every fault stays
off the shared servers. The ledger (what the handler really ran) is written straight to the same
throwaway store, not through the proxy.

Each case sends 5 keys at once with one fault armed for each of them, then settles every key: it
retries like a client (bounded: lease + 2.5 s) until the key answers a stored 2xx, runs now, or
says `outcome-unknown`, and asks once more. The cases:

- the reply to the CLAIM is lost: silently (the client's own timeout fires), or with the
  connection reset (the driver retries once on a fresh connection), or twice (the retry's reply
  is lost too); or the claim request itself is lost;
- the same for the COMPLETION (the answer is stored but the middleware never hears it, or the
  store never gets it);
- a blackhole (nothing answers for ~1 s), and a 100 ms delay on every reply.

Asserted every time: no key executes twice, no key is left "in progress" forever (after the lease
it is `outcome-unknown` at worst), no 5xx other than the 503 of an unreachable store, and what
each case is expected to end as (see CASES). One scorecard line per case.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.backends.redis._scripts import CLAIM, COMPLETE
from idem_asgi.records import RecordKey
from tests.crash_app import build
from tests.support.faultproxy import StoreProxy, evalsha_of, pg_execute
from tests.support.scorecard import (
    Answer,
    Ledger,
    PostgresLedger,
    RedisLedger,
    Scorecard,
    asgi_post,
    assert_zero_tolerance,
    final_state,
)
from tests.support.servers import PostgresCluster, RedisProcess, postgres_cluster, redis_process

pytestmark = pytest.mark.slow

KEYS = 5
LEASE = 1.0
REDIS_TIMEOUT = 0.5
PG_TIMEOUT = 1.0
TABLE = "idem_lost_acks"


@dataclass(frozen=True)
class Case:
    name: str
    target: str  # "claim" | "complete" | "all" (blackhole, delay)
    action: str  # a StoreProxy action, or "blackhole" / "delay"
    per_key: int  # faults armed per key: 1 = the first attempt, 2 = the driver's retry as well
    first: frozenset[str]  # what the first attempt may answer
    final: frozenset[str]  # what the key may end as
    runs: int  # executions per key, from the ledger; -1: 1 if the key ended completed, else 0


def case(name: str, target: str, action: str, per_key: int, first: str, final: str, runs: int = 1) -> Case:
    return Case(name, target, action, per_key, frozenset(first.split("|")), frozenset(final.split("|")), runs)


REDIS_CASES = [
    # The claim landed, its reply did not: 503 (the app never ran); the backend removes the orphan
    # claim in the background (fenced by its token), so the retry runs the request, once.
    case("claim_reply_lost", "claim", "drop_reply", 1, "503", "completed"),
    # Reset after the reply was swallowed: redis-py retries once on a fresh connection and the
    # claim script recognises its own token: the first attempt simply succeeds.
    case("claim_reply_lost_reset", "claim", "drop_reply_reset", 1, "first", "completed"),
    case("claim_reply_lost_reset_twice", "claim", "drop_reply_reset", 2, "503", "completed"),
    case("claim_request_lost_twice", "claim", "reset_before", 2, "503", "completed"),
    # The answer is stored, the middleware does not know: the client still gets it, retries replay it.
    case("complete_reply_lost", "complete", "drop_reply", 1, "first", "completed"),
    case("complete_reply_lost_reset", "complete", "drop_reply_reset", 1, "first", "completed"),
    case("complete_reply_lost_reset_twice", "complete", "drop_reply_reset", 2, "first", "completed"),
    # The completion never reached the store: the client got its answer, the claim is kept (never
    # released: the effect happened) and the middleware writes the answer again in the background
    # (idem_asgi/claims/late_writes.py): retries get 409 in progress meanwhile, then replays.
    case("complete_request_lost_twice", "complete", "reset_before", 2, "first", "completed"),
    case("blackhole_1s", "all", "blackhole", 1, "503", "completed"),
    case("delay_100ms", "all", "delay", 1, "first", "completed"),
]

PG_CASES = [
    # Claim committed, reply lost with the connection: the backend runs the statement again on a
    # fresh connection, finds its own token, and owns the key: the first attempt succeeds.
    case("claim_reply_lost_reset", "claim", "drop_reply_reset", 1, "first", "completed"),
    # Both replies lost: 503 "not run, retry later"; the committed claim stays behind until the
    # backend's orphan sweep removes it. A retry that meets it gets 409 meanwhile; if the sweep
    # loses the race with the lease, outcome-unknown with NOTHING executed (accounted, never twice).
    case("claim_reply_lost_reset_twice", "claim", "drop_reply_reset", 2, "503", "completed|outcome_unknown", -1),
    case("claim_reply_lost_silent", "claim", "drop_reply", 1, "503", "completed|outcome_unknown", -1),
    # Execute forwarded without its Sync, then reset: the server rolls the claim back.
    case("claim_rolled_back_twice", "claim", "reset_after_forward", 2, "503", "completed"),
    # The completion committed, its reply never came (the backend's timeout fires; not retried).
    case("complete_reply_lost_silent", "complete", "drop_reply", 1, "first", "completed"),
    case("complete_reply_lost_reset", "complete", "drop_reply_reset", 1, "first", "completed"),
    case("complete_reply_lost_reset_twice", "complete", "drop_reply_reset", 2, "first", "completed"),
    # Rolled back twice: the background retry of the completion stores it on a later attempt.
    case("complete_rolled_back_twice", "complete", "reset_after_forward", 2, "first", "completed"),
    case("blackhole_1s", "all", "blackhole", 1, "503", "completed"),
    case("delay_100ms", "all", "delay", 1, "first", "completed"),
]


# -- throwaway stores -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    with redis_process(tmp_path_factory.mktemp("lost-acks-redis")) as server:
        yield server


@pytest.fixture(scope="module")
def pg_server() -> Iterator[PostgresCluster]:
    with postgres_cluster() as cluster:
        yield cluster


class Rig:
    """Proxy + backend through it + the app; a direct backend and ledger beside the proxy."""

    def __init__(self, kind: str, port: int, dsn_or_url: str) -> None:
        self.kind = kind
        self.run = uuid.uuid4().hex[:10]
        self.namespace = f"lost-{self.run}"
        self.proxy = StoreProxy(port, protocol="resp" if kind == "redis" else "pg")
        self.upstream = dsn_or_url
        self.ledger: Ledger = (
            RedisLedger(dsn_or_url, self.run) if kind == "redis" else PostgresLedger(dsn_or_url, self.run)
        )
        self.backend: Any = None
        self.direct: Any = None
        self.app: Any = None

    async def start(self) -> None:
        await self.proxy.start()
        await self.ledger.setup()
        prefix = f"idem-rel:{self.namespace}:"
        if self.kind == "redis":
            url = f"redis://127.0.0.1:{self.proxy.port}/0"
            self.backend = RedisBackend.from_url(url, prefix=prefix, timeout=REDIS_TIMEOUT)
            self.direct = RedisBackend.from_url(self.upstream, prefix=prefix)
        else:
            dsn = f"postgresql://postgres@127.0.0.1:{self.proxy.port}/postgres?sslmode=disable"
            # A connection for each key, so every armed fault meets its statement (no pool wait).
            self.backend = PostgresBackend.from_dsn(dsn, table=TABLE, timeout=PG_TIMEOUT, min_size=1, max_size=2 * KEYS)
            await self.backend.setup()
            self.direct = PostgresBackend.from_dsn(self.upstream, table=TABLE, min_size=1, max_size=2)
        self.app, _ = build(self.backend, self.ledger, namespace=self.namespace, lease=LEASE, ttl=120, delay=0.02)
        warm = await asgi_post(self.app, f"warm-{self.run}")  # scripts loaded, statements prepared
        assert warm.outcome == "first", warm

    async def aclose(self) -> None:
        try:
            if self.backend is not None:
                await self.backend.aclose()
            if self.direct is not None:
                await self.direct.aclose()
            await self.ledger.aclose()
        finally:
            await self.proxy.stop()

    def arm(self, c: Case, keys: list[str]) -> None:
        """One rule per key (its first `per_key` statements), so concurrent keys never steal each other's fault."""
        if c.action == "delay":
            self.proxy.delay(0.1)
        elif c.action == "blackhole":
            self.proxy.blackhole()
        else:
            for key in keys:
                self.proxy.fault(self.match(c.target, key), action=c.action, count=c.per_key)

    def match(self, target: str, key: str) -> Any:
        if self.kind == "redis":
            name = self.backend._key(RecordKey.build(self.namespace, None, key))
            return evalsha_of(CLAIM if target == "claim" else COMPLETE, name)
        # The row's key column is the digest (keys are hashed at rest). The fragments match the
        # one-row statement and the batched one (group commit) alike; a batch carrying several armed
        # keys meets each of their faults at once, as their statements sent one by one would have.
        row_key = self.backend._id(RecordKey.build(self.namespace, None, key))[2]
        claim = "ON CONFLICT (namespace, scope, key) DO NOTHING"
        return pg_execute(claim if target == "claim" else "SET state = 'c'", param=row_key.encode())

    async def store_state(self, key: str) -> str:
        record = await self.direct.get(RecordKey.build(self.namespace, None, key))
        return "absent" if record is None else str(record.state)


@pytest.fixture
async def redis_rig(redis_server: RedisProcess) -> AsyncIterator[Rig]:
    rig = Rig("redis", redis_server.port, redis_server.url)
    try:
        await rig.start()
        yield rig
    finally:
        await rig.aclose()


@pytest.fixture
async def pg_rig(pg_server: PostgresCluster) -> AsyncIterator[Rig]:
    rig = Rig("postgres", pg_server.port, pg_server.dsn)
    try:
        await rig.start()
        yield rig
    finally:
        await rig.aclose()


# -- the run ------------------------------------------------------------------------------------


async def settle(app: Any, key: str, *, within: float) -> list[Answer]:
    """Retry like a client until the key answers a 2xx or outcome-unknown, then once more (bounded)."""
    answers: list[Answer] = []
    deadline = time.monotonic() + within
    for _ in range(100):
        answer = await asgi_post(app, key)
        answers.append(answer)
        if answer.outcome in ("first", "replay", "409:outcome-unknown"):
            answers.append(await asgi_post(app, key))
            break
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    return answers


async def run_case(rig: Rig, c: Case) -> dict[str, Any]:
    keys = [f"{rig.run}-{c.name}-{i}" for i in range(KEYS)]
    card = Scorecard(f"lost_ack_{c.name}", rig.kind, keys=KEYS, dup_per_key=1)
    rig.arm(c, keys)
    first = await asyncio.gather(*(asgi_post(rig.app, k) for k in keys))
    if c.action == "blackhole":
        await asyncio.sleep(max(0.0, 1.0 - max(a.latency for a in first)))
        card.fault("blackhole", 1)
        card.fault("connections_reset_after_blackhole", rig.proxy.restore())
    elif c.action == "delay":
        card.fault("delay_100ms_per_reply", rig.proxy.units)
    else:
        card.fault(f"{c.action}@{c.target}", rig.proxy.applied())
    armed = rig.proxy.applied()
    rig.proxy.pass_through()
    card.add(*first)
    settled = await asyncio.gather(*(settle(rig.app, k, within=LEASE + 2.5) for k in keys))
    for answers in settled:
        card.add(*answers)
    counts = await rig.ledger.counts(keys)
    final = {k: final_state([*answers]) for k, answers in zip(keys, settled, strict=True)}
    states = Counter([await rig.store_state(k) for k in keys])
    result = card.finish(
        counts,
        final=final,
        extra={
            "first_attempt": dict(Counter(a.outcome for a in first)),
            "store_records": dict(states),
            "orphans_pending": getattr(rig.backend, "pending_orphans", None),
            "batch_sizes": getattr(rig.backend, "batch_sizes", None),
        },
    )
    await rig.ledger.cleanup()

    assert_zero_tolerance(result)
    if c.action in ("delay", "blackhole"):
        pass
    elif rig.kind == "redis":
        # Redis's script calls share one auto-pipelined connection: a reset (or a reply lost until
        # the timeout drops the connection) hits every key in flight on it, and their retries meet
        # the next armed fault together, so fewer faults fire than are armed. Every key still sees
        # an attempt fail as armed: what each answered and ended as is asserted below.
        assert c.per_key <= armed <= KEYS * c.per_key, f"{c.name}: {armed} faults fired"
    else:
        assert armed == KEYS * c.per_key, f"{c.name}: {armed} faults fired, {KEYS * c.per_key} armed"
    firsts = {a.outcome for a in first}
    assert firsts <= c.first, f"{c.name}: first attempts answered {sorted(firsts)}, expected {sorted(c.first)}"
    assert set(final.values()) <= c.final, f"{c.name}: keys ended {final}, expected {sorted(c.final)}"
    assert "stuck_in_progress" not in final.values()
    assert result["5xx"] == result["503"], result  # the only 5xx is the store-unavailable refusal
    for key, answers in zip(keys, settled, strict=True):
        want = c.runs if c.runs >= 0 else (1 if final[key] == "completed" else 0)
        assert counts[key] == want, f"{c.name}: {key} ran {counts[key]} times, expected {want}: {answers}"
    if c.first == {"first"}:
        # The client of the first attempt got the answer; a replay must be that very answer.
        for a, answers in zip(first, settled, strict=True):
            for later in answers:
                if later.replayed:
                    assert later.canonical()[1:] == a.canonical()[1:], c.name
    return result


@pytest.mark.redis
@pytest.mark.parametrize("c", REDIS_CASES, ids=[c.name for c in REDIS_CASES])
async def test_redis_lost_acks(redis_rig: Rig, c: Case) -> None:
    await run_case(redis_rig, c)


@pytest.mark.postgres
@pytest.mark.parametrize("c", PG_CASES, ids=[c.name for c in PG_CASES])
async def test_postgres_lost_acks(pg_rig: Rig, c: Case) -> None:
    await run_case(pg_rig, c)


STORM_KEYS, STORM_DUPS, RESETS = 50, 5, 5


async def storm_with_resets(rig: Rig) -> dict[str, Any]:
    """50 keys x 5 duplicates in a seeded random order over ~2 s while every store connection is reset 5 times."""
    seed = 1953
    rng = random.Random(seed)
    keys = [f"{rig.run}-storm-{i:02d}" for i in range(STORM_KEYS)]
    order = [k for k in keys for _ in range(STORM_DUPS)]
    rng.shuffle(order)
    card = Scorecard("lost_ack_storm_with_connection_resets", rig.kind, seed=seed, keys=STORM_KEYS)
    card.dup_per_key = STORM_DUPS

    async def one(i: int, key: str) -> Answer:
        await asyncio.sleep(i * 0.008)  # spread over ~2 s
        return await asgi_post(rig.app, key)

    async def resets() -> int:
        # 300 ms apart: enough for the reconnections of one reset to settle before the next (the
        # proxy shares this event loop; tighter resets only measure how fast Python can reconnect).
        total = 0
        for _ in range(RESETS):
            await asyncio.sleep(0.3)
            total += rig.proxy.reset_all()
        return total

    storm, reset = await asyncio.gather(asyncio.gather(*(one(i, k) for i, k in enumerate(order))), resets())
    card.fault("reset_all_connections", RESETS)
    card.fault("connections_reset", reset)
    card.add(*storm)
    settled = await asyncio.gather(*(settle(rig.app, k, within=LEASE + 2.5) for k in keys))
    for answers in settled:
        card.add(*answers)
    counts = await rig.ledger.counts(keys)
    final = {k: final_state(answers) for k, answers in zip(keys, settled, strict=True)}
    result = card.finish(
        counts, final=final, extra={"storm": dict(Counter(a.outcome for a in storm)), "requests_in_storm": len(storm)}
    )
    await rig.ledger.cleanup()
    assert_zero_tolerance(result)
    # A completion lost in the storm turns into outcome-unknown once its 1 s lease is over, mid-storm.
    allowed = {"first", "replay", "409:request-in-progress", "409:outcome-unknown", "503"}
    assert {a.outcome for a in storm} <= allowed, result["outcomes"]
    assert result["5xx"] == result["503"], result
    assert set(final.values()) <= {"completed", "outcome_unknown"}, final
    return result


@pytest.mark.redis
async def test_redis_storm_with_connection_resets(redis_rig: Rig) -> None:
    await storm_with_resets(redis_rig)


@pytest.mark.postgres
async def test_postgres_storm_with_connection_resets(pg_rig: Rig) -> None:
    await storm_with_resets(pg_rig)


@pytest.mark.postgres
async def test_postgres_503_leaves_the_key_retryable(pg_rig: Rig) -> None:
    """Contract: 'store unreachable: 503 ... nothing stored'; a client retrying after a 503 gets the request run."""
    key = f"{pg_rig.run}-ghost"
    # Both the claim and the backend's own retry commit, and both replies are lost with the connection.
    pg_rig.proxy.fault(pg_rig.match("claim", key), action="drop_reply_reset", count=2)
    refused = await asgi_post(pg_rig.app, key)
    pg_rig.proxy.pass_through()
    assert refused.status == 503 and refused.problem == "store-unavailable", refused
    answers = await settle(pg_rig.app, key, within=LEASE + 2.5)
    counts = await pg_rig.ledger.counts([key])
    assert final_state(answers) == "completed", [a.outcome for a in answers]
    assert counts[key] == 1
