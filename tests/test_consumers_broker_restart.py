"""`rabbitmq_handler` across a RabbitMQ node restart: a throwaway node on free ports
(tests/support/rabbitmq_node.py), SIGKILLed mid-stream and started again on its data; the store
is the shared Redis and effects are counted there by INCR, outside the adapter. (The NATS server
restart is in tests/test_consumers_nats_faults.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import redis.asyncio as aioredis
from pamqp.common import FieldTable

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs.consumers import rabbitmq_handler
from tests.support.leftovers import IGNORE_CLIENT_LEFTOVERS, collect_client_leftovers
from tests.support.rabbitmq_node import RabbitNode, rabbitmq_node
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, require

pytestmark = [
    pytest.mark.redis,
    # aio-pika drops the close() coroutine of a connection attempt the restarting node refused.
    pytest.mark.filterwarnings("ignore:Exception ignored in. <coroutine object Connection.close"),
    IGNORE_CLIENT_LEFTOVERS,
]
__all__ = ["collect_client_leftovers"]  # the autouse fixture
QUEUE = "payments"
# A classic durable queue: a quorum queue on this single throwaway node (RabbitMQ 3.10.8), SIGKILLed
# and started again, logged "leader not known" and took no publish for over 100 s.
ARGUMENTS: FieldTable = {"x-dead-letter-exchange": "payments-dlx"}


async def until(condition: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def _declare(node: RabbitNode) -> None:
    connection = await aio_pika.connect(node.url)
    async with connection:
        channel = await connection.channel()
        dead = await channel.declare_queue("payments-dead", durable=True)
        dlx = await channel.declare_exchange("payments-dlx", aio_pika.ExchangeType.FANOUT, durable=True)
        await dead.bind(dlx)
        await channel.declare_queue(QUEUE, durable=True, arguments=ARGUMENTS)


async def _publish_all(node: RabbitNode, ids: list[str]) -> None:
    """Publish each id (persistent, confirmed) on a plain connection, again on a new connection
    when the broker did not confirm it (the consumer dedupes a copy that had landed)."""
    connection: Any = None
    for message_id in ids:
        message = aio_pika.Message(b'{"amount": 100}', message_id=message_id, delivery_mode=2)
        while True:
            try:
                if connection is None:
                    connection = await aio_pika.connect(node.url, timeout=2)
                    channel = await connection.channel()
                await asyncio.wait_for(channel.default_exchange.publish(message, routing_key=QUEUE), 2)
                break
            except Exception:  # the node is away: a new connection, and publish it again
                if connection is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(connection.close(), 1)
                connection = None
                await asyncio.sleep(0.2)
        await asyncio.sleep(0.01)
    await connection.close()


async def _depths(node: RabbitNode) -> tuple[int, int]:
    connection = await aio_pika.connect(node.url)
    async with connection:
        channel = await connection.channel()
        ready = await channel.declare_queue(QUEUE, passive=True)
        dead = await channel.declare_queue("payments-dead", passive=True)
        return ready.declaration_result.message_count or 0, dead.declaration_result.message_count or 0


async def test_a_rabbitmq_node_restart_mid_stream_loses_no_message_and_applies_none_twice(tmp_path: Path) -> None:
    require("redis", REDIS_URL)
    ids = [f"pay-{i}" for i in range(60)]
    run = uuid.uuid4().hex[:10]
    counter = f"idem-test-effects:{run}:"
    effects = aioredis.Redis.from_url(REDIS_URL)
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")

    async def handle(message: Any) -> None:
        await effects.incr(counter + message.message_id)
        await asyncio.sleep(0.01)

    async def applied() -> list[int]:
        return [int(v or 0) for v in await effects.mget([counter + i for i in ids])]

    try:
        with rabbitmq_node(tmp_path / "rabbit") as node:
            await _declare(node)
            consuming = await aio_pika.connect_robust(node.url, reconnect_interval=0.5)
            channel = await consuming.channel()
            await channel.set_qos(prefetch_count=10)
            await (await channel.get_queue(QUEUE)).consume(rabbitmq_handler(store, handle, namespace=QUEUE))
            publishing = asyncio.ensure_future(_publish_all(node, ids))
            try:

                async def some_applied() -> bool:
                    return sum(await applied()) >= 15

                await until(some_applied, 30)
                node.kill()  # SIGKILL mid-stream: some applied, some unacked, some not yet published
                await asyncio.sleep(1.0)
                await asyncio.to_thread(node.start)
                await asyncio.wait_for(publishing, 60)

                async def drained() -> bool:
                    return await _depths(node) == (0, 0) and all(await applied())

                await until(drained, 60)
                await asyncio.sleep(1.0)  # a late redelivery would show now
                depths = await _depths(node)
            finally:
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
                await consuming.close()
        counts = await applied()
    finally:
        keys = [k async for k in effects.scan_iter(match=f"idem-test*{run}*")]
        if keys:
            await effects.delete(*keys)
        await effects.aclose()
        await store.aclose()
    report({"test": "rabbitmq_node_restart", "messages": len(ids), "effects": sum(counts)}, tag="CONSUMER")
    assert counts == [1] * len(ids), {i: c for i, c in zip(ids, counts, strict=True) if c != 1}
    assert depths == (0, 0), "nothing left in the queue, nothing dead-lettered"
