"""The fault matrix's RabbitMQ rows (tests/support/fault_matrix.py, surface "rabbitmq"), run for real.

One run per (kind, store): a consumer process (tests/faults/rabbitmq_process.py: aio-pika robust
connection, `async with connection, rabbitmq_handler(PointStore(store), work, lease=2) as on_message:`)
gets two messages per point of the surface (keys `<run>-<point>-<i>`, published with
`message_id=<key>`), each stopped at its point (tests/support/fault_points.py); the fault is applied
there; the keys are let go on where the fault leaves the work running; then a consumer in this test
(same queue, same namespace, the plain store, observed) takes whatever is left until the queue is
empty and nothing is unacked, and each key is judged once / blocked / later and compared with
`expected(...)`.

The faults: SIGKILL of the process; SIGTERM (the main task cancelled, the block drains, the keys are
let go after the signal); a channel error on the consumer's channel (a passive declare of a missing
queue on it); the callback tasks aio-pika runs cancelled (and only them: the channel stays open);
the store (a throwaway redis-server with `appendfsync always`, or a throwaway Postgres cluster
stopped `-m immediate`, i.e. every backend killed and crash recovery on start) down for 3 s; the
store stopped (SIGSTOP) for two leases; a throwaway RabbitMQ node SIGKILLed and started again. For
the store and broker faults one key of each point is let go while the server is away, the other
once it is back.

Queues: on the shared broker a quorum queue (`x-delivery-limit` 5) with a dead-letter queue; on the
throwaway node (broker_restart) a classic durable queue with a dead-letter queue, because a quorum
queue on a single throwaway node took over 100 s to recover after a SIGKILL
(tests/test_consumers_broker_restart.py). A key is `blocked` when the consumer in this test
dead-lettered it as outcome unknown (its `outcome_unknown` event; after the lease and its grace)
without running it, its effect as its point says (0 after the claim, 1 mid-effect or before the
store write).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import aio_pika
import aiormq
import asyncpg
import pytest

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs.consumers import rabbitmq_handler
from idem_asgi.observe import Event
from idem_asgi.records import RecordKey
from tests.support.fault_matrix import KINDS, POINTS, STORES, Kind, Point, Store, cells, expected
from tests.support.fault_points import Plan, arrived, cleanup, counts, ensure_ledger, ledger_rows, release, work
from tests.support.rabbitmq_node import RabbitNode, rabbitmq_node
from tests.support.scorecard import report
from tests.support.servers import (
    POSTGRES_DSN,
    REDIS_URL,
    ROOT,
    PostgresCluster,
    RedisProcess,
    postgres_cluster,
    require,
)
from tests.support.store_outage import fsynced_redis
from tests.support.stores import TEST_TABLE

AMQP = os.environ.get("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
SURFACE: Final = "rabbitmq"
LEASE = 2.0
PER_POINT = 2
DOWN = 3.0
"""Seconds a store stays killed (longer than a lease: its renewals fail meanwhile)."""
STALL = 2 * LEASE
QUIET = 1.0
"""Seconds to look again once everything settled: a late redelivery or dead letter would show."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.redis,  # the points protocol and the effects live on the shared Redis
]


def runs() -> list[Any]:
    marks = {"redis": [pytest.mark.redis], "postgres": [pytest.mark.postgres]}
    return [pytest.param(k, s, id=f"{k}-{s}", marks=marks[s]) for k in KINDS for s in STORES if cells(SURFACE, k, s)]


