"""Consumers interrupted while nobody crashed (a graceful stop, a channel or subscription that ends
under a running handler) never apply a message twice, and never dead-letter one that was applied or
never started; consumers that did die (SIGKILL, or a process that exits with handlers still running)
leave their claims kept, resolved on the redelivery by the Postgres `transaction()` state or the
`recover=` hook.

Against the real RabbitMQ (127.0.0.1:5672) and NATS JetStream (127.0.0.1:4222) brokers, with the
shared Redis as the store (Postgres where a case needs `transaction()`). Effects are counted with
INCR in Redis (or rows in a ledger table of the test's own), outside the adapter. A consumer that
must be stopped by a signal is a process of its own: tests/interrupted_consumer.py. Each test has
its own quorum queue (`x-delivery-limit` 3) with a dead-letter queue, or its own stream with a
dead-letter stream of JetStream's MAX_DELIVERIES / MSG_TERMINATED advisories; all deleted afterwards.
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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aio_pika
import asyncpg
import nats
import pytest
import redis.asyncio as aioredis
from aio_pika.exceptions import ChannelNotFoundEntity
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs import stored_result
from idem_asgi.jobs.consumers import nats_handler, rabbitmq_handler
from idem_asgi.records import Record, RecordKey, StoredResponse
from tests.support.scorecard import report
from tests.support.servers import POSTGRES_DSN, REDIS_URL, ROOT, require
from tests.support.stores import TEST_TABLE

if TYPE_CHECKING:
    from idem_asgi.claims.recovery import RecoverHook

AMQP = os.environ.get("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")
pytestmark = [pytest.mark.redis]
HOLD = 1.5
"""Seconds a handler sleeps past its effect when the test stops its consumer gracefully."""
FOREVER = 60.0
"""Seconds a handler sleeps past its effect when the test kills its consumer there."""
ACK_WAIT = 2.0


async def until(condition: Callable[[], Awaitable[bool]], within: float, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, f"timed out after {within}s waiting for {what or condition}"
        await asyncio.sleep(0.05)


# --- rigs: a queue or stream of the test's own -----------------------------------------------------


class Rig:
    """What both brokers' rigs share: the run's names, and the effect counters in Redis."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.prefix = f"idem-test:{run}:"
        self.counter = f"idem-test-effects:{run}:"
        self.effects = aioredis.Redis.from_url(REDIS_URL)

    async def counts(self, ids: list[str]) -> list[int]:
        return [int(v or 0) for v in await self.effects.mget([self.counter + i for i in ids])]

    async def applied(self, ids: list[str]) -> bool:
        return all(await self.counts(ids))

    async def forget(self) -> None:
        keys = [k async for k in self.effects.scan_iter(match=f"idem-test*{self.run}*")]
        if keys:
            await self.effects.delete(*keys)
        await self.effects.aclose()


class Rabbit(Rig):
    def __init__(self, run: str, connection: Any, channel: Any) -> None:
        super().__init__(run)
        self.queue = f"idem-test-{run}"
        self.dlq = f"idem-test-{run}-dead"
        self.connection = connection
        self.channel = channel

    async def publish(self, message_id: str) -> None:
        message = aio_pika.Message(
            b'{"amount": 100}', message_id=message_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
        )
        await self.channel.default_exchange.publish(message, routing_key=self.queue)

    async def depth(self, name: str) -> int:
        """Messages ready in the queue (not those delivered and unacked)."""
        async with self.connection.channel() as channel:
            queue = await channel.declare_queue(name, passive=True)
            return int(queue.declaration_result.message_count)


@contextlib.asynccontextmanager
async def rabbit_rig() -> AsyncIterator[Rabbit]:
    require("rabbitmq", AMQP)
    require("redis", REDIS_URL)
    connection = await aio_pika.connect_robust(AMQP)
    channel = await connection.channel()
    r = Rabbit(uuid.uuid4().hex[:10], connection, channel)
    dead = await channel.declare_queue(r.dlq, durable=True)
    dlx = await channel.declare_exchange(f"{r.queue}-dlx", aio_pika.ExchangeType.FANOUT, durable=True)
    await dead.bind(dlx)
    arguments = {"x-queue-type": "quorum", "x-delivery-limit": 3, "x-dead-letter-exchange": dlx.name}
    await channel.declare_queue(r.queue, durable=True, arguments=arguments)
    try:
        yield r
    finally:
        async with connection.channel() as cleanup:
            for name in (r.queue, r.dlq):
                await cleanup.queue_delete(name)
            await cleanup.exchange_delete(f"{r.queue}-dlx")
        await r.forget()
        await connection.close()


