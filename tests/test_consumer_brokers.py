"""Consumers that fit how RabbitMQ and NATS are run: malformed messages never wedge a consumer, a push
consumer's queued messages are kept alive, dead letters survive every retention policy, broker timers
are followed, poison messages back off, and a publisher's rebuilt envelope is the same message.

Against the real brokers on this machine (RabbitMQ 127.0.0.1:5672, NATS JetStream 127.0.0.1:4222) with
the shared Redis as the store. Each test has its own queue or stream (and dead-letter queue or
advisory stream), deleted afterwards; effects are counted outside the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StreamConfig

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.jobs.consumers import _nats_facts, nats_handler, rabbitmq_handler
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, RedisProcess, need_redis_server, require

AMQP = os.environ.get("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")
pytestmark = [pytest.mark.redis]


async def until(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.05)


def payment_id(message: Any) -> str:
    """The key reader a user writes: it raises on a message without its header (a malformed one)."""
    headers = getattr(message, "headers", None) or {}
    return str(headers["Payment-Id"])


# -- RabbitMQ --------------------------------------------------------------------------------------


class Queue:
    """A quorum queue with a dead-letter queue, and a consumer channel with a small prefetch."""

    def __init__(self, connection: Any, run: str) -> None:
        self.connection, self.run = connection, run
        self.name, self.dead = f"idem-test-{run}", f"idem-test-{run}-dead"

    async def __aenter__(self) -> Queue:
        async with self.connection.channel() as channel:
            dead = await channel.declare_queue(self.dead, durable=True)
            dlx = await channel.declare_exchange(f"{self.name}-dlx", aio_pika.ExchangeType.FANOUT, durable=True)
            await dead.bind(dlx)
            arguments = {"x-queue-type": "quorum", "x-delivery-limit": 3, "x-dead-letter-exchange": dlx.name}
            await channel.declare_queue(self.name, durable=True, arguments=arguments)
        return self

    async def __aexit__(self, *exc: object) -> None:
        async with self.connection.channel() as channel:
            for name in (self.name, self.dead):
                await channel.queue_delete(name)
            await channel.exchange_delete(f"{self.name}-dlx")

    async def publish(self, body: bytes, headers: dict[str, Any] | None = None, message_id: str | None = None) -> None:
        async with self.connection.channel() as channel:
            message = aio_pika.Message(body, headers=headers or {}, message_id=message_id)
            await channel.default_exchange.publish(message, routing_key=self.name)

    async def depth(self, name: str) -> int:
        async with self.connection.channel() as channel:
            return int((await channel.declare_queue(name, passive=True)).declaration_result.message_count)


@pytest.fixture
async def rabbit() -> AsyncIterator[Any]:
    require("rabbitmq", AMQP)
    require("redis", REDIS_URL)
    connection = await aio_pika.connect_robust(AMQP)
    try:
        yield connection
    finally:
        await connection.close()


async def test_malformed_rabbitmq_messages_are_dead_lettered_at_once_and_never_wedge_the_good_ones(
    rabbit: Any,
) -> None:
    """Two messages without the header a `key=` reader needs, then 20 good ones, prefetch 2: before,
    the reader's exception left both bad deliveries unsettled in the prefetch window until the
    broker's consumer timeout, and 0 of 20 good messages were applied in 15 s."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    applied: Counter[str] = Counter()

    async def handle(message: Any) -> None:
        applied[payment_id(message)] += 1

    async with Queue(rabbit, run) as queue:
        on_message = rabbitmq_handler(store, handle, namespace="payments", key=payment_id)
        channel = await rabbit.channel()
        await channel.set_qos(prefetch_count=2)
        tag = await (await channel.get_queue(queue.name)).consume(on_message)
        started = time.monotonic()
        for _ in range(2):
            await queue.publish(b'{"amount": 1}')  # no Payment-Id
        for i in range(20):
            await queue.publish(b'{"amount": 1}', {"Payment-Id": f"p-{i}"})

        async def done() -> bool:
            return len(applied) == 20 and await queue.depth(queue.dead) == 2

        await until(done, 10, "20 good applied and 2 dead-lettered")
        took = time.monotonic() - started
        await (await channel.get_queue(queue.name)).cancel(tag)
        await on_message.drain(5)
        await channel.close()
    await store.aclose()
    report({"test": "rabbitmq_malformed", "good_applied": len(applied), "seconds": round(took, 2)}, tag="CONSUMER")
    assert applied == Counter({f"p-{i}": 1 for i in range(20)})


