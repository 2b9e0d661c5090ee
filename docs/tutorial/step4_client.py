"""Step 4: a client that retries safely, with one key per intent. Run: python docs/tutorial/step4_client.py"""

import asyncio
import uuid

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy, scope_from_header
from idem_asgi.backends import MemoryBackend
from idem_asgi.client import IdempotentRetryTransport, was_replayed

charges: list[int] = []

app = FastAPI()
app.add_middleware(
    IdempotencyMiddleware,
    backend=MemoryBackend(),
    routes=[RoutePolicy("/payments", methods=["POST"], required=True)],
    scope=scope_from_header("x-tenant"),
)


@app.post("/payments", status_code=201)
async def pay(request: Request) -> dict[str, object]:
    order = await request.json()
    charges.append(order["amount"])
    return {"charge": f"ch_{len(charges)}", "amount": order["amount"]}


class LossyNetwork(httpx.AsyncBaseTransport):
    """Delivers every request, but loses the first answer on its way back (a timeout, a reset)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.keys: list[str] = []  # the key each attempt carried

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.keys.append(request.headers.get("Idempotency-Key", "-"))
        response = await self.inner.handle_async_request(request)  # the app runs: the card is charged
        if len(self.keys) == 1:
            await response.aclose()
            raise httpx.ReadError("connection reset before the answer arrived", request=request)
        return response


async def naive_retries() -> None:
    """The bug this step is about: a retry loop that mints a new key on every attempt."""
    network = LossyNetwork(httpx.ASGITransport(app=app))
    async with httpx.AsyncClient(transport=network, base_url="http://shop.test") as client:
        for _attempt in range(5):
            headers = {"X-Tenant": "acme", "Idempotency-Key": uuid.uuid4().hex}  # wrong: one key per attempt
            try:
                r = await client.post("/payments", json={"amount": 2500}, headers=headers)
                break
            except httpx.TransportError:
                continue
    print("naive client:", len(network.keys), "attempts,", len(set(network.keys)), "keys, answer", r.status_code)


async def safe_retries() -> None:
    network = LossyNetwork(httpx.ASGITransport(app=app))
    # The transport mints one key per call (or keeps yours), and every retry of the call sends it.
    transport = IdempotentRetryTransport(network, max_attempts=5, total_timeout=10)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        r = await client.post("/payments", json={"amount": 2500}, headers={"X-Tenant": "acme"})
    print("retry transport:", len(network.keys), "attempts,", len(set(network.keys)), "key, answer", r.status_code)
    print("answer:", r.text, "replayed" if was_replayed(r) else "first run")


async def main() -> None:
    await naive_retries()
    print("charges:", len(charges))
    charges.clear()
    await safe_retries()
    print("charges:", len(charges))


if __name__ == "__main__":
    asyncio.run(main())