class Jet(Rig):
    def __init__(self, run: str, connection: Any) -> None:
        super().__init__(run)
        self.stream = f"IDEM_TEST_{run}"
        self.dead = f"IDEM_TEST_{run}_DEAD"
        self.subject = f"idem-test.{run}.payments"
        self.durable = "workers"
        self.connection = connection
        self.js = connection.jetstream()

    async def publish(self, message_id: str) -> None:
        await self.js.publish(self.subject, b'{"amount": 100}', headers={"Nats-Msg-Id": message_id})

    async def settled(self, durable: str | None = None) -> bool:
        info = await self.js.consumer_info(self.stream, durable or self.durable)
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    async def dead_letters(self) -> int:
        return int((await self.js.stream_info(self.dead)).state.messages)


@contextlib.asynccontextmanager
async def jet_rig() -> AsyncIterator[Jet]:
    require("nats", NATS)
    require("redis", REDIS_URL)
    connection = await nats.connect(NATS)
    r = Jet(uuid.uuid4().hex[:10], connection)
    await r.js.add_stream(StreamConfig(name=r.stream, subjects=[f"idem-test.{r.run}.>"]))
    advisories = [
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{r.stream}.*",
        f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{r.stream}.*",
    ]
    await r.js.add_stream(StreamConfig(name=r.dead, subjects=advisories))
    config = ConsumerConfig(durable_name=r.durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT, max_deliver=3)
    await r.js.add_consumer(r.stream, config)
    try:
        yield r
    finally:
        for name in (r.stream, r.dead):
            await r.js.delete_stream(name)
        await r.forget()
        await connection.close()


@pytest.fixture
async def rabbit() -> AsyncIterator[Rabbit]:
    async with rabbit_rig() as rig:
        yield rig


@pytest.fixture
async def jet() -> AsyncIterator[Jet]:
    async with jet_rig() as rig:
        yield rig


@pytest.fixture(params=["rabbitmq", "nats"])
async def either(request: pytest.FixtureRequest) -> AsyncIterator[Rabbit | Jet]:
    """A RabbitMQ rig, then a NATS one."""
    rig = rabbit_rig() if request.param == "rabbitmq" else jet_rig()
    async with rig as made:
        yield made


@pytest.fixture
async def ledger() -> AsyncIterator[str]:
    """A ledger table of the test's own (one row per application, no unique constraint), dropped
    afterwards with the test's records."""
    require("postgres", POSTGRES_DSN)
    table = f"idem_test_ledger_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        await conn.execute(f"CREATE TABLE {table} (message_id text NOT NULL)")
        yield table
    finally:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.execute(f"DELETE FROM {TEST_TABLE} WHERE namespace = $1", table)
        await conn.close()


async def ledger_counts(table: str, ids: list[str]) -> list[int]:
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        rows = await conn.fetch(f"SELECT message_id, count(*) AS n FROM {table} GROUP BY message_id")
    finally:
        await conn.close()
    found = {row["message_id"]: int(row["n"]) for row in rows}
    return [found.get(i, 0) for i in ids]


async def postgres_store() -> PostgresBackend:
    store = PostgresBackend.from_dsn(POSTGRES_DSN, table=TEST_TABLE, min_size=1, max_size=10)
    await store.setup()
    return store


# --- the consumer process, and the consumers in this test that take over after it ---------------


class ConsumerProcess:
    """tests/interrupted_consumer.py with `settings`, its stderr in a file (shown when it fails)."""

    def __init__(self, tmp_path: Path, **settings: Any) -> None:
        self.settings = settings
        self.log = tmp_path / f"consumer-{uuid.uuid4().hex[:6]}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.signalled = 0.0
        self.took = 0.0  # seconds from the signal to its exit

    async def __aenter__(self) -> ConsumerProcess:
        argv = [sys.executable, "-m", "tests.interrupted_consumer", json.dumps(self.settings)]
        with self.log.open("wb") as errors:
            self.process = subprocess.Popen(  # noqa: ASYNC220 - its output is read in a thread below
                argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=errors
            )
        assert self.process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), 30)
        assert line.strip() == b"ready", self.tail()
        return self

    def send(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.signalled = time.monotonic()
        self.process.send_signal(sig)

    async def ended(self, within: float) -> tuple[int, bytes]:
        """Its exit code and the rest of its output, once it exited on its own."""
        assert self.process is not None and self.process.stdout is not None
        code = await asyncio.to_thread(self.process.wait, within)
        self.took = time.monotonic() - self.signalled
        return code, await asyncio.to_thread(self.process.stdout.read)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    async def __aexit__(self, *exc: object) -> None:
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait, 10)
        if process.stdout is not None:
            process.stdout.close()


