"""Step 3: whose key is it? Keys scoped per tenant. Run: python docs/tutorial/step3_scope.py"""

import asyncio

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy, scope_from_header
from idem_asgi.backends import MemoryBackend

charges: list[str] = []  # one entry per charge: the tenant it was made for

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    backend=MemoryBackend(),
    routes=[RoutePolicy("/payments", methods=["POST"], required=True)],  # no single_tenant any more
    scope=scope_from_header("x-tenant"),  # set by your gateway from the API key, never by the client
)


@app.post("/payments", status_code=201)
async def pay(request: Request) -> dict[str, object]:
    info = request.state.idempotency  # the key and the scope this request runs under
    charges.append(info.scope)
    return {"charge": f"ch_{len(charges)}", "tenant": info.scope, "key": info.key}


async def main() -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        for tenant in ("acme", "globex", "acme", "globex"):  # both tenants use the key "order-1", twice
            headers = {"Idempotency-Key": "order-1", "X-Tenant": tenant}
            r = await client.post("/payments", json={"amount": 1230}, headers=headers)
            replayed = r.headers.get("Idempotent-Replayed", "no")
            print(f"{tenant:6}: {r.status_code} replayed={replayed} {r.text}")

        r = await client.post("/payments", json={"amount": 1230}, headers={"Idempotency-Key": "order-1"})
        print("no tenant:", r.status_code, r.json()["type"])
    print("charges:", sorted(charges))


if __name__ == "__main__":
    asyncio.run(main())
