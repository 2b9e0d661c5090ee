"""RabbitMQ consumers apply each message once (`idem_asgi.jobs.consumers.rabbitmq_handler`), against the
real broker on this machine (127.0.0.1:5672) and the shared Redis as the store; effects are counted
by INCR in Redis, outside the adapter. Each test has its own quorum queue (`x-delivery-limit` 3) and
dead-letter queue, deleted afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis

from idem_asgi.backends.memory import MemoryBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import BackendUnavailable
from idem_asgi.jobs.consumers import Settle, apply_once, body_digest, rabbitmq_handler
from idem_asgi.records import RecordKey
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, ROOT, RedisProcess, need_redis_server, require
from tests.support.store_outage import FSYNC_ALWAYS, fsynced_redis, late_writes_landed, restart_when
from tests.support.stores import Delegating

AMQP = os.environ.get("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
pytestmark = [pytest.mark.redis]
DELIVERY_LIMIT = 3


class Rig:
    def __init__(self, run: str, connection: Any, channel: Any) -> None:
        self.run = run
        self.queue = f"idem-test-{run}"
        self.dlq = f"idem-test-{run}-dead"
        self.prefix = f"idem-test:{run}:"
        self.counter = f"idem-test-effects:{run}:"
        self.connection = connection
        self.channel = channel
        self.effects = aioredis.Redis.from_url(REDIS_URL)

    async def publish(self, message_id: str, body: bytes = b'{"amount": 100}') -> None:
        message = aio_pika.Message(body, message_id=message_id, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        await self.channel.default_exchange.publish(message, routing_key=self.queue)

    async def counts(self, ids: list[str]) -> list[int]:
        return [int(v or 0) for v in await self.effects.mget([self.counter + i for i in ids])]

    async def depth(self, name: str) -> int:
        async with self.connection.channel() as channel:  # a channel of its own for each look
            queue = await channel.declare_queue(name, passive=True)
            return int(queue.declaration_result.message_count)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    require("rabbitmq", AMQP)
    require("redis", REDIS_URL)
    run = uuid.uuid4().hex[:10]
    connection = await aio_pika.connect_robust(AMQP)
    channel = await connection.channel()
    r = Rig(run, connection, channel)
    dead = await channel.declare_queue(r.dlq, durable=True)
    dlx = await channel.declare_exchange(f"{r.queue}-dlx", aio_pika.ExchangeType.FANOUT, durable=True)
    await dead.bind(dlx)
    arguments = {"x-queue-type": "quorum", "x-delivery-limit": DELIVERY_LIMIT, "x-dead-letter-exchange": dlx.name}
    await channel.declare_queue(r.queue, durable=True, arguments=arguments)
    try:
        yield r
    finally:
        async with connection.channel() as cleanup:
            for name in (r.queue, r.dlq):
                await cleanup.queue_delete(name)
            await cleanup.exchange_delete(f"{r.queue}-dlx")
        keys = [k async for k in r.effects.scan_iter(match=f"idem-test*{run}*")]
        if keys:
            await r.effects.delete(*keys)
        await r.effects.aclose()
        await connection.close()


async def until(condition: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def consumer(rig: Rig, handle: Any) -> tuple[Any, RedisBackend]:
    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)
    channel = await rig.connection.channel()
    await channel.set_qos(prefetch_count=10)
    queue = await channel.get_queue(rig.queue)
    await queue.consume(rabbitmq_handler(store, handle, namespace="payments"))
    return channel, store


async def test_each_message_published_twice_is_applied_once_by_two_competing_consumers(rig: Rig) -> None:
    ran: list[str] = []

    async def handle(message: Any) -> None:
        ran.append(message.message_id)
        await rig.effects.incr(rig.counter + message.message_id)
        await asyncio.sleep(0.005)

    ids = [f"pay-{i}" for i in range(200)]
    first = await consumer(rig, handle)
    second = await consumer(rig, handle)
    for message_id in ids:
        await rig.publish(message_id)
    for message_id in reversed(ids):  # the duplicates, while the first copies are being applied
        await rig.publish(message_id)

    async def drained() -> bool:
        return await rig.depth(rig.queue) == 0 and sum(await rig.counts(ids)) >= 200

    await until(drained, 60)
    await asyncio.sleep(0.5)  # any late duplicate would show now
    counts = await rig.counts(ids)
    for channel, store in (first, second):
        await channel.close()
        await store.aclose()
    report({"test": "rabbitmq_competing_consumers", "published": 400, "effects": sum(counts)}, tag="CONSUMER")
    assert counts == [1] * 200, {i: c for i, c in zip(ids, counts, strict=True) if c != 1}
    assert await rig.depth(rig.dlq) == 0


async def test_a_consumer_killed_after_the_effect_before_the_ack_never_applies_twice(rig: Rig) -> None:
    env = {**os.environ, "IDEM_DIE_AFTER_STORE": "1", "PYTHONPATH": str(ROOT)}
    dying = subprocess.Popen(  # noqa: ASYNC220 - started once; its output is read in a thread below
        [sys.executable, "-m", "tests.consumer_process", "rabbitmq", rig.queue, rig.prefix, rig.counter],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert dying.stdout is not None
        assert (await asyncio.to_thread(dying.stdout.readline)).strip() == b"ready"
        await rig.publish("pay-killed")
        code = await asyncio.to_thread(dying.wait, 30)
        assert code == -9, "the first consumer died by SIGKILL, after its effect, before its ack"
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait(10)
        if dying.stdout is not None:
            dying.stdout.close()
    assert await rig.counts(["pay-killed"]) == [1]
    ran: list[str] = []

    async def handle(message: Any) -> None:
        ran.append(message.message_id)
        await rig.effects.incr(rig.counter + message.message_id)

    channel, store = await consumer(rig, handle)  # the second consumer: the broker redelivers to it

    async def acked() -> bool:
        return await rig.depth(rig.queue) == 0

    await until(acked, 30)
    await channel.close()
    await store.aclose()
    report({"test": "rabbitmq_sigkill_before_ack", "effects": (await rig.counts(["pay-killed"]))[0]}, tag="CONSUMER")
    assert ran == [], "the redelivery was acked without running the handler"
    assert await rig.counts(["pay-killed"]) == [1]


async def test_a_poison_message_is_dead_lettered_after_a_bounded_number_of_attempts(rig: Rig) -> None:
    attempts = 0

    async def handle(message: Any) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("always fails")

    channel, store = await consumer(rig, handle)
    await rig.publish("pay-poison")

    async def dead() -> bool:
        return await rig.depth(rig.dlq) == 1

    await until(dead, 30)
    await asyncio.sleep(0.3)
    await channel.close()
    await store.aclose()
    report({"test": "rabbitmq_poison", "attempts": attempts, "dead_lettered": 1}, tag="CONSUMER")
    assert attempts == DELIVERY_LIMIT + 1, attempts  # the first delivery, then the limit's redeliveries
    assert await rig.depth(rig.queue) == 0


async def test_a_duplicate_of_a_slow_message_waits_for_it_instead_of_being_dead_lettered(rig: Rig) -> None:
    # Requeued at once, the duplicate would come round x-delivery-limit times while the first copy
    # still runs and be dead-lettered: a dead letter for a message that was applied.
    deliveries = settled = 0

    async def handle(message: Any) -> None:
        await rig.effects.incr(rig.counter + message.message_id)
        await asyncio.sleep(1.0)

    async def counting(message: Any) -> None:
        nonlocal deliveries, settled
        deliveries += 1
        await on_message(message)
        settled += 1

    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)
    on_message = rabbitmq_handler(store, handle, namespace="payments")
    channels = []
    for _ in range(2):
        channel = await rig.connection.channel()
        await channel.set_qos(prefetch_count=1)
        await (await channel.get_queue(rig.queue)).consume(counting)
        channels.append(channel)
    await rig.publish("pay-slow")
    await rig.publish("pay-slow")

    async def drained() -> bool:  # both copies settled: closing a channel earlier cancels the first copy
        return settled == 2 and await rig.depth(rig.queue) == 0 and await rig.counts(["pay-slow"]) == [1]

    await asyncio.sleep(0.3)
    await until(drained, 15)
    await asyncio.sleep(0.3)
    for channel in channels:
        await channel.close()
    await store.aclose()
    assert deliveries == 2, "each copy delivered once"
    assert await rig.counts(["pay-slow"]) == [1]
    assert await rig.depth(rig.dlq) == 0


async def test_a_result_that_cannot_be_stored_is_dead_lettered_after_one_effect(rig: Rig) -> None:
    # Handed back, every redelivery would run the effect again (x-delivery-limit 3: 4 effects).
    async def handle(message: Any) -> object:
        await rig.effects.incr(rig.counter + message.message_id)
        return object()  # msgspec cannot encode it: the effect happened, the result cannot be stored

    channel, store = await consumer(rig, handle)
    await rig.publish("pay-opaque")
    await rig.publish("pay-opaque")  # a duplicate, as a lost ack would bring

    async def both_dead() -> bool:
        return await rig.depth(rig.dlq) == 2

    await until(both_dead, 30)
    await asyncio.sleep(0.3)  # a redelivery would show now
    await channel.close()
    await store.aclose()
    assert await rig.counts(["pay-opaque"]) == [1]
    assert await rig.depth(rig.queue) == 0


async def test_a_redis_restart_mid_stream_applies_every_message_once_and_dead_letters_none(
    rig: Rig, tmp_path: Path
) -> None:
    # Requeued at once (the first version), a message whose claim met the stopped store came
    # round as fast as the broker redelivers and was dead-lettered by x-delivery-limit, never run.
    ids = [f"pay-{i}" for i in range(40)]
    redelivered = 0

    async def handle(message: Any) -> None:
        await rig.effects.incr(rig.counter + message.message_id)
        await asyncio.sleep(0.02)

    def counting(on_message: Any) -> Any:
        async def deliver(message: Any) -> None:
            nonlocal redelivered
            redelivered += bool(message.redelivered)  # every delivery, also those that never reach the handler
            await on_message(message)

        return deliver

    with fsynced_redis(tmp_path / "store") as server:
        stores, channels = [], []
        for _ in range(2):  # two competing consumers, prefetch 10 each
            store = RedisBackend.from_url(server.url, prefix=rig.prefix)
            channel = await rig.connection.channel()
            await channel.set_qos(prefetch_count=10)
            on_message = counting(rabbitmq_handler(store, handle, namespace="payments"))
            await (await channel.get_queue(rig.queue)).consume(on_message)
            stores.append(store)
            channels.append(channel)
        for message_id in ids:
            await rig.publish(message_id)

        async def some_applied() -> bool:
            return sum(await rig.counts(ids)) >= 8

        started = time.monotonic()
        await restart_when(server, some_applied, down=3.0)

        async def drained() -> bool:  # every message applied or dead-lettered
            settled = sum(await rig.counts(ids)) + await rig.depth(rig.dlq)
            return await rig.depth(rig.queue) == 0 and settled >= len(ids)

        await until(drained, 60)
        took = time.monotonic() - started
        await asyncio.sleep(0.5)  # a late duplicate would show now
        await late_writes_landed(stores)
        for channel in channels:
            await channel.close()
        for store in stores:
            await store.aclose()
    counts = await rig.counts(ids)
    dead = await rig.depth(rig.dlq)
    report(
        {
            "test": "rabbitmq_redis_restart",
            "messages": len(ids),
            "down_s": 3.0,
            "effects": sum(counts),
            "dead_lettered": dead,
            "redelivered": redelivered,
            "seconds": round(took, 1),
        },
        tag="CONSUMER",
    )
    assert counts == [1] * len(ids), {i: c for i, c in zip(ids, counts, strict=True) if c != 1}
    assert dead == 0
    assert redelivered == 0, "held in the consumer, not handed back: no delivery counted"


async def test_an_outbox_relay_republishing_a_body_without_message_id_applies_it_once(rig: Rig) -> None:
    # aio-pika gives each publish without a message_id a random one: keyed by message_id, the
    # relay's second publish of a row would be a second message and a second charge.
    seen_ids: list[str] = []

    async def handle(message: Any) -> None:
        seen_ids.append(message.message_id)
        await rig.effects.incr(rig.counter + "order-7")

    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)
    channel = await rig.connection.channel()
    await channel.set_qos(prefetch_count=10)
    on_message = rabbitmq_handler(store, handle, namespace="payments", key=body_digest)
    await (await channel.get_queue(rig.queue)).consume(on_message)
    body = b'{"order": "order-7", "amount": 100}'
    for _ in range(2):  # the relay published, crashed before marking the row sent, published again
        await channel.default_exchange.publish(aio_pika.Message(body), routing_key=rig.queue)

    async def drained() -> bool:
        return await rig.depth(rig.queue) == 0 and len(seen_ids) >= 1

    await until(drained, 15)
    await asyncio.sleep(0.3)
    await channel.close()
    await store.aclose()
    assert len(seen_ids) == 1 and seen_ids[0], "aio-pika invented a message_id; the body digest keyed it"
    assert await rig.counts(["order-7"]) == [1]
    assert await rig.depth(rig.dlq) == 0


async def test_keyed_by_a_business_field_a_republished_order_applies_once(rig: Rig) -> None:
    ran: list[bytes] = []

    async def handle(message: Any) -> None:
        ran.append(message.body)

    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)
    channel = await rig.connection.channel()
    on_message = rabbitmq_handler(store, handle, namespace="payments", key=lambda m: json.loads(m.body)["order"])
    await (await channel.get_queue(rig.queue)).consume(on_message)
    body = b'{"order": "order-8", "amount": 100}'
    for _ in range(2):
        await channel.default_exchange.publish(aio_pika.Message(body), routing_key=rig.queue)

    async def drained() -> bool:
        return await rig.depth(rig.queue) == 0 and len(ran) >= 1

    await until(drained, 15)
    await asyncio.sleep(0.3)
    await channel.close()
    await store.aclose()
    assert ran == [body]
    with pytest.raises(ValueError, match="one source"):
        rabbitmq_handler(store, handle, namespace="payments", header="Payment-Id", key=body_digest)


async def test_while_the_store_is_down_the_consumer_takes_no_more_than_its_prefetch(rig: Rig, tmp_path: Path) -> None:
    # Requeued at once (the first version), the same few messages cycled through the consumer as
    # fast as the broker redelivers, each cycle counted toward x-delivery-limit.
    deliveries: list[tuple[str, bool]] = []

    async def handle(message: Any) -> None:
        await rig.effects.incr(rig.counter + message.message_id)

    server = RedisProcess(tmp_path / "store", args=FSYNC_ALWAYS)  # not started yet: the store is down
    need_redis_server()
    store = RedisBackend.from_url(server.url, prefix=rig.prefix)
    on_message = rabbitmq_handler(store, handle, namespace="payments")

    async def deliver(message: Any) -> None:
        deliveries.append((message.message_id, bool(message.redelivered)))
        await on_message(message)

    channel = await rig.connection.channel()
    await channel.set_qos(prefetch_count=2)
    await (await channel.get_queue(rig.queue)).consume(deliver)
    ids = [f"pay-{i}" for i in range(10)]
    try:
        for message_id in ids:
            await rig.publish(message_id)
        await asyncio.sleep(1.5)
        held = list(deliveries)
        waiting = await rig.depth(rig.queue)  # ready messages, not the unacked ones
        await asyncio.to_thread(server.start)

        async def drained() -> bool:
            return await rig.depth(rig.queue) == 0 and sum(await rig.counts(ids)) + await rig.depth(rig.dlq) >= 10

        await until(drained, 30)
    finally:
        await channel.close()
        await store.aclose()
        server.kill()
    assert held == [("pay-0", False), ("pay-1", False)], "two held (the prefetch), none cycled"
    assert waiting == 8, "the rest waited in the queue"
    assert await rig.counts(ids) == [1] * 10
    assert await rig.depth(rig.dlq) == 0
    assert not any(redelivered for _, redelivered in deliveries)


class _Down(Delegating):
    """A store whose claims fail as an unreachable one's do, while `down` is set."""

    down = True

    def before(self, op: str, key: RecordKey) -> RecordKey:
        if self.down and op == "claim":
            raise BackendUnavailable("redis unavailable: connection refused")
        return key


