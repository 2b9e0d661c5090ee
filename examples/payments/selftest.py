"""`python -m examples.payments --selftest`: a scripted scenario, in-process, that prints what happened.

1. A payment whose answer is lost on the way back; the client retries with the same key: one charge.
2. The provider times out after charging; the client's retry asks the provider by the attempt's
   reference before charging: still one charge.
3. A partial refund.
4. A refund webhook delivered three times: applied once, three identical 2xx answers.
5. A late `charge.failed` webhook for a paid order: an illegal transition, logged and ignored.
6. Two tabs: the provider times out on tab 1; tab 2 pays with another key: one charge.
7. A cancel while a payment is in flight: the provider is asked first, so the money is never stranded.
8. For contrast, no middleware on /pay: the client whose answer was lost is told its payment conflicted.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Any

import httpx

from idem_asgi.client import IdempotentRetryTransport, was_replayed

from .app import PAY_PATH, create_app, policies
from .provider import FakeProvider, ForgetfulProvider, HonestProvider

MERCHANT = {"X-Merchant-Id": "m_acme"}


class LossyTransport(httpx.AsyncBaseTransport):
    """Delivers requests to the app, then loses the next `lose` answers (as a dropped connection would)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, lose: int = 0) -> None:
        self.inner = inner
        self.lose = lose
        self.lost: list[httpx.Response] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if self.lose > 0:
            self.lose -= 1
            await response.aread()
            self.lost.append(response)
            raise httpx.ReadError("connection reset while reading the response", request=request)
        return response


def client_for(app: Any, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport or httpx.ASGITransport(app=app), base_url="http://payments")


async def new_order(client: httpx.AsyncClient, amount: int) -> str:
    r = await client.post("/orders", json={"amount": amount}, headers={**MERCHANT, "Idempotency-Key": uuid.uuid4().hex})
    r.raise_for_status()
    return str(r.json()["id"])


def fresh_key() -> dict[str, str]:
    return {**MERCHANT, "Idempotency-Key": uuid.uuid4().hex}


def say(label: str, text: object) -> None:
    print(f"   {label:<24}{text}", flush=True)


def slug(response: httpx.Response) -> str:
    """The last part of a problem answer's `type`: `order-not-payable`, `provider-timeout`, ..."""
    return str(response.json().get("type", "")).rsplit(":", 1)[-1]


async def lost_answer(provider: FakeProvider, protected: bool) -> tuple[int, httpx.Response, httpx.Response]:
    """Pay once through a connection that loses the first answer; the client retries with the same key."""
    routes = policies() if protected else [p for p in policies() if p.path != PAY_PATH]
    app = create_app(provider=provider, routes=routes)
    lossy = LossyTransport(httpx.ASGITransport(app=app), lose=1)
    async with client_for(app) as setup:
        order_id = await new_order(setup, 2500)
    transport = IdempotentRetryTransport(lossy, backoff_base=0.01)  # one key per intent, reused by each attempt
    async with client_for(app, transport) as client:
        retried = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=MERCHANT)
    return len(provider.succeeded), lossy.lost[0], retried