async def until(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> float:
    """Poll `condition` every 50 ms; the seconds it took (fails after `within`)."""
    started = time.monotonic()
    while not await condition():
        assert time.monotonic() - started < within, f"timed out after {within}s waiting for {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


# --- the broker: a queue of the run's own, with its dead-letter queue ------------------------------


class Queues:
    def __init__(self, url: str, run: str, *, quorum: bool) -> None:
        self.url = url
        self.quorum = quorum
        self.queue = f"fault-rmq-{run}"
        self.dlq = f"{self.queue}-dead"
        self.dlx = f"{self.queue}-dlx"

    async def declare(self) -> None:
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            dead = await channel.declare_queue(self.dlq, durable=True)
            dlx = await channel.declare_exchange(self.dlx, aio_pika.ExchangeType.FANOUT, durable=True)
            await dead.bind(dlx)
            arguments: dict[str, Any] = {"x-dead-letter-exchange": self.dlx}
            if self.quorum:
                arguments.update({"x-queue-type": "quorum", "x-delivery-limit": 5})
            await channel.declare_queue(self.queue, durable=True, arguments=arguments)

    async def publish(self, keys: list[str]) -> None:
        """Each key once, persistent, confirmed by the broker."""
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            for key in keys:
                message = aio_pika.Message(
                    b'{"amount": 100}', message_id=key, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                )
                await channel.default_exchange.publish(message, routing_key=self.queue)

    async def depth(self, name: str | None = None) -> int:
        """Messages ready in the queue (not those delivered and unacked)."""
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(name or self.queue, passive=True)
            return declared.declaration_result.message_count or 0

    async def dead_letters(self) -> list[str]:
        """The keys of the messages in the dead-letter queue (taken off it)."""
        found = []
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            dead = await channel.get_queue(self.dlq)
            while (message := await dead.get(no_ack=True, fail=False)) is not None:
                found.append(str(message.message_id))
        return found

    async def delete(self) -> None:
        async with await aio_pika.connect(self.url) as connection:
            channel = await connection.channel()
            for name in (self.queue, self.dlq):
                await channel.queue_delete(name)
            await channel.exchange_delete(self.dlx)


# --- the consumer process ---------------------------------------------------------------------------


class ConsumerProcess:
    """tests/faults/rabbitmq_process.py with `settings` and the plan; its stderr in a file."""

    def __init__(self, tmp_path: Path, settings: dict[str, Any], plan: Plan) -> None:
        self.settings = settings
        self.plan = plan
        self.log = tmp_path / f"consumer-{plan.run}.log"
        self.process: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> ConsumerProcess:
        argv = [sys.executable, "-m", "tests.faults.rabbitmq_process", json.dumps(self.settings)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.plan.env()}
        with self.log.open("wb") as errors:
            self.process = subprocess.Popen(  # noqa: ASYNC220 - its output is read in a thread below
                argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errors
            )
        assert await self.said(30) == b"ready", self.tail()
        return self

    async def said(self, within: float) -> bytes:
        """Its next line of output."""
        assert self.process is not None and self.process.stdout is not None
        return (await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), within)).strip()

    def send(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    async def ended(self, within: float) -> tuple[int, bytes]:
        """Its exit code and the rest of its output."""
        assert self.process is not None and self.process.stdout is not None
        code = await asyncio.to_thread(self.process.wait, within)
        return code, await asyncio.to_thread(self.process.stdout.read)

    async def stop(self) -> None:
        """A graceful stop (SIGTERM: the block drains) of a process whose keys are all stored."""
        self.send(signal.SIGTERM)
        code, said = await self.ended(40)
        assert code == 0 and b"stopped" in said, f"exit {code}, said {said!r}: {self.tail()}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def __aexit__(self, *exc: object) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait, 10)
        if process.stdout is not None:
            process.stdout.close()


# --- the consumer in this test that takes what is left -----------------------------------------------


class Settling(Plan):
    """The run's plan for the work done in this test: the same effects, no point stops it."""

    async def reached(self, key: str, point: Any) -> None:
        return None


class Settler:
    """A consumer in this test (same queue, same namespace, the plain store), observed: what it got,
    what it ran, and each key's events (`replayed`: acked without running; `outcome_unknown`:
    dead-lettered as such)."""

    def __init__(self, queues: Queues, store: Any, namespace: str, plan: Plan) -> None:
        self.queues = queues
        self.store = store
        self.plan = Settling(plan.run, plan.points)
        self.runs: Counter[str] = Counter()
        self.events: dict[str, list[str]] = defaultdict(list)
        self.delivered: list[str] = []
        self.settled = 0
        self.on_message = rabbitmq_handler(store, self.handle, namespace=namespace, lease=LEASE, observer=self.observe)

    def observe(self, event: Event) -> None:
        if event.key is not None:
            self.events[event.key].append(event.name)

    async def handle(self, message: Any) -> str:
        key = str(message.message_id)
        self.runs[key] += 1
        return await work(self.plan, key, self.store)

    async def deliver(self, message: Any) -> None:
        self.delivered.append(str(message.message_id))
        try:
            await self.on_message(message)
        finally:
            self.settled += 1

    async def idle(self, at_least: int) -> bool:
        """It got `at_least` deliveries, settled all it got, and the queue has none ready."""
        if len(self.delivered) < at_least or self.settled < len(self.delivered):
            return False
        return await self.queues.depth() == 0

    @contextlib.asynccontextmanager
    async def consuming(self) -> AsyncIterator[Settler]:
        connection = await aio_pika.connect(self.queues.url)
        try:
            channel = await self._queue_channel(connection)
            await channel.set_qos(prefetch_count=20)
            await (await channel.get_queue(self.queues.queue)).consume(self.deliver)
            yield self
            await channel.close()
        finally:
            await self.on_message.drain(10)
            await connection.close()

    async def _queue_channel(self, connection: Any) -> Any:
        """A channel on which the queue is found: a node just restarted recovers its quorum queues a
        moment after it takes connections, and a passive declare meanwhile is NOT_FOUND (which
        closes the channel it was asked on)."""
        deadline = time.monotonic() + 30
        while True:
            channel = await connection.channel()
            try:
                await channel.get_queue(self.queues.queue)
                return channel
            except aiormq.exceptions.ChannelNotFoundEntity:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def take_all(self, at_least: int) -> None:
        try:
            async with self.consuming():
                await until(lambda: self.idle(at_least), 60, "the queue drained by the test's consumer")
                await asyncio.sleep(QUIET)
                await until(lambda: self.idle(at_least), 60, "the queue drained by the test's consumer")
        finally:
            await self.plan.aclose()


# --- servers the faults break -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitNode]:
    """One throwaway RabbitMQ node for both broker_restart runs (each has its own queues)."""
    with rabbitmq_node(tmp_path_factory.mktemp("rabbit")) as started:
        yield started


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresCluster]:
    """One throwaway Postgres cluster for both Postgres store faults (each run its own namespace)."""
    with postgres_cluster() as started:
        yield started


