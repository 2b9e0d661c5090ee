"""A consumer process for tests/test_consumers.py and tests/test_consumers_nats.py: applies messages
once (effects counted by INCR in the shared Redis), and with IDEM_DIE_AFTER_STORE=1 SIGKILLs itself
right after the first message's completion is stored, before its ack: the broker must redeliver it.
With IDEM_DIE_IN_HANDLER=1 (NATS) it dies inside the handler instead, after the effect and before
its record; IDEM_LEASE sets the claim's lease (seconds). IDEM_DIE_AT (NATS) names one crash point
for the first message: `receipt` (fetched, before its claim), `before_effect` (in the handler),
`after_effect` (in the handler, after the effect) or `after_store` (its record stored, not acked).

    python -m tests.consumer_process rabbitmq <queue> <store prefix> <effect counter prefix>
    python -m tests.consumer_process nats <stream> <durable consumer> <store prefix> <effect counter prefix>
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import redis.asyncio as aioredis

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs.consumers import nats_handler, rabbitmq_handler
from idem_asgi.records import RecordKey, StoredResponse
from tests.support.stores import Delegating

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
NATS = "nats://127.0.0.1:4222"
REDIS = "redis://127.0.0.1:6379/0"


class DieAfterStore(Delegating):
    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        stored = await self.inner.complete(key, token, response, ttl=ttl)
        os.kill(os.getpid(), signal.SIGKILL)  # after the effect and its record, before the ack
        return stored


def store_for(prefix: str) -> Any:
    store: Any = RedisBackend.from_url(REDIS, prefix=prefix)
    dying = os.environ.get("IDEM_DIE_AFTER_STORE") == "1" or os.environ.get("IDEM_DIE_AT") == "after_store"
    return DieAfterStore(store) if dying else store


def die_at(point: str) -> None:
    """SIGKILL this process when IDEM_DIE_AT names `point`."""
    if os.environ.get("IDEM_DIE_AT") == point:
        os.kill(os.getpid(), signal.SIGKILL)


async def rabbitmq(queue_name: str, prefix: str, counter: str) -> None:
    import aio_pika

    effects = aioredis.Redis.from_url(REDIS)

    async def handle(message: Any) -> str:
        await effects.incr(counter + message.message_id)
        return "applied"

    connection = await aio_pika.connect_robust(AMQP)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=1)
    queue = await channel.get_queue(queue_name)
    await queue.consume(rabbitmq_handler(store_for(prefix), handle, namespace="payments"))
    print("ready", flush=True)
    await asyncio.Future()


async def nats(stream: str, durable: str, prefix: str, counter: str) -> None:
    import nats as nats_py
    from nats.errors import TimeoutError as FetchTimeout

    effects = aioredis.Redis.from_url(REDIS)

    async def handle(msg: Any) -> str:
        die_at("before_effect")
        await effects.incr(counter + msg.headers["Nats-Msg-Id"])
        if os.environ.get("IDEM_DIE_IN_HANDLER") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        die_at("after_effect")
        return "applied"

    connection = await nats_py.connect(NATS)
    subscription = await connection.jetstream().pull_subscribe_bind(durable=durable, stream=stream)
    lease = float(os.environ.get("IDEM_LEASE", "30"))
    on_message = nats_handler(store_for(prefix), handle, namespace="payments", lease=lease)
    print("ready", flush=True)
    while True:
        try:
            messages = await subscription.fetch(1, timeout=1)
        except (FetchTimeout, TimeoutError):  # nats-py raises either under load
            continue
        for msg in messages:
            die_at("receipt")
            await on_message(msg)


if __name__ == "__main__":
    broker, *args = sys.argv[1:]
    asyncio.run(rabbitmq(*args) if broker == "rabbitmq" else nats(*args))