async def test_a_rebuilt_envelope_is_the_same_message_when_the_consumer_compares_its_fields(rabbit: Any) -> None:
    """A publisher that rebuilds a `sent_at` stamp on each retry: compared by the whole body (before:
    there was no other way), every retry of an applied message was dead-lettered as another message
    under a used key; with `fingerprint=["order_id", "amount"]` the retries are acked as applied."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    applied: Counter[str] = Counter()

    async def handle(message: Any) -> None:
        applied[json.loads(message.body)["order_id"]] += 1

    async with Queue(rabbit, run) as queue:
        on_message = rabbitmq_handler(
            store, handle, namespace="orders", field="order_id", fingerprint=["order_id", "amount"]
        )
        channel = await rabbit.channel()
        await (await channel.get_queue(queue.name)).consume(on_message)
        for attempt in range(3):  # the first send and two retries, each with a new stamp
            for i in range(5):
                body = {"order_id": f"o-{i}", "amount": 100 + i, "sent_at": f"2026-12-02T10:00:0{attempt}Z"}
                await queue.publish(json.dumps(body).encode())

        async def done() -> bool:
            return len(applied) == 5 and await queue.depth(queue.name) == 0

        await until(done, 10, "every retry settled")
        await asyncio.sleep(0.3)
        await on_message.drain(5)
        dead = await queue.depth(queue.dead)
        await channel.close()
    await store.aclose()
    assert applied == Counter({f"o-{i}": 1 for i in range(5)})
    assert dead == 0, "a retry with a rebuilt stamp was dead-lettered as another message"


async def test_a_poison_rabbitmq_message_on_a_queue_without_a_limit_backs_off(rabbit: Any) -> None:
    """A handler that always raises, on a classic queue with no delivery limit: before, the message
    was requeued at once and redelivered in a hot loop; now each attempt waits 0.5 s, doubling."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    attempts = 0

    async def handle(message: Any) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("always fails")

    async with rabbit.channel() as admin:
        queue = await admin.declare_queue(f"idem-test-{run}", auto_delete=False)
        on_message = rabbitmq_handler(store, handle, namespace="poison")
        channel = await rabbit.channel()
        tag = await (await channel.get_queue(queue.name)).consume(on_message)
        await admin.default_exchange.publish(aio_pika.Message(b"{}", message_id="poison-1"), routing_key=queue.name)
        await asyncio.sleep(4.0)
        await (await channel.get_queue(queue.name)).cancel(tag)
        await on_message.drain(5)
        await channel.close()
        await admin.queue_delete(queue.name)
    await store.aclose()
    report({"test": "rabbitmq_poison_backoff", "attempts_in_4s": attempts}, tag="CONSUMER")
    assert 2 <= attempts <= 6, attempts  # 0.5 + 1 + 2 s of holds: 3 or 4 attempts (classic queues count none)


# -- NATS ------------------------------------------------------------------------------------------


