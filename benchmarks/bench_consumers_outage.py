"""The RabbitMQ half of `bench_consumers`, and what a store outage costs on each broker.

- RabbitMQ: N messages published to a fresh queue, consumed one after another (a queue iterator,
  prefetch 100) with a bare `ack()` and through `rabbitmq_handler` on Redis: new, then the same N
  again as duplicates (same message ids).
- Outage: 50 messages wait while the store is down (a throwaway redis-server not started yet); the
  consumer (prefetch / fetch batch 10) runs for `down` seconds, then the store starts. Counted: the
  deliveries the broker made, redeliveries, dead letters, the claim attempts the held messages made,
  and the seconds from the store's start until all 50 were applied.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import nats
from nats.errors import TimeoutError as FetchTimeout
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig
from pamqp.common import FieldTable

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs.consumers import nats_handler, rabbitmq_handler
from tests.support.servers import REDIS_URL, RedisProcess
from tests.support.stores import Counting

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
NATS = "nats://127.0.0.1:4222"


async def _nothing(message: Any) -> None:
    return None


async def _consume_rabbitmq(queue: Any, n: int, on_message: Any) -> float:
    done = 0
    started = time.perf_counter()
    async with queue.iterator() as messages:
        async for message in messages:
            await on_message(message)
            done += 1
            if done == n:
                break
    return time.perf_counter() - started


async def rabbitmq_row(kind: str, n: int) -> dict[str, Any]:
    """µs per message (new, duplicate) for a bare ack or the adapter on Redis."""
    connection = await aio_pika.connect(AMQP)
    run = uuid.uuid4().hex[:10]
    store: Counting | None = None
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        queue = await channel.declare_queue(f"idem-bench-{run}", durable=True, arguments={"x-queue-type": "quorum"})

        async def bare(message: Any) -> None:
            await message.ack()

        on_message: Any = bare
        if kind != "bare ack":
            store = Counting(RedisBackend.from_url(REDIS_URL, prefix=f"idem-bench:{run}:"))
            on_message = rabbitmq_handler(store, _nothing, namespace=f"bench-{run}")
        row: dict[str, Any] = {"broker": "rabbitmq", "store": kind, "messages": n}
        for phase in ("new", "duplicate"):
            for i in range(n):
                message = aio_pika.Message(b"{}", message_id=f"p-{i}")
                await channel.default_exchange.publish(message, routing_key=queue.name)
            before = sum(store.calls.values()) if store else 0
            seconds = await _consume_rabbitmq(queue, n, on_message)
            row[f"{phase}_us_per_msg"] = round(seconds / n * 1e6, 1)
            if store is not None:
                row[f"{phase}_store_calls_per_msg"] = round((sum(store.calls.values()) - before) / n, 2)
        await queue.delete(if_unused=False, if_empty=False)
        return row
    finally:
        if store is not None:
            await store.aclose()
        await connection.close()


async def _start_after(server: RedisProcess, down: float) -> float:
    """Start the store `down` seconds from now; when it answered (monotonic)."""
    await asyncio.sleep(down)
    await asyncio.to_thread(server.start)
    return time.monotonic()


async def _drained(check: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError("the messages were not all applied in time")
        await asyncio.sleep(0.05)


async def rabbitmq_outage(down: float, n: int = 50) -> dict[str, Any]:
    applied: set[str] = set()
    deliveries = redelivered = 0

    async def handle(message: Any) -> None:
        applied.add(message.message_id)

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisProcess(Path(tmp), args=("--appendonly", "yes", "--appendfsync", "always"))
        store = Counting(RedisBackend.from_url(server.url, prefix="idem-bench-outage:"))
        on_message = rabbitmq_handler(store, handle, namespace="bench-outage")

        async def counting(message: Any) -> None:
            nonlocal deliveries, redelivered
            deliveries += 1
            redelivered += bool(message.redelivered)
            await on_message(message)

        connection = await aio_pika.connect(AMQP)
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=10)
            args: FieldTable = {"x-queue-type": "quorum", "x-delivery-limit": 5}
            queue = await channel.declare_queue(
                f"idem-bench-outage-{uuid.uuid4().hex[:8]}", durable=True, arguments=args
            )
            for i in range(n):
                message = aio_pika.Message(b"{}", message_id=f"o-{i}")
                await channel.default_exchange.publish(message, routing_key=queue.name)
            await queue.consume(counting)
            started = await _start_after(server, down)

            async def done() -> bool:
                return len(applied) == n

            await _drained(done, 60)
            took = time.monotonic() - started
            await queue.delete(if_unused=False, if_empty=False)
        finally:
            await connection.close()
            await store.aclose()
            server.kill()
    row = {"broker": "rabbitmq", "down_s": down, "messages": n, "deliveries": deliveries, "redelivered": redelivered}
    row |= {"claim_attempts": store.calls["claim"], "applied": len(applied), "drain_s": round(took, 2)}
    return row


async def nats_outage(down: float, n: int = 50) -> dict[str, Any]:
    applied: set[str] = set()
    deliveries = redelivered = 0

    async def handle(msg: Any) -> None:
        applied.add(msg.headers["Nats-Msg-Id"])

    connection = await nats.connect(NATS)
    js = connection.jetstream()
    stream = f"IDEM_BENCH_OUTAGE_{uuid.uuid4().hex[:8]}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"]))
    config = ConsumerConfig(durable_name="w", ack_policy=AckPolicy.EXPLICIT, ack_wait=2, max_deliver=3)
    await js.add_consumer(stream, config)
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisProcess(Path(tmp), args=("--appendonly", "yes", "--appendfsync", "always"))
        store = Counting(RedisBackend.from_url(server.url, prefix="idem-bench-outage:"))
        on_message = nats_handler(store, handle, namespace="bench")
        try:
            for i in range(n):
                await js.publish(f"{stream.lower()}.x", b"{}", headers={"Nats-Msg-Id": f"o-{i}"})
            sub = await js.pull_subscribe_bind(durable="w", stream=stream)
            starting = asyncio.ensure_future(_start_after(server, down))
            while len(applied) < n:
                try:
                    batch = await sub.fetch(10, timeout=0.2)
                except FetchTimeout:
                    continue
                deliveries += len(batch)
                redelivered += sum(1 for m in batch if m.metadata.num_delivered > 1)
                await asyncio.gather(*(on_message(m) for m in batch))  # held while the store is down
            took = time.monotonic() - await starting
        finally:
            await js.delete_stream(stream)
            await connection.close()
            await store.aclose()
            server.kill()
    row = {"broker": "nats", "down_s": down, "messages": n, "deliveries": deliveries, "redelivered": redelivered}
    row |= {"claim_attempts": store.calls["claim"], "applied": len(applied), "drain_s": round(took, 2)}
    return row
