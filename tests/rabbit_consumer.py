"""A consumer process for tests/test_consumers.py: applies messages from a queue once (effects
counted by INCR in the shared Redis), and with IDEM_RABBIT_DIE_AFTER_STORE=1 SIGKILLs itself right
after the first message's completion is stored, before its ack: the broker must redeliver it."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import aio_pika
import redis.asyncio as aioredis

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.consumers import rabbitmq_handler
from idem_asgi.records import RecordKey, StoredResponse
from tests.support.stores import Delegating

AMQP = "amqp://guest:guest@127.0.0.1:5672/"


class DieAfterStore(Delegating):
    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        stored = await self.inner.complete(key, token, response, ttl=ttl)
        os.kill(os.getpid(), signal.SIGKILL)  # after the effect and its record, before the ack
        return stored


async def main(queue_name: str, prefix: str, counter: str) -> None:
    store: Any = RedisBackend.from_url("redis://127.0.0.1:6379/0", prefix=prefix)
    if os.environ.get("IDEM_RABBIT_DIE_AFTER_STORE") == "1":
        store = DieAfterStore(store)
    effects = aioredis.Redis.from_url("redis://127.0.0.1:6379/0")

    async def handle(message: Any) -> str:
        await effects.incr(counter + message.message_id)
        return "applied"

    connection = await aio_pika.connect_robust(AMQP)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=1)
    queue = await channel.get_queue(queue_name)
    await queue.consume(rabbitmq_handler(store, handle))
    print("ready", flush=True)
    await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