def settings_for(rig: Rabbit | Jet, **settings: Any) -> dict[str, Any]:
    """The process's settings on this rig's queue or stream and store; `settings` adds or overrides."""
    common: dict[str, Any] = {
        "store": "redis",
        "prefix": rig.prefix,
        "namespace": "payments",
        "counter": rig.counter,
        "handler": "sleep",
        "hold": HOLD,
        "lease": 30,
        "prefetch": 3,
        "drained": True,
        "stop": "sigterm",
    }
    if isinstance(rig, Rabbit):
        common.update(broker="rabbitmq", queue=rig.queue)
    else:
        common.update(broker="nats", stream=rig.stream, durable=rig.durable)
    return {**common, **settings}


def handler_of(rig: Rig, runs: Counter[str], key: Callable[[Any], str]) -> Callable[[Any], Awaitable[None]]:
    """An in-test handler: counts its runs and the message's effect."""

    async def handle(message: Any) -> None:
        runs[key(message)] += 1
        await rig.effects.incr(rig.counter + key(message))

    return handle


def ledger_handler(store: PostgresBackend, table: str, runs: Counter[str], key: Callable[[Any], str]) -> Any:
    """An in-test handler whose effect is a ledger row, in `store.transaction()`."""

    async def handle(message: Any) -> None:
        runs[key(message)] += 1
        async with store.transaction() as conn:
            await conn.execute(f"INSERT INTO {table} (message_id) VALUES ($1)", key(message))

    return handle


def amqp_key(message: Any) -> str:
    return str(message.message_id)


def nats_key(msg: Any) -> str:
    return str(msg.headers["Nats-Msg-Id"])


def with_hook(recover: RecoverHook | None) -> dict[str, Any]:
    """`recover=` only when given: the code before these changes has no such parameter."""
    return {} if recover is None else {"recover": recover}


class Takeover:
    """A RabbitMQ consumer in this test, on a channel of its own, that takes what a stopped or dead
    consumer left: every delivery it got, and how many it settled."""

    def __init__(self, rig: Rabbit, handle: Any, store: Any, *, namespace: str = "payments", **options: Any) -> None:
        self.rig = rig
        self.store = store
        self.on_message = rabbitmq_handler(store, handle, namespace=namespace, **options)
        self.deliveries: list[tuple[str, bool]] = []
        self.settled = 0

    async def deliver(self, message: Any) -> None:
        self.deliveries.append((message.message_id, bool(message.redelivered)))
        try:
            await self.on_message(message)
        finally:
            self.settled += 1

    async def __aenter__(self) -> Takeover:
        self.channel = await self.rig.connection.channel()
        await self.channel.set_qos(prefetch_count=10)
        await (await self.channel.get_queue(self.rig.queue)).consume(self.deliver)
        return self

    async def idle(self, at_least: int) -> bool:
        """It got `at_least` deliveries, settled all it got, and the queue has none ready."""
        busy = self.settled < len(self.deliveries) or len(self.deliveries) < at_least
        return not busy and await self.rig.depth(self.rig.queue) == 0

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.store.aclose()


class Puller:
    """A NATS pull consumer in this test (on the rig's durable) that takes what a stopped or dead
    consumer left: the key and delivery count of every message it fetched."""

    def __init__(self, rig: Jet, handle: Any, store: Any, *, namespace: str = "payments", **options: Any) -> None:
        self.rig = rig
        self.store = store
        self.on_message = nats_handler(store, handle, namespace=namespace, **options)
        self.deliveries: list[tuple[str, int]] = []

    async def __aenter__(self) -> Puller:
        self.connection = await nats.connect(NATS)
        sub = await self.connection.jetstream().pull_subscribe_bind(durable=self.rig.durable, stream=self.rig.stream)
        self.task = asyncio.ensure_future(self.loop(sub))
        return self

    async def loop(self, sub: Any) -> None:
        while True:
            try:
                batch = await sub.fetch(10, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):  # nats-py lets the latter out too, under load
                continue
            self.deliveries += [(nats_key(msg), msg.metadata.num_delivered) for msg in batch]
            await asyncio.gather(*(self.on_message(msg) for msg in batch))

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.connection.close()
        await self.store.aclose()


QUIET = 0.5
"""Seconds to look again after everything settled: a late duplicate or dead letter would show."""