class Stream:
    """A stream with a dead-letter advisory stream (and optionally its retention), removed after."""

    def __init__(self, connection: Any, run: str, retention: RetentionPolicy = RetentionPolicy.LIMITS) -> None:
        self.connection, self.js, self.run = connection, connection.jetstream(), run
        self.name, self.advisories = f"IDEM_TEST_{run}", f"IDEM_TEST_{run}_ADV"
        self.subject = f"idem-test.{run}.payments"
        self.retention = retention
        self.extra: list[str] = []

    async def __aenter__(self) -> Stream:
        await self.js.add_stream(
            StreamConfig(name=self.name, subjects=[f"idem-test.{self.run}.payments"], retention=self.retention)
        )
        subjects = [
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.name}.*",
            f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{self.name}.*",
        ]
        await self.js.add_stream(StreamConfig(name=self.advisories, subjects=subjects))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for name in (self.name, self.advisories, *self.extra):
            await self.js.delete_stream(name)

    async def consumer(self, durable: str, **config: Any) -> None:
        await self.js.add_consumer(
            self.name, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, **config)
        )

    async def publish(self, body: bytes, headers: dict[str, str] | None = None) -> int:
        return int((await self.js.publish(self.subject, body, headers=headers)).seq)

    async def advisory_kinds(self) -> list[str]:
        info = await self.js.stream_info(self.advisories)
        first, count = int(info.state.first_seq), int(info.state.messages)
        return [
            json.loads((await self.js.get_msg(self.advisories, s)).data or b"{}")["type"]
            for s in range(first, first + count)
        ]

    async def settled(self, durable: str) -> bool:
        info = await self.js.consumer_info(self.name, durable)
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)


@pytest.fixture
async def nc() -> AsyncIterator[Any]:
    require("nats", NATS)
    require("redis", REDIS_URL)
    connection = await nats.connect(NATS)
    try:
        yield connection
    finally:
        await connection.close()


