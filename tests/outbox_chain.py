"""The processes of tests/test_outbox_chain.py: the payment API, a relay, a consumer, each able to
SIGKILL itself once at a named point.

    python -m tests.outbox_chain app|relay|consumer <config JSON>

IDEM_DIE_AT names the point (`app_before_commit`, `app_after_commit`, `relay_before_publish`,
`relay_after_publish`, `consumer_before_commit`, `consumer_after_commit`, `consumer_after_store`),
IDEM_DIE_NTH the how-manieth pass through it dies (1), IDEM_DIE_MARK a file: the first process to
reach the point creates it and dies; the others, and every restart, go on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections import Counter
from typing import Any

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import PostgresBackend
from idem_asgi.outbox import Outbox, OutboxMessage, Relay, publisher_for
from idem_asgi.records import RecordKey, StoredResponse
from tests.support.stores import Delegating

_passes: Counter[str] = Counter()


def die_at(point: str) -> None:
    """SIGKILL this process at `point` once in the whole test (the mark file says it happened)."""
    if os.environ.get("IDEM_DIE_AT") != point:
        return
    _passes[point] += 1
    if _passes[point] != int(os.environ.get("IDEM_DIE_NTH", "1")):
        return
    try:
        fd = os.open(os.environ["IDEM_DIE_MARK"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)


def backend_of(config: dict[str, Any], table: str) -> PostgresBackend:
    return PostgresBackend.from_dsn(config["dsn"], table=table, min_size=1, max_size=4)


async def app(config: dict[str, Any]) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    backend = backend_of(config, config["records"])
    await backend.setup()
    outbox = Outbox(backend)

    async def pay(request: Request) -> JSONResponse:
        key = request.headers["idempotency-key"]
        order = await request.json()
        async with backend.transaction() as conn:  # the charge, its event and the claim's mark: one COMMIT
            await conn.execute(f"INSERT INTO {config['ledger']} (key, amount) VALUES ($1, $2)", key, order["amount"])
            await outbox.add(conn, config["subject"], json.dumps({"payment": key, "amount": order["amount"]}))
            die_at("app_before_commit")
        die_at("app_after_commit")
        return JSONResponse({"paid": key}, status_code=201)

    api = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    policy = RoutePolicy(
        "/pay", methods=["POST"], required=True, lease=2, recover=backend.recover_uncommitted, single_tenant=True
    )
    server = uvicorn.Server(
        uvicorn.Config(
            IdempotencyMiddleware(api, backend=backend, routes=[policy]),
            port=config["port"],
            log_level="warning",
            lifespan="off",
        )
    )
    await server.serve()


class DyingPublisher:
    """The real publisher, with the relay's crash points around each publish."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def publish(self, message: OutboxMessage) -> None:
        die_at("relay_before_publish")
        await self.inner.publish(message)
        die_at("relay_after_publish")  # the broker has it; the row is not marked sent

    async def aclose(self) -> None:
        await self.inner.aclose()


async def relay(config: dict[str, Any]) -> None:
    backend = backend_of(config, config["records"])
    relay = Relay(
        Outbox(backend), DyingPublisher(publisher_for(config["broker_url"])), batch=4, poll=0.2, standby_poll=0.2
    )
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, relay.stop)
    await relay.run()


class DieAfterStore(Delegating):
    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        stored = await self.inner.complete(key, token, response, ttl=ttl)
        die_at("consumer_after_store")  # applied and recorded, not acked: the broker redelivers
        return stored


async def consumer(config: dict[str, Any]) -> None:
    from idem_asgi.jobs.consumers import nats_handler, rabbitmq_handler

    backend = backend_of(config, config["consumer_records"])
    await backend.setup()
    store = DieAfterStore(backend)

    async def apply(message_id: str, body: bytes) -> str:
        event = json.loads(body)
        async with backend.transaction() as conn:  # the consumer's effect, exactly once with its claim
            await conn.execute(
                f"INSERT INTO {config['applied']} (msg_id, payment) VALUES ($1, $2)", message_id, event["payment"]
            )
            die_at("consumer_before_commit")
        die_at("consumer_after_commit")
        return "applied"

    if config["broker"] == "rabbitmq":
        import aio_pika

        async def on_rabbit(message: Any) -> str:
            return await apply(message.message_id, message.body)

        connection = await aio_pika.connect_robust(config["broker_url"])
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=4)
        queue = await channel.get_queue(config["subject"])
        await queue.consume(
            rabbitmq_handler(store, on_rabbit, namespace="chain", lease=2, wait=5, recover=backend.recover_uncommitted)
        )
        await asyncio.Future()
    import nats
    from nats.errors import TimeoutError as FetchTimeout

    async def on_nats(msg: Any) -> str:
        return await apply(msg.headers["Nats-Msg-Id"], msg.data)

    nc = await nats.connect(config["broker_url"])
    subscription = await nc.jetstream().pull_subscribe_bind(durable=config["durable"], stream=config["stream"])
    on_message = nats_handler(store, on_nats, namespace="chain", lease=2, wait=5, recover=backend.recover_uncommitted)
    while True:
        try:
            messages = await subscription.fetch(4, timeout=1)
        except (FetchTimeout, TimeoutError):
            continue
        await asyncio.gather(*(on_message(msg) for msg in messages))


if __name__ == "__main__":
    role, raw = sys.argv[1], sys.argv[2]
    asyncio.run({"app": app, "relay": relay, "consumer": consumer}[role](json.loads(raw)))