# --- 1. a graceful stop of a RabbitMQ consumer process mid-handler --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm_cancels_main", "sigint_asyncio_run"])
async def test_a_graceful_stop_lets_rabbitmq_handlers_past_their_effect_finish_and_applies_each_message_once(
    rabbit: Rabbit, tmp_path: Path, stop: signal.Signals
) -> None:
    """Three messages in flight (prefetch 3), each past its effect, when the process is told to stop;
    two more wait in the queue. The `async with` block drains: the three finish, store and ack
    before the connection closes, and the consumer that takes over applies only the two it never
    started. Before: the stop cancelled the handlers, their claims were released, and the
    requeued messages were applied a second time."""
    ids = [f"pay-{i}" for i in range(5)]
    in_flight, waiting = ids[:3], ids[3:]
    mode = "sigterm" if stop is signal.SIGTERM else "sigint"
    for message_id in ids:  # all there before it starts: its first three are the first three
        await rabbit.publish(message_id)
    async with ConsumerProcess(tmp_path, **settings_for(rabbit, stop=mode)) as process:
        await until(lambda: rabbit.applied(in_flight), 15, "three handlers past their effect")
        process.send(stop)
        code, said = await process.ended(HOLD + 20)
    assert code == 0 and b"stopped" in said, process.tail()
    runs: Counter[str] = Counter()
    store = RedisBackend.from_url(REDIS_URL, prefix=rabbit.prefix)
    async with Takeover(rabbit, handler_of(rabbit, runs, amqp_key), store) as second:
        await until(lambda: second.idle(len(waiting)), 20, "the queue drained")
        await asyncio.sleep(QUIET)
        await until(lambda: second.idle(len(waiting)), 20, "the queue drained")
    counts, dead = await rabbit.counts(ids), await rabbit.depth(rabbit.dlq)
    report(
        {
            "test": f"rabbitmq_graceful_stop_{mode}",
            "stop_s": round(process.took, 2),
            "effects": sum(counts),
            "taken_over": dict(runs),
            "redelivered": sum(again for _, again in second.deliveries),
            "dead_lettered": dead,
        },
        tag="CONSUMER",
    )
    assert counts == [1] * 5, dict(zip(ids, counts, strict=True))
    assert dead == 0
    assert sorted(runs) == waiting, "the consumer that took over applied only the two never started"
    assert HOLD / 3 < process.took < HOLD + 5, "the stop waited for the running handlers (not for stop_timeout)"


# --- 2. the same for a NATS pull consumer process --------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm_cancels_main", "sigint_asyncio_run"])
async def test_a_graceful_stop_lets_nats_handlers_past_their_effect_finish_and_applies_each_message_once(
    jet: Jet, tmp_path: Path, stop: signal.Signals
) -> None:
    """A pull consumer's fetch loop inside `async with nats_handler(...) as on_message:`, three
    messages of its batch past their effect when the process is told to stop, two more in the
    stream. The block drains: the three finish and are acked before `nc.close()`. Before: the stop
    cancelled them, their claims were released, and JetStream's redeliveries (after `ack_wait`)
    applied them again."""
    ids = [f"pay-{i}" for i in range(5)]
    in_flight, waiting = ids[:3], ids[3:]
    mode = "sigterm" if stop is signal.SIGTERM else "sigint"
    for message_id in ids:  # all there before it starts: its first three are the first three
        await jet.publish(message_id)
    async with ConsumerProcess(tmp_path, **settings_for(jet, stop=mode)) as process:
        await until(lambda: jet.applied(in_flight), 15, "three handlers past their effect")
        process.send(stop)
        code, said = await process.ended(HOLD + 20)
    assert code == 0 and b"stopped" in said, process.tail()
    runs: Counter[str] = Counter()
    store = RedisBackend.from_url(REDIS_URL, prefix=jet.prefix)

    async def drained() -> bool:
        return await jet.settled() and await jet.applied(ids)

    async with Puller(jet, handler_of(jet, runs, nats_key), store) as second:
        await until(drained, 20, "the stream drained")
        await asyncio.sleep(QUIET)
        await until(drained, 20, "the stream drained")
    counts, dead = await jet.counts(ids), await jet.dead_letters()
    report(
        {
            "test": f"nats_graceful_stop_{mode}",
            "stop_s": round(process.took, 2),
            "effects": sum(counts),
            "taken_over": dict(runs),
            "redelivered": sum(n > 1 for _, n in second.deliveries),
            "dead_lettered": dead,
        },
        tag="CONSUMER",
    )
    assert counts == [1] * 5, dict(zip(ids, counts, strict=True))
    assert dead == 0
    assert sorted(runs) == waiting, "the consumer that took over applied only the two never started"
    assert all(n == 1 for _, n in second.deliveries), "the three were acked before the connection closed"
    assert HOLD / 3 < process.took < HOLD + 5, "the stop waited for the running handlers (not for stop_timeout)"


# --- 3. a RabbitMQ channel lost under running handlers --------------------------------------------


