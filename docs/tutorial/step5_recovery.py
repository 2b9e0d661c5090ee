"""Step 5: a crash after the charge, and its recovery. Run: python docs/tutorial/step5_recovery.py"""

import asyncio
import json
from dataclasses import dataclass
from typing import Literal

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, Record, RecordKey, RoutePolicy, StoredResponse, scope_from_header
from idem_asgi.backends import Backend, MemoryBackend


@dataclass
class Charge:
    id: str
    amount: int


class Provider:
    """A fake payment provider that honours idempotency keys, as real ones do."""

    def __init__(self) -> None:
        self.charges: dict[str, Charge] = {}

    async def charge(self, amount: int, *, idempotency_key: str) -> Charge:
        if idempotency_key not in self.charges:
            self.charges[idempotency_key] = Charge(f"ch_{len(self.charges) + 1}", amount)
        return self.charges[idempotency_key]

    async def find_charge(self, *, idempotency_key: str) -> Charge | None:
        return self.charges.get(idempotency_key)


provider = Provider()


def provider_key(scope: str, key: str) -> str:
    """The key the handler forwards to the provider, rebuilt from the record alone."""
    return f"pay:{scope}:{key}"


def answer(charge: Charge) -> dict[str, object]:
    return {"charge": charge.id, "amount": charge.amount}


async def recover(key: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
    """Asked when a retry finds a claim whose holder is gone: did the charge happen?"""
    charge = await provider.find_charge(idempotency_key=provider_key(key.scope, key.key))
    if charge is None:
        return "run"  # the provider never saw it: run the request now, once
    body = json.dumps(answer(charge), separators=(",", ":")).encode()  # as the handler renders it
    return StoredResponse(201, [(b"content-type", b"application/json")], body)


def build_app(backend: Backend, *, crash: bool, with_recover: bool) -> FastAPI:
    """One deploy of the app: `crash` makes its worker die right after the provider charged."""
    app = FastAPI()
    hook = recover if with_recover else None
    policy = RoutePolicy("/payments", methods=["POST"], required=True, recover=hook)
    app.add_middleware(IdempotencyMiddleware, backend=backend, routes=[policy], scope=scope_from_header("x-tenant"))

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict[str, object]:
        info = request.state.idempotency
        order = await request.json()
        charge = await provider.charge(order["amount"], idempotency_key=provider_key(info.scope, info.key))
        info.mark_effect()  # money moved: from here on, a failure must never lead to a second run
        if crash:
            raise RuntimeError("the worker died before it could answer")
        return answer(charge)

    return app


async def send(app: FastAPI, label: str) -> None:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # an app's crash is a 500
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        headers = {"Idempotency-Key": "order-5005", "X-Tenant": "acme"}
        r = await client.post("/payments", json={"amount": 7700}, headers=headers)
    problem = r.headers["content-type"] == "application/problem+json"
    shown = r.json()["type"] if problem else r.text
    print(f"{label:15} {r.status_code} replayed={r.headers.get('Idempotent-Replayed', 'no')} {shown}")


async def main() -> None:
    backend = MemoryBackend()
    before = build_app(backend, crash=True, with_recover=False)
    await send(before, "first attempt:")  # the card is charged, then the worker dies
    await send(before, "retry:")  # did the charge happen? Nobody knows: blocked, never run twice
    print("charges:", len(provider.charges))

    after = build_app(backend, crash=False, with_recover=True)  # the same store, with a recover hook
    await send(after, "retry:")  # the hook asks the provider by the same key: it did charge
    await send(after, "another retry:")
    print("charges:", len(provider.charges))


if __name__ == "__main__":
    asyncio.run(main())