def tickers() -> int:
    """The adapter's `in_progress()` tickers alive in this loop."""
    return sum(1 for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") == "_in_progress")


async def test_malformed_nats_messages_are_terminated_at_once_and_no_ticker_outlives_them(nc: Any) -> None:
    """A push consumer with `max_ack_pending` 2 gets two messages without the header its `key=` reader
    needs, then 10 good ones: before, 0 of 10 were applied in 12 s and the two bad deliveries were kept
    alive for the life of the process by leaked `in_progress()` tickers."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    applied: Counter[str] = Counter()

    async def handle(msg: Any) -> None:
        applied[payment_id(msg)] += 1

    async with Stream(nc, run) as stream:
        await stream.consumer("bad", ack_wait=2, max_deliver=3, max_ack_pending=2, deliver_subject=f"deliver.{run}")
        on_message = nats_handler(store, handle, namespace="payments", key=payment_id)
        sub = await stream.js.subscribe(stream.subject, durable="bad", manual_ack=True, cb=on_message)
        for _ in range(2):
            await stream.publish(b"{}")
        for i in range(10):
            await stream.publish(b"{}", {"Payment-Id": f"p-{i}"})
        await until(lambda: stream.settled("bad"), 10, "every message settled")
        await on_message.drain(5)
        await sub.unsubscribe()
        kinds = await stream.advisory_kinds()
    await store.aclose()
    assert applied == Counter({f"p-{i}": 1 for i in range(10)})
    assert kinds.count("io.nats.jetstream.advisory.v1.terminated") == 2
    assert tickers() == 0, "an in_progress() ticker outlived its delivery"


async def test_a_push_consumer_keeps_every_queued_message_alive_and_delivers_each_once(nc: Any) -> None:
    """The docs' push form (`max_ack_pending` 1000, `ack_wait` 2 s, `max_deliver` 3), 6 messages, a 1.5 s
    handler: nats-py runs a push callback one message at a time, so before, the queued ones got no
    `in_progress()`: 14 deliveries and 2 MAX_DELIVERIES advisories for messages then applied."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    deliveries: list[tuple[str, int]] = []

    async def handle(msg: Any) -> None:
        deliveries.append((msg.headers["Nats-Msg-Id"], msg.metadata.num_delivered))
        await asyncio.sleep(1.5)

    async with Stream(nc, run) as stream:
        await stream.consumer(
            "charge", ack_wait=2, max_deliver=3, max_ack_pending=1000, deliver_subject=f"deliver.{run}"
        )
        on_message = nats_handler(store, handle, namespace="charge")
        sub = await stream.js.subscribe(stream.subject, durable="charge", manual_ack=True, cb=on_message)
        for i in range(6):
            await stream.publish(b"{}", {"Nats-Msg-Id": f"p-{i}"})
        await until(lambda: stream.settled("charge"), 15, "all six settled")
        await asyncio.sleep(2.5)  # a redelivery of a message whose ack_wait ran out would show now
        await on_message.drain(5)
        await sub.unsubscribe()
        kinds = await stream.advisory_kinds()
    await store.aclose()
    report({"test": "nats_push_queued", "deliveries": len(deliveries), "advisories": len(kinds)}, tag="CONSUMER")
    assert sorted(deliveries) == [(f"p-{i}", 1) for i in range(6)]
    assert kinds == []


async def test_a_push_consumer_holds_every_queued_message_through_a_store_outage(nc: Any, tmp_path: Any) -> None:
    """The store down 7 s while 6 pushed messages wait (`ack_wait` 2 s, `max_deliver` 3): before, the
    queued ones were redelivered past `max_deliver` (the store down 10 s: 5 of 6 max-delivered)
    although the guarantees table says a store outage is held, not counted."""
    need_redis_server()
    run = uuid.uuid4().hex[:10]
    server = RedisProcess(tmp_path / "redis")
    applied: Counter[str] = Counter()

    async def handle(msg: Any) -> None:
        applied[msg.headers["Nats-Msg-Id"]] += 1

    try:
        server.start()
        store = RedisBackend.from_url(f"redis://127.0.0.1:{server.port}/0", timeout=0.5)
        async with Stream(nc, run) as stream:
            await stream.consumer("charge", ack_wait=2, max_deliver=3, deliver_subject=f"deliver.{run}")
            on_message = nats_handler(store, handle, namespace="charge")
            server.kill()
            sub = await stream.js.subscribe(stream.subject, durable="charge", manual_ack=True, cb=on_message)
            for i in range(6):
                await stream.publish(b"{}", {"Nats-Msg-Id": f"p-{i}"})
            await asyncio.sleep(7.0)  # 3.5 ack waits with the store down: past max_deliver, were they redelivered
            server.start()
            await until(lambda: stream.settled("charge"), 20, "all six settled once the store is back")
            await on_message.drain(5)
            await sub.unsubscribe()
            kinds = await stream.advisory_kinds()
        await store.aclose()
    finally:
        server.kill()
    assert applied == Counter({f"p-{i}": 1 for i in range(6)})
    assert kinds == [], "a store outage was counted toward max_deliver"


@pytest.mark.parametrize("retention", [RetentionPolicy.WORK_QUEUE, RetentionPolicy.INTEREST])
async def test_dead_letters_are_kept_on_work_queue_and_interest_streams(nc: Any, retention: RetentionPolicy) -> None:
    """A message that can never be applied, on a stream that deletes what is terminated: before, the
    dead letter was gone (`get_msg` found nothing), so "republish it from its advisory" found nothing.
    Without `dead_letter=` it is now refused and kept; with it, copied there with its reason first."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")

    async def handle(msg: Any) -> None:
        return None

    async with Stream(nc, run, retention) as stream:
        dead = f"IDEM_TEST_{run}_DEAD"
        await stream.js.add_stream(StreamConfig(name=dead, subjects=[f"idem-test.{run}.dead"]))
        stream.extra.append(dead)
        await stream.consumer("charge", ack_wait=2, max_deliver=3)
        seq = await stream.publish(b'{"amount": 5}')  # no Nats-Msg-Id: can never be applied
        sub = await stream.js.pull_subscribe_bind(durable="charge", stream=stream.name)
        refusing = nats_handler(store, handle, namespace="charge")
        with pytest.raises(ConfigurationError, match="dead_letter="):
            await asyncio.gather(*(refusing(m) for m in await sub.fetch(1, timeout=5)))
        kept = await stream.js.get_msg(stream.name, seq)  # refused, left unsettled: still in the stream
        copying = nats_handler(store, handle, namespace="charge", dead_letter=f"idem-test.{run}.dead")
        await asyncio.sleep(2.5)  # its ack wait, then it is offered again
        await asyncio.gather(*(copying(m) for m in await sub.fetch(1, timeout=5)))
        copy = await stream.js.get_last_msg(dead, f"idem-test.{run}.dead")
        await until(lambda: stream.settled("charge"), 5, "terminated")
    await store.aclose()
    assert kept.data == b'{"amount": 5}'
    assert copy.data == b'{"amount": 5}' and copy.headers is not None
    assert copy.headers["Idem-Dead-Reason"] == "it has no key"
    assert copy.headers["Idem-Stream"] == stream.name and copy.headers["Idem-Stream-Seq"] == str(seq)


async def test_an_ack_wait_lowered_in_place_is_followed(nc: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer's `ack_wait` lowered from 10 s to 1.5 s while the adapter runs: before, the facts
    read on the first message were kept for good, so a 4 s handler got `in_progress()` every 5 s and
    was redelivered (and counted toward `max_deliver`)."""
    monkeypatch.setattr(_nats_facts, "REFRESH", 0.3)
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    deliveries: list[tuple[str, int]] = []

    async def handle(msg: Any) -> None:
        deliveries.append((msg.headers["Nats-Msg-Id"], msg.metadata.num_delivered))
        if msg.headers["Nats-Msg-Id"] == "slow":
            await asyncio.sleep(4.0)

    async with Stream(nc, run) as stream:
        await stream.consumer("charge", ack_wait=10, max_deliver=5)
        sub = await stream.js.pull_subscribe_bind(durable="charge", stream=stream.name)
        on_message = nats_handler(store, handle, namespace="charge")
        await stream.publish(b"{}", {"Nats-Msg-Id": "first"})
        await asyncio.gather(*(on_message(m) for m in await sub.fetch(1, timeout=5)))
        lowered = ConsumerConfig(durable_name="charge", ack_policy=AckPolicy.EXPLICIT, ack_wait=1.5, max_deliver=5)
        await stream.js.add_consumer(stream.name, lowered)  # the same durable: its config updated in place
        await asyncio.sleep(0.5)
        await stream.publish(b"{}", {"Nats-Msg-Id": "refresh"})  # its facts are read again meanwhile
        await asyncio.gather(*(on_message(m) for m in await sub.fetch(1, timeout=5)))
        await asyncio.sleep(0.5)
        await stream.publish(b"{}", {"Nats-Msg-Id": "slow"})
        batch = await sub.fetch(1, timeout=5)
        running = asyncio.gather(*(on_message(m) for m in batch))
        redelivered: list[Any] = []
        with contextlib.suppress(nats.errors.TimeoutError, TimeoutError):
            redelivered = await sub.fetch(1, timeout=3.5)  # offered again if in_progress() came too late
        await running
        await on_message.drain(5)
    await store.aclose()
    assert [d for d in deliveries if d[0] == "slow"] == [("slow", 1)]
    assert redelivered == [], "JetStream redelivered a message still running"


async def test_a_poison_nats_message_without_max_deliver_backs_off(nc: Any) -> None:
    """A handler that always raises on a consumer with no `max_deliver` (the server's default): before,
    `nak()` with no delay redelivered it in a hot loop (~7,400 attempts in 5 s, ~15,000 store calls)."""
    run = uuid.uuid4().hex[:10]
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")
    attempts = 0

    async def handle(msg: Any) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("always fails")

    async with Stream(nc, run) as stream:
        await stream.consumer("charge", ack_wait=30, deliver_subject=f"deliver.{run}")
        on_message = nats_handler(store, handle, namespace="charge")
        sub = await stream.js.subscribe(stream.subject, durable="charge", manual_ack=True, cb=on_message)
        await stream.publish(b"{}", {"Nats-Msg-Id": "poison"})
        await asyncio.sleep(4.0)
        await sub.unsubscribe()
        await on_message.drain(5)
    await store.aclose()
    report({"test": "nats_poison_backoff", "attempts_in_4s": attempts}, tag="CONSUMER")
    assert 2 <= attempts <= 6, attempts  # naks delayed 0.5, 1, 2 s