async def test_a_rabbitmq_channel_lost_mid_handler_applies_each_message_once_and_acks_the_redeliveries(
    rabbit: Rabbit,
) -> None:
    """A channel error (a passive declare of a missing queue on the consumer's channel) closes it
    while four handlers are past their effect: aio-pika cancels their callbacks, the broker requeues
    the four, and the robust channel consumes again at once. The handlers go on in tasks of their
    own and store their results; each redelivery finds its claim held in this process, waits for
    the result and is acked without running. Before: the cancelled handlers released their claims
    and the redeliveries applied all four again."""
    ids = [f"pay-{i}" for i in range(4)]
    runs: Counter[str] = Counter()
    count = handler_of(rabbit, runs, amqp_key)

    async def handle(message: Any) -> None:
        await count(message)
        await asyncio.sleep(1.0)

    store = RedisBackend.from_url(REDIS_URL, prefix=rabbit.prefix)
    on_message = rabbitmq_handler(store, handle, namespace="payments")
    deliveries: list[tuple[str, bool]] = []
    settled = 0

    async def deliver(message: Any) -> None:
        nonlocal settled
        deliveries.append((message.message_id, bool(message.redelivered)))
        await on_message(message)
        settled += 1

    channel = await rabbit.connection.channel()  # robust: reopened and consuming again after an error
    await channel.set_qos(prefetch_count=4)
    await (await channel.get_queue(rabbit.queue)).consume(deliver)
    try:
        for message_id in ids:
            await rabbit.publish(message_id)
        await until(lambda: rabbit.applied(ids), 15, "four handlers past their effect")
        with pytest.raises(ChannelNotFoundEntity):
            await channel.declare_queue(f"idem-test-{rabbit.run}-missing", passive=True)

        async def drained() -> bool:  # the four redeliveries came and were settled
            redelivered = sum(again for _, again in deliveries)
            return redelivered >= 4 and settled == redelivered and await rabbit.depth(rabbit.queue) == 0

        await until(drained, 20, "the redeliveries settled")
        await asyncio.sleep(QUIET)
    finally:
        await channel.close()
        drain = getattr(on_message, "drain", None)  # the code before these changes had none
        if drain is not None:
            await drain(10)
        await store.aclose()
    counts, dead = await rabbit.counts(ids), await rabbit.depth(rabbit.dlq)
    report(
        {"test": "rabbitmq_channel_lost", "deliveries": len(deliveries), "effects": sum(counts), "dead_lettered": dead},
        tag="CONSUMER",
    )
    assert sorted(deliveries) == sorted([(i, False) for i in ids] + [(i, True) for i in ids])
    assert counts == [1] * 4, dict(zip(ids, counts, strict=True))
    assert runs == Counter(ids), "each handler ran once: the redeliveries were acked without running"
    assert dead == 0


async def test_the_redeliveries_of_a_message_still_running_in_this_process_are_not_dead_lettered(
    rabbit: Rabbit,
) -> None:
    """As above, a channel error under a running handler, but the handler runs longer than the
    redeliveries can wait (`wait` 0.5 s here; the same with the default 10 s and a handler over
    ~40 s): each redelivery finds the claim held by this very process (its work alive, shielded),
    waits `wait`, is handed back (`nack(requeue=True)`) and comes straight back, until the quorum
    queue's `x-delivery-limit` (3) dead-letters it while the first delivery still runs, and then
    applies and stores it. A message that was applied must not be dead-lettered: a redelivery whose
    claim this process holds should wait for its own work (it always ends: stored, released or
    kept), not count deliveries against the limit."""
    runs: Counter[str] = Counter()
    count = handler_of(rabbit, runs, amqp_key)

    finished: list[float] = []

    async def handle(message: Any) -> None:
        await count(message)
        await asyncio.sleep(4.0)
        finished.append(time.monotonic())

    store = RedisBackend.from_url(REDIS_URL, prefix=rabbit.prefix)
    on_message = rabbitmq_handler(store, handle, namespace="payments", wait=0.5)
    deliveries: list[bool] = []

    async def deliver(message: Any) -> None:
        deliveries.append(bool(message.redelivered))
        await on_message(message)

    channel = await rabbit.connection.channel()
    await channel.set_qos(prefetch_count=4)
    await (await channel.get_queue(rabbit.queue)).consume(deliver)
    try:
        await rabbit.publish("pay-slow")
        await until(lambda: rabbit.applied(["pay-slow"]), 15, "the handler past its effect")
        with pytest.raises(ChannelNotFoundEntity):
            await channel.declare_queue(f"idem-test-{rabbit.run}-missing", passive=True)

        async def settled() -> bool:  # the first delivery's handler returned, and nothing waits in the queue
            return bool(finished) and await rabbit.depth(rabbit.queue) == 0

        await until(settled, 15, "the handler done and the queue settled")
        await asyncio.sleep(QUIET)
    finally:
        await channel.close()
        drain = getattr(on_message, "drain", None)  # the code before these changes had none
        if drain is not None:
            await drain(10)
        await store.aclose()
    counts, dead = await rabbit.counts(["pay-slow"]), await rabbit.depth(rabbit.dlq)
    report(
        {
            "test": "rabbitmq_channel_lost_slow_handler",
            "deliveries": len(deliveries),
            "effects": counts[0],
            "dead_lettered": dead,
        },
        tag="CONSUMER",
    )
    assert counts == [1]
    assert runs == Counter(["pay-slow"])
    assert dead == 0, f"applied once, yet dead-lettered after {len(deliveries)} deliveries"


