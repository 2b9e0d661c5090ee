"""Step 2: the same app on Redis, under 20 concurrent retries. Run: python docs/tutorial/step2_redis.py"""

import asyncio
import os
import uuid
from collections import Counter

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import RedisBackend

REDIS_URL = os.environ.get("IDEM_REDIS_URL", "redis://localhost:6379/0")
PREFIX = f"tutorial:{uuid.uuid4().hex}:"  # this run's own keys, deleted at the end

charges: list[int] = []
backend = RedisBackend.from_url(REDIS_URL, prefix=PREFIX)

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    backend=backend,  # every worker process sharing this Redis shares the keys
    # wait=5: a repeat that arrives while the first request runs waits for its answer (up to 5 s)
    # and replays it, instead of getting 409 request-in-progress at once.
    routes=[RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True, wait=5)],
)


@app.post("/payments", status_code=201)
async def pay(request: Request) -> dict[str, object]:
    order = await request.json()
    await asyncio.sleep(0.2)  # a slow payment provider: the retries arrive while it works
    charges.append(order["amount"])
    return {"charge": f"ch_{len(charges)}", "amount": order["amount"]}


async def main() -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:

        async def attempt() -> httpx.Response:
            headers = {"Idempotency-Key": "order-2002"}
            return await client.post("/payments", json={"amount": 4500}, headers=headers)

        answers = await asyncio.gather(*(attempt() for _ in range(20)))  # 20 retries at once
    outcomes = Counter(f"{r.status_code} replayed={r.headers.get('Idempotent-Replayed', 'no')}" for r in answers)
    for outcome, count in sorted(outcomes.items()):
        print(f"{count:2} x {outcome}")
    print("distinct bodies:", len({r.content for r in answers}))
    print("charges:", len(charges))


async def run() -> None:
    try:
        await main()
    finally:  # leave Redis as we found it: delete this run's keys, then close the pool
        async for name in backend.client.scan_iter(match=f"{PREFIX}*", count=10_000):
            await backend.client.delete(name)
        await backend.aclose()


if __name__ == "__main__":
    asyncio.run(run())