async def test_only_a_claim_the_store_could_not_make_is_a_store_outage() -> None:
    # The first version read every error before an effect as the handler's failure: handed back
    # at once, counted, and dead-lettered by the delivery limit although nothing ran.
    store = _Down(MemoryBackend())
    ran: list[int] = []

    async def handler() -> None:
        ran.append(1)
        raise BackendUnavailable("the handler's own database is down")

    common: dict[str, Any] = {"namespace": "outage", "ttl": 60.0, "lease": 5.0, "wait": 0.0}
    assert await apply_once(store, "m-1", b"{}", handler, **common) is Settle.STORE_DOWN
    assert ran == [], "nothing ran"
    store.down = False
    assert await apply_once(store, "m-1", b"{}", handler, **common) is Settle.RETRY, "the handler's failure"
    assert ran == [1]


async def test_a_delivery_held_past_store_hold_is_requeued(rig: Rig, tmp_path: Path) -> None:
    """The hold is bounded (below RabbitMQ's consumer_timeout): after `store_hold` seconds of a
    store that stays down, the delivery goes back to the queue, one delivery counted."""
    seen: list[tuple[float, bool]] = []

    async def handle(message: Any) -> None:
        raise AssertionError("never runs: the store is down")

    server = RedisProcess(tmp_path / "store")  # never started
    store = RedisBackend.from_url(server.url, prefix=rig.prefix)
    on_message = rabbitmq_handler(store, handle, namespace="payments", store_hold=0.5)

    finished: list[bool] = []

    async def deliver(message: Any) -> None:
        seen.append((time.monotonic(), bool(message.redelivered)))
        try:
            await on_message(message)
        finally:
            finished.append(True)

    channel = await rig.connection.channel()
    await channel.set_qos(prefetch_count=1)
    await (await channel.get_queue(rig.queue)).consume(deliver)
    await rig.publish("pay-held")

    async def redelivered() -> bool:
        return len(seen) >= 2

    await until(redelivered, 10)
    await channel.close()

    async def let_go() -> bool:  # every delivery's handler is done before the store closes
        return len(finished) == len(seen)

    await until(let_go, 5)
    await store.aclose()
    (first, _), (second, again) = seen[:2]
    assert again, "handed back to the queue, then delivered again"
    assert 0.4 <= second - first < 3.0, second - first