# --- 4. a NATS push subscription ended under a running handler -------------------------------------


@pytest.mark.parametrize("ending", ["unsubscribe", "close", "drain_past_its_timeout"])
async def test_a_nats_push_subscription_ended_mid_handler_applies_each_message_once(jet: Jet, ending: str) -> None:
    """A push subscriber (`js.subscribe(..., cb=nats_handler(...), manual_ack=True)`, a queue group,
    `ack_wait` 1 s, `max_deliver` 5) has two messages past their effect when its subscription ends:
    `unsubscribe()`, `nc.close()`, or `nc.drain()` past its `drain_timeout` (1 s). nats-py cancels the
    callback; the handlers go on, store their results and ack where the connection still lets them,
    and a new subscriber gets the redeliveries after `ack_wait` and acks them without running.
    Before: the cancelled handler released its claim and the redelivery applied it again (and the
    second message waited, unseen, behind the first)."""
    ids = ["pay-0", "pay-1"]
    durable, hold = "push", 2.0
    config = ConsumerConfig(
        durable_name=durable, deliver_group=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=1.0, max_deliver=5
    )
    runs: Counter[str] = Counter()
    count = handler_of(jet, runs, nats_key)

    async def slow(msg: Any) -> None:
        await count(msg)
        await asyncio.sleep(hold)

    first_store = RedisBackend.from_url(REDIS_URL, prefix=jet.prefix)
    first_cb = nats_handler(first_store, slow, namespace="payments")
    first = await nats.connect(NATS, drain_timeout=1)
    second_store = RedisBackend.from_url(REDIS_URL, prefix=jet.prefix)
    second_cb = nats_handler(second_store, count, namespace="payments")
    second: Any = None
    taken: list[tuple[str, int]] = []

    async def taking_over(msg: Any) -> None:
        taken.append((nats_key(msg), msg.metadata.num_delivered))
        await second_cb(msg)

    try:
        subscription = await first.jetstream().subscribe(
            jet.subject, queue=durable, durable=durable, config=config, manual_ack=True, cb=first_cb
        )
        for message_id in ids:
            await jet.publish(message_id)
        await until(lambda: jet.applied(ids[:1]), 15, "the first handler past its effect")
        started = time.monotonic()
        if ending == "unsubscribe":
            await subscription.unsubscribe()
        elif ending == "close":
            await first.close()
        else:
            await first.drain()  # waits drain_timeout for the callback, then cancels it and closes
        ended_after = time.monotonic() - started
        assert ending != "drain_past_its_timeout" or ended_after < hold, "the drain gave up before the handler ended"
        second = await jet.js.subscribe(
            jet.subject, queue=durable, durable=durable, config=config, manual_ack=True, cb=taking_over
        )

        async def drained() -> bool:
            return await jet.settled(durable) and await jet.applied(ids)

        await until(drained, 20, "the push consumer settled")
        await asyncio.sleep(QUIET)
        await until(drained, 20, "the push consumer settled")
    finally:
        if second is not None:
            await second.unsubscribe()
        for callback in (first_cb, second_cb):
            drain = getattr(callback, "drain", None)  # the code before these changes had none
            if drain is not None:
                await drain(10)
        if not first.is_closed:
            await first.close()
        await first_store.aclose()
        await second_store.aclose()
    counts, dead = await jet.counts(ids), await jet.dead_letters()
    report(
        {
            "test": f"nats_push_{ending}",
            "effects": sum(counts),
            "runs": dict(runs),
            "taken": taken,
            "dead_lettered": dead,
        },
        tag="CONSUMER",
    )
    assert counts == [1, 1], dict(zip(ids, counts, strict=True))
    assert runs == Counter(ids), "the first handler ran once, and nothing else ran it again"
    assert dead == 0
    # Both ran at once in the first subscriber (a push delivery never waits behind a slow one).
    if ending != "unsubscribe":  # the connection closed under the first: its acks could not go out
        assert {key for key, n in taken if n > 1} == set(ids), "their redeliveries were acked without running"


async def take_over(
    rig: Rabbit | Jet, handle: Any, store: Any, *, expect: int, within: float = 30, **options: Any
) -> list[tuple[str, int]]:
    """Consume, in this test, what a stopped or dead consumer left, until every delivery (at least
    `expect`) is settled; each delivery's key and attempt (RabbitMQ: 2 for any redelivery)."""
    if isinstance(rig, Rabbit):
        async with Takeover(rig, handle, store, **options) as taker:
            await until(lambda: taker.idle(expect), within, "the queue drained")
            await asyncio.sleep(QUIET)
            await until(lambda: taker.idle(expect), within, "the queue drained")
        return [(key, 1 + again) for key, again in taker.deliveries]
    async with Puller(rig, handle, store, **options) as puller:

        async def drained() -> bool:
            return len(puller.deliveries) >= expect and await rig.settled()

        try:
            await until(drained, within, "the stream drained")
            await asyncio.sleep(QUIET)
            await until(drained, within, "the stream drained")
        except AssertionError as exc:
            info = await rig.js.consumer_info(rig.stream, rig.durable)
            raise AssertionError(f"{exc}: fetched {puller.deliveries}, loop {puller.task!r}, consumer {info}") from None
    return puller.deliveries