class StoreServer:
    """Where the run's store is: the shared server, or a throwaway one the fault breaks."""

    def __init__(self, store: Store, url: str, redis: RedisProcess | None, pg: PostgresCluster | None) -> None:
        self.store = store
        self.url = url
        self.redis = redis
        self.pg = pg

    async def kill(self) -> None:
        if self.redis is not None:
            self.redis.kill()
        else:
            assert self.pg is not None
            await asyncio.to_thread(self.pg.stop)  # -m immediate: every backend killed, recovery on start

    async def start(self) -> None:
        if self.redis is not None:
            await asyncio.to_thread(self.redis.start)
        else:
            assert self.pg is not None
            await asyncio.to_thread(self.pg.start)

    def freeze(self) -> None:
        if self.redis is not None:
            self.redis.signal(signal.SIGSTOP)
        else:
            assert self.pg is not None
            self.pg.freeze()

    def thaw(self) -> None:
        if self.redis is not None:
            self.redis.signal(signal.SIGCONT)
        else:
            assert self.pg is not None
            self.pg.thaw()


@contextlib.contextmanager
def store_server(kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreServer]:
    if kind not in ("store_outage", "store_stall"):
        url = REDIS_URL if store == "redis" else POSTGRES_DSN
        require(store, url)
        yield StoreServer(store, url, None, None)
    elif store == "redis":
        with fsynced_redis(tmp_path / "store") as server:
            try:
                yield StoreServer(store, server.url, server, None)
            finally:
                with contextlib.suppress(Exception):
                    server.signal(signal.SIGCONT)
    else:
        pg: PostgresCluster = request.getfixturevalue("cluster")
        try:
            yield StoreServer(store, pg.dsn, None, pg)
        finally:
            pg.thaw()
            if not (pg.data / "postmaster.pid").exists():
                pg.start()


async def plain_store(server: StoreServer, prefix: str) -> Any:
    if server.store == "postgres":
        store = PostgresBackend.from_dsn(server.url, table=TEST_TABLE, min_size=1, max_size=20)
        await store.setup()
        return store
    return RedisBackend.from_url(server.url, prefix=prefix)


