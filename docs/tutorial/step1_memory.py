"""Step 1: a payments app on the memory store. Run: python docs/tutorial/step1_memory.py"""

import asyncio

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import MemoryBackend

charges: list[int] = []  # our fake payment provider: one entry per charge it made

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    backend=MemoryBackend(),  # one process only: fine for a first step, tests and demos
    routes=[RoutePolicy("/payments", methods=["POST"], required=True, single_tenant=True)],
)


@app.post("/payments", status_code=201)
async def pay(request: Request) -> dict[str, object]:
    order = await request.json()
    charges.append(order["amount"])  # the effect that must happen once
    return {"charge": f"ch_{len(charges)}", "amount": order["amount"]}


async def main() -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        headers = {"Idempotency-Key": "order-1001"}
        answers = []
        for attempt in (1, 2, 3):  # the same request, sent three times
            r = await client.post("/payments", json={"amount": 1230}, headers=headers)
            replayed = r.headers.get("Idempotent-Replayed", "no")
            print(f"attempt {attempt}: {r.status_code} replayed={replayed} {r.text}")
            answers.append(r.content)
        print("byte-identical bodies:", answers[0] == answers[1] == answers[2])
        print("charges:", len(charges))

        r = await client.post("/payments", json={"amount": 9999}, headers=headers)
        print("same key, another body:", r.status_code, r.json()["type"])
        r = await client.post("/payments", json={"amount": 1230})
        print("no key at all:", r.status_code, r.json()["type"])
    print("charges:", len(charges))


if __name__ == "__main__":
    asyncio.run(main())
