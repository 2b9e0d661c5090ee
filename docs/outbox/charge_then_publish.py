"""Charge, then publish: the payment, its event and the claim commit together; a relay publishes the
event to NATS JetStream; a consumer applies it once. 20 concurrent retries of one payment."""

import asyncio
import contextlib
import json
import os

import httpx
import nats
import nats.js.errors
from nats.js.api import StreamConfig
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import PostgresBackend
from idem_asgi.jobs.consumers import nats_handler
from idem_asgi.outbox import NatsPublisher, Outbox, Relay

DSN = os.environ.get("IDEM_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")

backend = PostgresBackend.from_dsn(DSN, table="shop_claims")
outbox = Outbox(backend)  # table shop_claims_outbox


async def pay(request: Request) -> JSONResponse:
    order = await request.json()
    async with backend.transaction() as conn:  # the charge, its event and the claim: one COMMIT
        await conn.execute("INSERT INTO shop_charges (order_id, amount) VALUES ($1, $2)", order["id"], order["amount"])
        await outbox.add(conn, "shop.charged", json.dumps(order))
    return JSONResponse({"charged": order["id"]}, status_code=201)


app = IdempotencyMiddleware(
    Starlette(routes=[Route("/pay", pay, methods=["POST"])]),
    backend=backend,
    routes=[RoutePolicy("/pay", methods=["POST"], required=True, single_tenant=True, wait=5)],
)


async def apply(msg: nats.aio.msg.Msg) -> str:
    """The consumer's effect, in its own transaction with its own claim (keyed by Nats-Msg-Id)."""
    async with backend.transaction() as conn:
        await conn.execute("INSERT INTO shop_receipts (order_id) VALUES ($1)", json.loads(msg.data)["id"])
    return "applied"


async def main() -> None:
    async with backend.transaction() as conn:  # no claim here: a plain transaction (a fresh start)
        await conn.execute("DROP TABLE IF EXISTS shop_claims, shop_claims_outbox, shop_charges, shop_receipts")
        await conn.execute("CREATE TABLE shop_charges (order_id text, amount int)")
        await conn.execute("CREATE TABLE shop_receipts (order_id text)")
    await backend.setup()
    await outbox.setup()  # or: idem-asgi relay --setup
    nc = await nats.connect(NATS)
    js = nc.jetstream()
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_stream("SHOP")
    await js.add_stream(StreamConfig(name="SHOP", subjects=["shop.>"]))
    on_message = nats_handler(backend, apply, namespace="receipts", recover=backend.recover_uncommitted)
    consumer = await js.subscribe("shop.charged", durable="receipts", manual_ack=True, cb=on_message)

    async with Relay(outbox, NatsPublisher(NATS), poll=0.1) as relay:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://shop") as client:
            order = {"id": "order-1", "amount": 500}
            retries = [client.post("/pay", json=order, headers={"Idempotency-Key": "pay-1"}) for _ in range(20)]
            answers = await asyncio.gather(*retries)
        replays = sum("idempotent-replayed" in r.headers for r in answers)
        print("answers:", sorted({r.status_code for r in answers}), "replays:", replays)
        for _ in range(200):  # the relay publishes (woken by the COMMIT), the consumer applies
            async with backend.transaction() as conn:
                if await conn.fetchval("SELECT count(*) FROM shop_receipts"):
                    break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # a second delivery, were there one, would land by now
        print("events published:", relay.stats.published)

    async with backend.transaction() as conn:
        print("charges:", await conn.fetchval("SELECT count(*) FROM shop_charges"))
        print("receipts:", await conn.fetchval("SELECT count(*) FROM shop_receipts"))
    await consumer.unsubscribe()
    await js.delete_stream("SHOP")
    await nc.close()
    await backend.aclose()


asyncio.run(main())