@contextlib.asynccontextmanager
async def ledger(url: str) -> AsyncIterator[Any]:
    """A connection of its own to the store's database (one made before a store fault would be dead after it)."""
    conn = await asyncpg.connect(url)
    try:
        yield conn
    finally:
        await conn.close()


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- judging a key ---------------------------------------------------------------------------------------


def judged(point: str, effect: int, ran: int, settle_ran: int, events: list[str], dead: bool) -> str:
    """once / blocked / later, or what happened instead."""
    seen = f"effect {effect}, ran {ran} ({settle_ran} in the settle), dead-lettered {dead}, settle events {events}"
    if dead:
        kept = 0 if point in ("before_claim", "after_claim") else 1
        if "outcome_unknown" in events and settle_ran == 0 and effect == kept:
            return "blocked"
        return f"dead-lettered: {seen}"
    if effect == 1 and ran == 1 and settle_ran == 0:
        return "once"  # run once before the settle; anything the settle got it acked without running
    if effect == 1 and ran == 2 and point == "in_transaction":
        return "once"  # rolled back (its holder killed, or its COMMIT lost with the store), run again once
    if effect == 1 and ran == 1 and settle_ran == 1:
        return "later"
    return f"other: {seen}"


# --- one run: every point of the surface at once, under one kind of fault, on one store ---------------