async def dead_letters(rig: Rabbit | Jet) -> int:
    return await rig.depth(rig.dlq) if isinstance(rig, Rabbit) else await rig.dead_letters()


# --- 5. no drain block: the process exits with handlers past their effect -------------------------


@pytest.mark.slow
async def test_a_process_exiting_with_handlers_past_their_effect_keeps_their_claims_and_never_applies_twice(
    rabbit: Rabbit, tmp_path: Path
) -> None:
    """The plain callback with no `async with` block, under `asyncio.run`: SIGINT while two handlers
    are past their effect. Nothing drains, so `asyncio.run` cancels them on its way out: like a
    crash, their claims are kept to their lease (1 s), never released. The consumer that takes over
    never runs them again on a guess: once the lease is over (seen twice, its grace apart) their
    outcome is unknown and each is dead-lettered for a person (a `recover=` hook would resolve them:
    see the last test). Before: cancelled, the claims were released and both were applied again."""
    ids = ["pay-0", "pay-1"]
    for message_id in ids:
        await rabbit.publish(message_id)
    settings = settings_for(rabbit, drained=False, stop="sigint", lease=1, hold=FOREVER)
    async with ConsumerProcess(tmp_path, **settings) as process:
        await until(lambda: rabbit.applied(ids), 15, "two handlers past their effect")
        process.send(signal.SIGINT)
        code, said = await process.ended(20)
    assert code == 0 and b"stopped" in said, process.tail()
    runs: Counter[str] = Counter()
    store = RedisBackend.from_url(REDIS_URL, prefix=rabbit.prefix)
    started = time.monotonic()
    deliveries = await take_over(rabbit, handler_of(rabbit, runs, amqp_key), store, expect=2, lease=1)
    counts, dead = await rabbit.counts(ids), await rabbit.depth(rabbit.dlq)
    report(
        {
            "test": "rabbitmq_exit_without_drain",
            "effects": sum(counts),
            "runs": dict(runs),
            "dead_lettered": dead,
            "resolved_s": round(time.monotonic() - started, 1),
        },
        tag="CONSUMER",
    )
    assert counts == [1, 1], dict(zip(ids, counts, strict=True))
    assert runs == Counter(), "never run again: its claim was kept, not released"
    assert sorted(deliveries) == [(i, 2) for i in ids]
    assert dead == 2, "outcome unknown after the lease: dead-lettered for a person"


