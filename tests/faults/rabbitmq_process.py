"""The RabbitMQ consumer process of the fault matrix (tests/faults/test_matrix_rabbitmq.py).

    python -m tests.faults.rabbitmq_process '<settings as JSON>'

Its plan comes from the environment (`IDEM_FAULT_RUN`, `IDEM_FAULT_POINTS`: tests/support/fault_points.py).
It consumes the queue as the docs show it: an aio-pika robust connection, prefetch large enough
for every key at once, and `async with connection, rabbitmq_handler(PointStore(store), handle, ...)
as on_message:`, whose handler is `fault_points.work`. Settings (all given by the test):

- `amqp`, `queue`, `prefetch`: the broker (the shared one, or a throwaway node), the queue;
- `store` ("redis" or "postgres"), `store_url`, `prefix` (Redis key prefix) / `table` (Postgres);
- `namespace`, `lease`: the claims' terms.

SIGTERM cancels the main task (the usual handler; the block then drains) and prints `stopping`.
The test asks for in-process faults by pushing onto `fault:<run>:trigger` (shared Redis):

- `channel_lost`: a passive declare of a queue that does not exist, on the consumer's own channel:
  the broker closes that channel with a 404 channel error (aiormq then cancels every callback task
  of the channel, the broker requeues its unacked deliveries, and the robust channel opens again and
  consumes again);
- `cancelled`: every callback task aio-pika runs for this consumer is cancelled, and nothing else:
  the tasks whose coroutine is the adapter's `_deliver` (aio-pika starts the callback in a task of
  its own, which aiormq's per-delivery task awaits: it is the very task a channel close cancels).
  The channel stays open, so this isolates the cancellation from a lost channel.

Each is answered on `fault:<run>:fault` (`channel_lost closed` / `cancelled <n tasks>`).
Prints `ready` once it consumes, `stopped` once a graceful stop ended it (exit code 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import aio_pika
import redis.asyncio as aioredis
from aio_pika.exceptions import ChannelNotFoundEntity

from idem_asgi.jobs.consumers import _core, rabbitmq_handler
from tests.support.fault_points import Plan, PointStore, work
from tests.support.servers import REDIS_URL


async def make_store(settings: dict[str, Any]) -> Any:
    if settings["store"] == "postgres":
        from idem_asgi.backends.postgres import PostgresBackend

        store = PostgresBackend.from_dsn(settings["store_url"], table=settings["table"], min_size=1, max_size=20)
        await store.setup()
        return store
    from idem_asgi.backends.redis import RedisBackend

    return RedisBackend.from_url(settings["store_url"], prefix=settings["prefix"])


def callback_tasks() -> list[asyncio.Task[Any]]:
    """The tasks aio-pika runs the consumer's callback in (their coroutine is the adapter's `_deliver`)."""
    code = _core._deliver.__code__
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "cr_code", None) is code and not t.done()]


async def faults(plan: Plan, channel: Any) -> None:
    """Apply the faults the test asks for, and say what happened."""
    listening = aioredis.Redis.from_url(REDIS_URL)  # a connection of its own: BLPOP holds it
    try:
        while True:
            item = await listening.blpop([f"fault:{plan.run}:trigger"], timeout=1)
            if item is None:
                continue
            asked = item[1].decode() if isinstance(item[1], bytes) else str(item[1])
            if asked == "channel_lost":
                try:
                    await channel.declare_queue(f"fault-{plan.run}-missing", passive=True)
                    answer = "channel_lost not closed"
                except ChannelNotFoundEntity:
                    answer = "channel_lost closed"
            elif asked == "cancelled":
                tasks = callback_tasks()
                for task in tasks:
                    task.cancel()
                answer = f"cancelled {len(tasks)}"
            else:
                answer = f"unknown {asked}"
            await plan.redis.rpush(f"fault:{plan.run}:fault", answer)
    finally:
        await listening.aclose()


async def consume(settings: dict[str, Any], plan: Plan, store: Any) -> None:
    async def handle(message: Any) -> str:
        return await work(plan, str(message.message_id), store)

    connection = await aio_pika.connect_robust(settings["amqp"], reconnect_interval=0.5)
    terms = {"namespace": settings["namespace"], "lease": float(settings["lease"])}
    async with connection, rabbitmq_handler(PointStore(store, plan), handle, **terms) as on_message:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=int(settings["prefetch"]))
        await (await channel.get_queue(settings["queue"])).consume(on_message)
        watcher = asyncio.ensure_future(faults(plan, channel))
        print("ready", flush=True)
        try:
            await asyncio.Future()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


async def main(settings: dict[str, Any]) -> None:
    main_task = asyncio.current_task()
    assert main_task is not None

    def stop() -> None:
        print("stopping", flush=True)
        main_task.cancel()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
    plan = Plan()
    store = await make_store(settings)
    try:
        await consume(settings, plan, store)
    finally:  # after the block drained
        with contextlib.suppress(Exception):
            await store.aclose()
        await plan.aclose()


if __name__ == "__main__":
    try:
        asyncio.run(main(json.loads(sys.argv[1])))
    except asyncio.CancelledError:  # SIGTERM's handler cancelled main, after the block drained
        print("stopped", flush=True)