@pytest.mark.parametrize(("kind", "store"), runs())
async def test_every_rabbitmq_cell_ends_as_the_fault_matrix_says(
    kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """All of the surface's points under one fault, on one store; every key judged and compared with
    the table: the work the fault leaves running (a graceful stop, a lost channel, a cancelled
    callback, a store or broker away) finishes and is applied once; after a SIGKILL a key before
    its claim runs later, once; one after its store write or inside an uncommitted transaction
    ends once; the others are dead-lettered as outcome unknown, never run again."""
    require("redis", REDIS_URL)
    started = time.monotonic()
    expect = {point: expected(SURFACE, point, kind, store) for point in POINTS}
    points: dict[str, Point] = {}
    run = uuid.uuid4().hex[:10]
    for point, outcome in expect.items():
        if outcome is not None:
            points.update({f"{run}-{point}-{i}": point for i in range(PER_POINT)})
    keys = list(points)
    first = [k for k in keys if k.endswith("-0")]  # let go while a store or broker is away
    second = [k for k in keys if k not in first]  # let go once it is back
    plan = Plan(run, points)
    namespace = f"fault-rmq-{run}"
    prefix = f"fault:{run}:store:"  # under the run's keys: `cleanup` drops them
    timings: dict[str, float] = {}
    broker: RabbitNode | None = None
    if kind == "broker_restart":
        broker = request.getfixturevalue("node")
        queues = Queues(broker.url, run, quorum=False)
    else:
        require("rabbitmq", AMQP)
        queues = Queues(AMQP, run, quorum=True)
    with store_server(kind, store, tmp_path, request) as server:
        test_store = await plain_store(server, prefix)
        if store == "postgres":
            async with ledger(server.url) as conn:
                await ensure_ledger(conn)
        await queues.declare()
        try:
            await queues.publish(keys)
            settings = {
                "amqp": queues.url,
                "queue": queues.queue,
                "prefetch": 20,
                "store": store,
                "store_url": server.url,
                "prefix": prefix,
                "table": TEST_TABLE,
                "namespace": namespace,
                "lease": LEASE,
            }
            async with ConsumerProcess(tmp_path, settings, plan) as process:
                came = await arrived(plan, keys, 30)
                assert came == set(keys), f"never reached their points: {sorted(set(keys) - came)}: {process.tail()}"
                timings["arrived_s"] = time.monotonic() - started
                fault = time.monotonic()

                async def all_stored() -> bool:
                    for key in keys:
                        record = await test_store.get(RecordKey.build(namespace, None, key))
                        if record is None or record.response is None:
                            return False
                    return True

                async def stored_then_stopped() -> None:
                    """Once every key is stored (the work went on) or 35 s passed (it did not: the keys
                    are judged by what the consumer in this test finds), a graceful stop."""
                    waited = time.monotonic()
                    while not await all_stored():
                        if time.monotonic() - waited > 35:
                            break
                        await asyncio.sleep(0.05)
                    timings["stored_s"] = time.monotonic() - waited
                    await process.stop()

                if kind == "sigkill":
                    process.send(signal.SIGKILL)
                    code, _ = await process.ended(10)
                    assert code == -signal.SIGKILL
                elif kind == "graceful_stop":
                    process.send(signal.SIGTERM)
                    assert await process.said(10) == b"stopping"
                    await release(plan, keys)
                    code, said = await process.ended(40)
                    assert code == 0 and b"stopped" in said, f"exit {code}, said {said!r}: {process.tail()}"
                elif kind in ("channel_lost", "cancelled"):
                    await plan.redis.rpush(f"fault:{run}:trigger", kind)
                    answer = await plan.redis.blpop([f"fault:{run}:fault"], timeout=15)
                    assert answer is not None, process.tail()
                    want = "channel_lost closed" if kind == "channel_lost" else f"cancelled {len(keys)}"
                    assert text(answer[1]) == want, f"the fault was not applied as meant: {answer[1]!r}"
                    await release(plan, keys)
                    await stored_then_stopped()
                elif kind == "store_outage":
                    await server.kill()
                    await release(plan, first)
                    await asyncio.sleep(DOWN)
                    await server.start()
                    await release(plan, second)
                    await stored_then_stopped()
                elif kind == "store_stall":
                    server.freeze()
                    try:
                        await release(plan, first)
                        await asyncio.sleep(STALL)
                    finally:
                        server.thaw()
                    await release(plan, second)
                    await stored_then_stopped()
                else:
                    assert broker is not None
                    await asyncio.to_thread(broker.kill)
                    await release(plan, first)
                    await asyncio.sleep(1.0)
                    await asyncio.to_thread(broker.start)
                    await release(plan, second)
                    await stored_then_stopped()
                timings["fault_s"] = time.monotonic() - fault
            settle = time.monotonic()
            settler = Settler(queues, test_store, namespace, plan)
            await settler.take_all(len(keys) if kind == "sigkill" else 0)
            timings["settle_s"] = time.monotonic() - settle
            left, dead = await queues.depth(), await queues.dead_letters()
            effects, ran = await counts(plan, keys), await counts(plan, keys, "ran")
            if store == "postgres":
                async with ledger(server.url) as conn:
                    rows = await ledger_rows(conn, plan, keys)
                effects.update({k: rows[k] for k in keys if points[k] == "in_transaction"})
        finally:
            with contextlib.suppress(Exception):
                await queues.delete()
            if store == "postgres":
                with contextlib.suppress(Exception):
                    async with ledger(server.url) as conn:
                        await conn.execute("DELETE FROM fault_ledger WHERE run = $1", run)
            await test_store.aclose()
            await cleanup(plan)
            await plan.aclose()
    outcomes = {
        k: judged(points[k], effects[k], ran[k], settler.runs[k], settler.events.get(k, []), k in dead) for k in keys
    }
    mismatches = {k: (expect[points[k]], outcomes[k]) for k in keys if outcomes[k] != expect[points[k]]}
    by_point: dict[str, dict[str, Any]] = {}
    for point in POINTS:
        mine = [k for k in keys if points[k] == point]
        if mine:
            by_point[point] = {
                "expected": expect[point],
                "outcomes": dict(Counter(outcomes[k] for k in mine)),
                "effect": sum(effects[k] for k in mine),
                "ran": sum(ran[k] for k in mine),
                "settle_ran": sum(settler.runs[k] for k in mine),
                "settle_got": sum(settler.delivered.count(k) for k in mine),
            }
    report(
        {
            "test": "fault_matrix",
            "surface": SURFACE,
            "kind": kind,
            "store": store,
            "keys": len(keys),
            "points": by_point,
            "dead_lettered": len(dead),
            "left_in_queue": left,
            "mismatches": len(mismatches),
            **{name: round(value, 2) for name, value in timings.items()},
            "wall_s": round(time.monotonic() - started, 2),
        },
        tag="FAULTMATRIX",
    )
    assert left == 0, f"{left} messages left in the queue"
    assert not mismatches, "cells not as the table says (key: (expected, what happened)): " + json.dumps(
        mismatches, indent=1
    )
    assert sorted(dead) == sorted(k for k in keys if outcomes[k] == "blocked"), "dead letters other than the blocked"
