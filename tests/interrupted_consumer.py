"""A consumer process for tests/test_consumer_interruptions.py, stopped from outside while its handlers
run: a graceful stop (SIGTERM cancelling the main task, SIGINT under `asyncio.run`) or SIGKILL.

    python -m tests.interrupted_consumer '<settings as JSON>'

Settings (all keys given by the test):

- `broker`: "rabbitmq" (`queue`) or "nats" (`stream`, `durable`: a pull consumer and its fetch loop);
- `store`: "redis" (key `prefix`) or "postgres" (records `table`); the claims' `namespace` and `lease`;
- `handler`: what each message's handler does, keyed by its `message_id` / `Nats-Msg-Id`:
  `sleep`: INCR `counter`+key (its effect), then sleep `hold` seconds;
  `in_transaction`: inside `store.transaction()` insert a row into `ledger`, INCR `counter`+key
  (a mark for the test: it is inside, the row not committed), then sleep `hold` seconds;
  `after_commit`: the same transaction committed first, then the INCR and the sleep;
- `prefetch`: RabbitMQ prefetch / NATS fetch batch, worked on concurrently;
- `drained`: the `async with <handler> as on_message:` block of the docs (the consumer drains when a
  graceful stop ends it), else the plain callback with no block;
- `stop`: "sigterm" installs the usual handler (`loop.add_signal_handler(SIGTERM, main_task.cancel)`);
  anything else installs none (SIGINT: `asyncio.run`'s own, which cancels the main task).

Prints `ready` once it consumes, and `stopped` when a graceful stop ended it (exit code 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import redis.asyncio as aioredis

from idem_asgi.jobs import consumers

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
NATS = "nats://127.0.0.1:4222"
REDIS = "redis://127.0.0.1:6379/0"
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


def as_block(on_message: Any) -> Any:
    """The adapter as its `async with` block; the code before these changes returned a plain
    callback (no block, nothing drained), which is then used as it is."""
    return on_message if hasattr(on_message, "__aenter__") else contextlib.nullcontext(on_message)


async def make_store(settings: dict[str, Any]) -> Any:
    if settings["store"] == "postgres":
        from idem_asgi.backends.postgres import PostgresBackend

        store = PostgresBackend.from_dsn(POSTGRES, table=settings["table"], min_size=1, max_size=10)
        await store.setup()
        return store
    from idem_asgi.backends.redis import RedisBackend

    return RedisBackend.from_url(REDIS, prefix=settings["prefix"])


def make_handle(settings: dict[str, Any], store: Any, marks: Any) -> Any:
    kind, counter, hold = settings["handler"], settings["counter"], float(settings["hold"])

    def key_of(message: Any) -> str:
        message_id = getattr(message, "message_id", None)
        return str(message_id if message_id is not None else message.headers["Nats-Msg-Id"])

    async def handle(message: Any) -> str:
        key = key_of(message)
        if kind == "sleep":
            await marks.incr(counter + key)  # the effect
            await asyncio.sleep(hold)
            return "applied"
        insert = f"INSERT INTO {settings['ledger']} (message_id) VALUES ($1)"
        async with store.transaction() as conn:
            await conn.execute(insert, key)
            if kind == "in_transaction":
                await marks.incr(counter + key)  # inside, before COMMIT
                await asyncio.sleep(hold)
        await marks.incr(counter + key)  # after COMMIT
        await asyncio.sleep(hold)
        return "applied"

    return handle


async def rabbitmq(settings: dict[str, Any], store: Any, handle: Any) -> None:
    import aio_pika

    options = {"namespace": settings["namespace"], "lease": float(settings["lease"])}
    on_message = consumers.rabbitmq_handler(store, handle, **options)
    connection = await aio_pika.connect_robust(AMQP)
    if not settings["drained"]:  # the plain callback: nothing waits for the running handlers
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=int(settings["prefetch"]))
        await (await channel.get_queue(settings["queue"])).consume(on_message)
        print("ready", flush=True)
        await asyncio.Future()
    async with connection, as_block(on_message) as on_message:  # as the docs show it
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=int(settings["prefetch"]))
        queue = await channel.get_queue(settings["queue"])
        await queue.consume(on_message)
        print("ready", flush=True)
        await asyncio.Future()


async def nats(settings: dict[str, Any], store: Any, handle: Any) -> None:
    import nats as nats_py
    from nats.errors import TimeoutError as FetchTimeout

    options = {"namespace": settings["namespace"], "lease": float(settings["lease"])}
    on_message = consumers.nats_handler(store, handle, **options)
    connection = await nats_py.connect(NATS)
    block = as_block(on_message) if settings["drained"] else contextlib.nullcontext(on_message)
    async with connection, block as on_message:
        sub = await connection.jetstream().pull_subscribe_bind(durable=settings["durable"], stream=settings["stream"])
        print("ready", flush=True)
        while True:
            try:
                batch = await sub.fetch(int(settings["prefetch"]), timeout=1)
            except (TimeoutError, FetchTimeout):  # nats-py lets the latter out too, under load
                continue
            await asyncio.gather(*(on_message(msg) for msg in batch))


async def main(settings: dict[str, Any]) -> None:
    if settings["stop"] == "sigterm":
        main_task = asyncio.current_task()
        assert main_task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    store = await make_store(settings)
    marks = aioredis.Redis.from_url(REDIS)
    consume = rabbitmq if settings["broker"] == "rabbitmq" else nats
    if not settings["drained"]:  # nothing after it: the store stays open while asyncio.run cancels the handlers
        await consume(settings, store, make_handle(settings, store, marks))
        return
    try:
        await consume(settings, store, make_handle(settings, store, marks))
    finally:  # after the block drained
        await marks.aclose()
        await store.aclose()


if __name__ == "__main__":
    # As a program started from a terminal: a test run in the background (a shell job without job
    # control) hands its children SIGINT ignored, and asyncio.run then installs no handler for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        asyncio.run(main(json.loads(sys.argv[1])))
    except (asyncio.CancelledError, KeyboardInterrupt):  # SIGTERM's handler cancelled main; SIGINT
        print("stopped", flush=True)