async def run() -> int:
    checks: list[bool] = []
    print("payments example selftest (memory:// store, fake in-process card provider)\n")

    print("1. pay 25.00 EUR; the answer is lost on the way back, the client retries with the same key")
    provider = HonestProvider()
    charges, first, retry = await lost_answer(provider, protected=True)
    say("first attempt", f"{first.status_code} (charged, answer lost)")
    say("retry", f"{retry.status_code}, Idempotent-Replayed: {retry.headers.get('idempotent-replayed')}")
    say("byte-identical", first.content == retry.content)
    say("provider charges", charges)
    checks += [charges == 1, was_replayed(retry), first.content == retry.content]

    print("\n2. the provider charges but times out; the client's retry runs the request again")
    provider = HonestProvider()
    app = create_app(provider=provider)
    async with client_for(app) as client:
        order_id = await new_order(client, 4000)
        provider.lose_next_responses = 1
        key = {**MERCHANT, "Idempotency-Key": uuid.uuid4().hex}
        timed_out = await client.post(f"/orders/{order_id}/pay", json={"amount": 4000}, headers=key)
        again = await client.post(f"/orders/{order_id}/pay", json={"amount": 4000}, headers=key)
        say("first attempt", f"{timed_out.status_code} {slug(timed_out)} (5xx: the claim is released)")
        say("retry", f"{again.status_code}, order {again.json()['order']['state']} (asked the provider: same charge)")
        say("provider charges", len(provider.succeeded))
        checks += [timed_out.status_code == 504, again.status_code == 200, len(provider.succeeded) == 1]

        print("\n3. refund 10.00 EUR of it")
        refund = await client.post(
            f"/orders/{order_id}/refunds", json={"amount": 1000}, headers={**MERCHANT, "Idempotency-Key": "refund-1"}
        )
        order = refund.json()["order"]
        say("refund", f"{refund.status_code}, order {order['state']}, refunded {order['refunded']}")
        checks += [refund.status_code == 201, order["state"] == "partially_refunded"]

        print("\n4. a 5.00 EUR refund made in the provider's dashboard; its webhook is delivered 3 times")
        charge_id = again.json()["charge"]["id"]
        made = await provider.refund(charge_id=charge_id, amount=500, reference=order_id, idempotency_key=None)
        delivery = provider.refund_webhook(made)
        answers = [
            await client.post("/webhooks/provider", content=delivery.body, headers=delivery.headers) for _ in range(3)
        ]
        say("deliveries", ", ".join(f"{r.status_code}{' (replay)' if was_replayed(r) else ''}" for r in answers))
        say("byte-identical", len({r.content for r in answers}) == 1)
        order = (await client.get(f"/orders/{order_id}", headers=MERCHANT)).json()
        applied = sum(made.id in line for line in order["history"])
        say("applied", f"{applied} time(s); refunded {order['refunded']} in all, order {order['state']}")
        checks += [all(r.status_code == 200 for r in answers), len({r.content for r in answers}) == 1]
        checks += [applied == 1, order["refunded"] == 1500]

        print("\n5. a late charge.failed webhook for that (paid, partly refunded) order")
        late = provider.webhook("charge.failed", order_id=order_id, charge_id="ch_old_attempt", reason="expired_card")
        answer = await client.post("/webhooks/provider", content=late.body, headers=late.headers)
        after = (await client.get(f"/orders/{order_id}", headers=MERCHANT)).json()
        say("answer", f"{answer.status_code}, applied: {answer.json()['applied']}")
        say("order", f"still {after['state']}")
        checks += [answer.status_code == 200, answer.json()["applied"] is False, after["state"] == order["state"]]

    print("\n6. two tabs: tab 1's charge lands but the provider times out; tab 2 pays with another key")
    provider = HonestProvider()
    app = create_app(provider=provider)
    async with client_for(app) as client:
        order_id = await new_order(client, 1800)
        provider.lose_next_responses = 1
        tab1 = await client.post(f"/orders/{order_id}/pay", json={"amount": 1800}, headers=fresh_key())
        tab2 = await client.post(f"/orders/{order_id}/pay", json={"amount": 1800}, headers=fresh_key())
        say("tab 1", f"{tab1.status_code} {slug(tab1)} (order left paying)")
        say("tab 2", f"{tab2.status_code}, order {tab2.json()['order']['state']} (asked about tab 1's attempt)")
        say("provider charges", len(provider.succeeded))
        checks += [tab1.status_code == 504, tab2.status_code == 200, len(provider.succeeded) == 1]

        print("\n7. a cancel while that kind of payment is in flight")
        order_id = await new_order(client, 700)
        provider.lose_next_responses = 1
        await client.post(f"/orders/{order_id}/pay", json={"amount": 700}, headers=fresh_key())
        cancel = await client.post(f"/orders/{order_id}/cancel", headers=fresh_key())
        order = (await client.get(f"/orders/{order_id}", headers=MERCHANT)).json()
        say("cancel", f"{cancel.status_code} {slug(cancel)}: the charge had landed")
        say("order", f"{order['state']}, charge {order['charge_id']} (the money is not stranded)")
        checks += [cancel.status_code == 409, order["state"] == "paid", len(provider.succeeded) == 2]

    print("\n8. contrast: no middleware on /pay")
    charges, first, retry = await lost_answer(ForgetfulProvider(), protected=False)
    say("client's answer lost", f"{first.status_code} (lost), then the retry gets {retry.status_code} {slug(retry)}")
    say("", f"{charges} charge: the order's state refused a 2nd, but the paying client is told it conflicted")
    checks += [retry.status_code == 409, charges == 1]

    ok = all(checks)
    verdict = "OK: steps 1-7 each took effect exactly once; step 8 is the failure the middleware prevents"
    print("\nRESULT " + (verdict if ok else "FAILED"))
    return 0 if ok else 1


def configure_logging() -> None:
    """Show the warnings the state machine logs, inline with the scenario."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("   log: %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