# --- 6. Postgres: killed inside transaction(), before or after its COMMIT -------------------------


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_consumer_killed_inside_an_uncommitted_transaction_is_run_again_once_and_none_dead_lettered(
    either: Rabbit | Jet, ledger: str, tmp_path: Path
) -> None:
    """Three handlers inserted their ledger row inside `store.transaction()` and sit there, before
    COMMIT, when the process is SIGKILLed: the rows roll back, the claims are left marked
    uncommitted. After the lease (1 s) each redelivery runs again by itself (no hook): one ledger
    row each, none dead-lettered. Before: the claims did not say they were inside a transaction,
    so their outcome was unknown and all three were dead-lettered, never applied."""
    rig = either
    key = amqp_key if isinstance(rig, Rabbit) else nats_key
    ids = [f"pay-{i}" for i in range(3)]
    for message_id in ids:
        await rig.publish(message_id)
    settings = settings_for(
        rig,
        store="postgres",
        table=TEST_TABLE,
        namespace=ledger,
        ledger=ledger,
        handler="in_transaction",
        hold=FOREVER,
        lease=1,
        stop="kill",
    )
    async with ConsumerProcess(tmp_path, **settings) as process:
        await until(lambda: rig.applied(ids), 15, "three handlers inside their transaction")
        process.send(signal.SIGKILL)
        code, _ = await process.ended(10)
    assert code == -signal.SIGKILL
    assert await ledger_counts(ledger, ids) == [0, 0, 0], "rolled back with the process"
    runs: Counter[str] = Counter()
    store = await postgres_store()
    started = time.monotonic()
    handle = ledger_handler(store, ledger, runs, key)
    deliveries = await take_over(rig, handle, store, expect=3, namespace=ledger, lease=1)
    rows, dead = await ledger_counts(ledger, ids), await dead_letters(rig)
    report(
        {
            "test": f"{'rabbitmq' if isinstance(rig, Rabbit) else 'nats'}_killed_before_commit",
            "ledger_rows": rows,
            "runs": dict(runs),
            "dead_lettered": dead,
            "resolved_s": round(time.monotonic() - started, 1),
        },
        tag="CONSUMER",
    )
    assert rows == [1, 1, 1], dict(zip(ids, rows, strict=True))
    assert runs == Counter(ids), "each run again once, on its redelivery"
    assert sorted(k for k, _ in deliveries) == ids
    assert dead == 0


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_consumer_killed_after_its_transaction_committed_has_the_redelivery_acked_without_running(
    either: Rabbit | Jet, ledger: str, tmp_path: Path
) -> None:
    """Three handlers' `store.transaction()` COMMITted (their ledger row with the claim's "effect
    committed" mark), and they are SIGKILLed before returning. After the lease each redelivery is
    acked as applied, without running and without a hook: one ledger row each, none dead-lettered.
    Before: the outcome was unknown and all three were dead-lettered although they were applied."""
    rig = either
    key = amqp_key if isinstance(rig, Rabbit) else nats_key
    ids = [f"pay-{i}" for i in range(3)]
    for message_id in ids:
        await rig.publish(message_id)
    settings = settings_for(
        rig,
        store="postgres",
        table=TEST_TABLE,
        namespace=ledger,
        ledger=ledger,
        handler="after_commit",
        hold=FOREVER,
        lease=1,
        stop="kill",
    )
    async with ConsumerProcess(tmp_path, **settings) as process:
        await until(lambda: rig.applied(ids), 15, "three transactions committed")
        process.send(signal.SIGKILL)
        code, _ = await process.ended(10)
    assert code == -signal.SIGKILL
    assert await ledger_counts(ledger, ids) == [1, 1, 1], "committed before the kill"
    runs: Counter[str] = Counter()
    store = await postgres_store()
    started = time.monotonic()
    handle = ledger_handler(store, ledger, runs, key)
    deliveries = await take_over(rig, handle, store, expect=3, namespace=ledger, lease=1)
    rows, dead = await ledger_counts(ledger, ids), await dead_letters(rig)
    report(
        {
            "test": f"{'rabbitmq' if isinstance(rig, Rabbit) else 'nats'}_killed_after_commit",
            "ledger_rows": rows,
            "runs": dict(runs),
            "dead_lettered": dead,
            "resolved_s": round(time.monotonic() - started, 1),
        },
        tag="CONSUMER",
    )
    assert rows == [1, 1, 1], dict(zip(ids, rows, strict=True))
    assert runs == Counter(), "acked as applied: its effect committed with its claim"
    assert sorted(k for k, _ in deliveries) == ids
    assert dead == 0


# --- 7. the recover= hook, for messages whose consumer was killed mid-handler ---------------------


@pytest.mark.slow
async def test_a_recover_hook_is_asked_about_each_message_of_a_killed_consumer_and_its_answer_is_obeyed(
    rabbit: Rabbit, tmp_path: Path
) -> None:
    """Four handlers past their effect (outside any transaction) when the process is SIGKILLed. The
    consumer that takes over has a `recover=` hook, asked once per message after the lease (1 s):
    `stored_result("applied")` for the first two (acked without running), "run" for the last two
    (run again: the hook said so, so here their effect counts 2). None dead-lettered."""
    ids = [f"pay-{i}" for i in range(4)]
    applied, rerun = ids[:2], ids[2:]
    for message_id in ids:
        await rabbit.publish(message_id)
    settings = settings_for(rabbit, prefetch=4, lease=1, hold=FOREVER, stop="kill")
    async with ConsumerProcess(tmp_path, **settings) as process:
        await until(lambda: rabbit.applied(ids), 15, "four handlers past their effect")
        process.send(signal.SIGKILL)
        code, _ = await process.ended(10)
    assert code == -signal.SIGKILL
    asked: list[str] = []

    async def recover(key: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
        asked.append(key.key)
        return stored_result("applied") if key.key in applied else "run"

    runs: Counter[str] = Counter()
    store = RedisBackend.from_url(REDIS_URL, prefix=rabbit.prefix)
    hook: RecoverHook = recover
    deliveries = await take_over(
        rabbit, handler_of(rabbit, runs, amqp_key), store, expect=4, lease=1, **with_hook(hook)
    )
    counts, dead = await rabbit.counts(ids), await rabbit.depth(rabbit.dlq)
    report(
        {
            "test": "rabbitmq_recover_hook",
            "asked": sorted(asked),
            "runs": dict(runs),
            "effects": counts,
            "dead_lettered": dead,
        },
        tag="CONSUMER",
    )
    assert sorted(asked) == ids, "asked once about each"
    assert runs == Counter(rerun), "only those the hook said never happened ran again"
    assert counts == [1, 1, 2, 2]
    assert sorted(deliveries) == [(i, 2) for i in ids]
    assert dead == 0
