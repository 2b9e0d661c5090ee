"""The payments example (examples/payments): money moves once per intent, whatever the retries."""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from examples.payments.app import PAY_PATH, create_app, policies
from examples.payments.orders import TRANSITIONS, Order, OrderState, apply_refund, transition
from examples.payments.provider import (
    DECLINED_CARD,
    FakeProvider,
    ForgetfulProvider,
    HonestProvider,
    WebhookDelivery,
)
from examples.payments.selftest import LossyTransport
from idem_asgi.client import IdempotentRetryTransport, was_replayed

pytestmark = pytest.mark.memory

MERCHANT = {"X-Merchant-Id": "m_acme"}
PROBLEM = "urn:idem-asgi:problem:"


def key() -> dict[str, str]:
    """Headers of a new intent: the merchant and a fresh idempotency key."""
    return {**MERCHANT, "Idempotency-Key": uuid.uuid4().hex}


def client_for(app: Any, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport or httpx.ASGITransport(app=app), base_url="http://payments")


@pytest.fixture
def provider() -> HonestProvider:
    return HonestProvider(latency=0.005)


@pytest.fixture
async def client(provider: HonestProvider) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_app(provider=provider)) as c:
        yield c


async def new_order(client: httpx.AsyncClient, amount: int = 2500, headers: dict[str, str] = MERCHANT) -> str:
    r = await client.post("/orders", json={"amount": amount}, headers={**headers, "Idempotency-Key": uuid.uuid4().hex})
    assert r.status_code == 201, r.text
    assert r.json()["state"] == "pending"
    return str(r.json()["id"])


async def paid_order(client: httpx.AsyncClient, amount: int = 2500) -> tuple[str, str]:
    """An order paid in full: (order id, charge id)."""
    order_id = await new_order(client, amount)
    r = await client.post(f"/orders/{order_id}/pay", json={"amount": amount}, headers=key())
    assert r.status_code == 200, r.text
    return order_id, str(r.json()["charge"]["id"])


async def get_order(client: httpx.AsyncClient, order_id: str) -> dict[str, Any]:
    r = await client.get(f"/orders/{order_id}", headers=MERCHANT)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def without_pay_protection() -> list[Any]:
    return [p for p in policies() if p.path != PAY_PATH]


# --- payments ---------------------------------------------------------------------------------


async def test_200_concurrent_retries_of_one_payment_charge_once() -> None:
    provider = HonestProvider(latency=0.05)  # the charge is still running while the storm arrives
    async with client_for(create_app(provider=provider)) as client:
        order_id = await new_order(client)
        headers = key()
        answers = await asyncio.gather(
            *(client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers) for _ in range(200))
        )
        order = await get_order(client, order_id)
    assert len(provider.ledger) == 1
    statuses = Counter(r.status_code for r in answers)
    assert set(statuses) <= {200, 409}, statuses
    assert statuses[409] > 0
    assert len({r.content for r in answers if r.status_code == 200}) == 1
    assert sum(not was_replayed(r) for r in answers if r.status_code == 200) == 1
    assert all(r.json()["type"] == PROBLEM + "request-in-progress" for r in answers if r.status_code == 409)
    assert all(r.headers["retry-after"] == "1" for r in answers if r.status_code == 409)
    assert order["state"] == "paid" and order["attempts"] == [provider.ledger[0].id]


async def test_a_lost_response_is_replayed_byte_for_byte_and_charges_once(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    headers = key()
    first = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)  # lost on the way
    retry = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
    assert first.status_code == retry.status_code == 200
    assert not was_replayed(first) and was_replayed(retry)
    assert retry.content == first.content
    assert len(provider.ledger) == 1


async def test_the_retry_transport_recovers_a_lost_response_with_one_charge(provider: HonestProvider) -> None:
    app = create_app(provider=provider)
    async with client_for(app) as setup:
        order_id = await new_order(setup)
    lossy = LossyTransport(httpx.ASGITransport(app=app), lose=1)
    async with client_for(app, IdempotentRetryTransport(lossy, backoff_base=0.01)) as client:
        r = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=MERCHANT)  # key minted once
    assert r.status_code == 200 and was_replayed(r)
    assert r.content == lossy.lost[0].content
    assert len(provider.ledger) == 1


async def test_even_a_forgetful_provider_is_charged_once_after_a_timeout_the_order_asks_it_first() -> None:
    """The provider charged, its answer was lost: the order stays `paying`, and the retry asks before charging."""
    provider = ForgetfulProvider(latency=0.001)
    async with client_for(create_app(provider=provider, routes=without_pay_protection())) as client:
        order_id = await new_order(client)
        headers = key()
        provider.lose_next_responses = 1
        first = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
        retry = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
    assert first.status_code == 504 and retry.status_code == 200
    assert len(provider.succeeded) == 1


async def test_without_the_middleware_a_lost_response_retry_is_refused_not_replayed() -> None:
    """The order's state stops a second charge, but the client that paid is told its payment conflicted."""
    provider = ForgetfulProvider(latency=0.001)
    async with client_for(create_app(provider=provider, routes=without_pay_protection())) as client:
        order_id = await new_order(client)
        headers = key()
        first = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
        retry = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
    assert first.status_code == 200
    assert retry.status_code == 409 and retry.json()["type"].endswith(":order-not-payable")
    assert len(provider.succeeded) == 1


@pytest.mark.parametrize(("provider_cls", "charges"), [(HonestProvider, 1), (ForgetfulProvider, 1)])
async def test_a_provider_timeout_is_resolved_by_the_attempts_reference(
    provider_cls: type[FakeProvider], charges: int
) -> None:
    provider = provider_cls(latency=0.001)
    async with client_for(create_app(provider=provider)) as client:
        order_id = await new_order(client)
        headers = key()
        provider.lose_next_responses = 1
        first = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
        retry = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
    assert first.status_code == 504  # 5xx released the claim, so the retry ran again
    assert retry.status_code == 200 and not was_replayed(retry)
    assert len(provider.succeeded) == charges
    assert {c.idempotency_key for c in provider.ledger} == {f"pay:{order_id}:1"}  # the order's reference


async def test_the_same_key_with_another_amount_is_422_and_charges_nothing(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    headers = key()
    ok = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=headers)
    other = await client.post(f"/orders/{order_id}/pay", json={"amount": 9900}, headers=headers)
    assert ok.status_code == 200
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert other.json()["type"] == PROBLEM + "fingerprint-mismatch"
    assert len(provider.ledger) == 1


async def test_a_wrong_amount_is_refused_before_the_provider(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    r = await client.post(f"/orders/{order_id}/pay", json={"amount": 2499}, headers=key())
    assert r.status_code == 400 and r.json()["type"].endswith(":amount-mismatch")
    assert provider.ledger == []


async def test_a_declined_card_fails_the_order_and_a_new_attempt_pays_it(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    headers = key()
    body = {"amount": 2500, "payment_method": DECLINED_CARD}
    declined = await client.post(f"/orders/{order_id}/pay", json=body, headers=headers)
    again = await client.post(f"/orders/{order_id}/pay", json=body, headers=headers)
    assert declined.status_code == 402 and declined.json()["order"]["state"] == "failed"
    assert was_replayed(again) and again.content == declined.content  # a retry is not a new attempt
    paid = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())  # a new intent
    assert paid.status_code == 200 and paid.json()["order"]["state"] == "paid"
    assert [c.status for c in provider.ledger] == ["failed", "succeeded"]


async def test_two_tabs_paying_one_order_with_different_keys_charge_once(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    a, b = await asyncio.gather(
        *(client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key()) for _ in range(2))
    )
    assert sorted([a.status_code, b.status_code]) == [200, 409]
    assert len(provider.ledger) == 1


async def test_a_second_tab_after_a_provider_timeout_never_charges_the_order_twice(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    provider.lose_next_responses = 1  # tab 1's charge lands, its answer is lost
    tab1 = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())
    assert tab1.status_code == 504 and (await get_order(client, order_id))["state"] == "paying"
    tab2 = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())  # another key
    assert tab2.status_code == 200 and tab2.json()["order"]["state"] == "paid"
    assert len(provider.succeeded) == 1  # tab 2 asked the provider about tab 1's attempt: no second charge


async def test_a_cancel_during_a_payment_in_flight_never_strands_the_money(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    provider.lose_next_responses = 1
    assert (await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())).status_code == 504
    provider.lose_next_responses = 1  # the provider does not answer the cancel's question either
    busy = await client.post(f"/orders/{order_id}/cancel", headers=key())
    assert busy.status_code == 503 and busy.json()["type"].endswith(":payment-in-flight")
    cancel = await client.post(f"/orders/{order_id}/cancel", headers=key())
    assert cancel.status_code == 409 and cancel.json()["type"].endswith(":order-not-cancellable")
    order = await get_order(client, order_id)
    assert order["state"] == "paid" and order["charge_id"] == provider.succeeded[0].id  # not cancelled over it


async def test_a_cancel_after_a_charge_that_never_arrived_cancels(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id = await new_order(client)
    provider.drop_next_requests = 1  # the charge never reaches the provider
    assert (await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())).status_code == 504
    cancel = await client.post(f"/orders/{order_id}/cancel", headers=key())
    assert cancel.status_code == 200 and cancel.json()["state"] == "cancelled"
    assert provider.ledger == []


async def test_the_webhook_resolves_a_payment_in_flight(client: httpx.AsyncClient, provider: HonestProvider) -> None:
    order_id = await new_order(client)
    provider.lose_next_responses = 1
    assert (await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())).status_code == 504
    delivery = provider.charge_webhook(provider.succeeded[0])
    answer = await client.post("/webhooks/provider", content=delivery.body, headers=delivery.headers)
    assert answer.status_code == 200 and answer.json()["applied"] is True
    assert (await get_order(client, order_id))["state"] == "paid"


async def test_a_cancelled_order_cannot_be_paid(client: httpx.AsyncClient, provider: HonestProvider) -> None:
    order_id = await new_order(client)
    cancelled = await client.post(f"/orders/{order_id}/cancel", headers=key())
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    r = await client.post(f"/orders/{order_id}/pay", json={"amount": 2500}, headers=key())
    assert r.status_code == 409 and r.json()["type"].endswith(":order-not-payable")
    assert provider.ledger == []


async def test_keys_are_required_and_scoped_per_merchant(client: httpx.AsyncClient) -> None:
    missing = await client.post("/orders", json={"amount": 100}, headers=MERCHANT)
    assert missing.status_code == 400 and missing.json()["type"] == PROBLEM + "key-required"
    shared = {"Idempotency-Key": "order-1"}
    a = await client.post("/orders", json={"amount": 100}, headers={"X-Merchant-Id": "m_a", **shared})
    b = await client.post("/orders", json={"amount": 100}, headers={"X-Merchant-Id": "m_b", **shared})
    assert a.status_code == b.status_code == 201
    assert not was_replayed(b) and a.json()["id"] != b.json()["id"]  # one key, two merchants: two orders
    foreign = await client.get(f"/orders/{a.json()['id']}", headers={"X-Merchant-Id": "m_b"})
    assert foreign.status_code == 404


# --- refunds ------------------------------------------------------------------------------------


async def test_partial_refunds_then_full(client: httpx.AsyncClient, provider: HonestProvider) -> None:
    order_id, charge_id = await paid_order(client, 2500)
    url = f"/orders/{order_id}/refunds"

    first_key = key()
    first = await client.post(url, json={"amount": 1000}, headers=first_key)
    assert first.status_code == 201
    assert first.json()["order"]["state"] == "partially_refunded" and first.json()["order"]["refunded"] == 1000
    retry = await client.post(url, json={"amount": 1000}, headers=first_key)
    assert was_replayed(retry) and retry.content == first.content

    second = await client.post(url, json={"amount": 1000}, headers=key())  # a new intent: a second refund
    assert second.json()["order"]["state"] == "partially_refunded" and second.json()["order"]["refunded"] == 2000
    too_much = await client.post(url, json={"amount": 501}, headers=key())
    assert too_much.status_code == 400 and too_much.json()["type"].endswith(":refund-too-large")
    rest = await client.post(url, json={"amount": 500}, headers=key())
    assert rest.json()["order"]["state"] == "refunded" and rest.json()["order"]["refunded"] == 2500
    after = await client.post(url, json={"amount": 1}, headers=key())
    assert after.status_code == 409 and after.json()["type"].endswith(":order-not-refundable")

    refunds = [(r.charge_id, r.amount) for r in provider.refunds]
    assert refunds == [(charge_id, 1000), (charge_id, 1000), (charge_id, 500)]
    history = (await get_order(client, order_id))["history"]
    assert [line.split(" (")[0] for line in history] == [
        "pending -> paying",
        "paying -> paid",
        "paid -> partially_refunded",
        "partially_refunded -> partially_refunded",
        "partially_refunded -> refunded",
    ]


async def test_an_unpaid_order_cannot_be_refunded(client: httpx.AsyncClient, provider: HonestProvider) -> None:
    order_id = await new_order(client)
    r = await client.post(f"/orders/{order_id}/refunds", json={"amount": 100}, headers=key())
    assert r.status_code == 409 and provider.refunds == []


# --- the state machine -------------------------------------------------------------------------

ALL_MOVES = list(itertools.product(OrderState, OrderState))
LEGAL = {
    (OrderState.PENDING, OrderState.PAYING),
    (OrderState.PENDING, OrderState.PAID),
    (OrderState.PENDING, OrderState.FAILED),
    (OrderState.PENDING, OrderState.CANCELLED),
    (OrderState.PAYING, OrderState.PAID),
    (OrderState.PAYING, OrderState.FAILED),
    (OrderState.PAYING, OrderState.PENDING),
    (OrderState.FAILED, OrderState.PAYING),
    (OrderState.FAILED, OrderState.CANCELLED),
    (OrderState.PAID, OrderState.REFUNDED),
    (OrderState.PAID, OrderState.PARTIALLY_REFUNDED),
    (OrderState.PARTIALLY_REFUNDED, OrderState.REFUNDED),
    (OrderState.PARTIALLY_REFUNDED, OrderState.PARTIALLY_REFUNDED),
    (OrderState.FAILED, OrderState.PAID),
}


def test_the_transition_table_is_exactly_the_documented_one() -> None:
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL
    assert TRANSITIONS[OrderState.REFUNDED] == frozenset()


@pytest.mark.parametrize(("current", "target"), ALL_MOVES, ids=[f"{a.value}->{b.value}" for a, b in ALL_MOVES])
def test_every_transition(current: OrderState, target: OrderState, caplog: pytest.LogCaptureFixture) -> None:
    order = Order(id="ord_1", merchant_id="m", amount=100, currency="EUR", state=current)
    with caplog.at_level(logging.WARNING, logger="examples.payments.orders"):
        moved = transition(order, target, "test")
    if (current, target) in LEGAL:
        assert moved.state is target
        assert moved.history == (f"{current.value} -> {target.value} (test)",)
        assert caplog.records == []
    else:
        assert moved is order and moved.state is current
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert f"illegal transition {current.value} -> {target.value}" in caplog.records[0].getMessage()


def test_a_refund_is_applied_once_per_refund_id(caplog: pytest.LogCaptureFixture) -> None:
    order = Order(id="ord_1", merchant_id="m", amount=100, currency="EUR", state=OrderState.PAID, charge_id="ch_1")
    once = apply_refund(order, "re_1", 40)
    assert (once.state, once.refunded) == (OrderState.PARTIALLY_REFUNDED, 40)
    assert apply_refund(once, "re_1", 40) is once
    with caplog.at_level(logging.WARNING, logger="examples.payments.orders"):
        assert apply_refund(once, "re_2", 61) is once  # more than is left: logged, ignored
    assert len(caplog.records) == 1
    assert apply_refund(once, "re_2", 60).state is OrderState.REFUNDED


# --- webhooks -----------------------------------------------------------------------------------


async def deliver(client: httpx.AsyncClient, delivery: WebhookDelivery, times: int) -> list[httpx.Response]:
    """The provider POSTs one event `times` times, one after the other (its redelivery after a lost 2xx)."""
    post = client.post
    return [await post("/webhooks/provider", content=delivery.body, headers=delivery.headers) for _ in range(times)]


async def test_a_webhook_redelivered_three_times_is_applied_once(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id, charge_id = await paid_order(client, 2500)
    made = await provider.refund(charge_id=charge_id, amount=700, reference=order_id, idempotency_key=None)
    delivery = provider.refund_webhook(made)
    answers = await deliver(client, delivery, 3)
    assert [r.status_code for r in answers] == [200, 200, 200]
    assert len({r.content for r in answers}) == 1
    assert [was_replayed(r) for r in answers] == [False, True, True]
    assert answers[0].json()["applied"] is True
    order = await get_order(client, order_id)
    assert (order["state"], order["refunded"], order["refund_ids"]) == ("partially_refunded", 700, [made.id])


async def test_concurrent_redeliveries_apply_once(client: httpx.AsyncClient, provider: HonestProvider) -> None:
    order_id = await new_order(client)
    charge = await provider.charge(
        amount=2500, currency="EUR", payment_method="pm_card_visa", reference=order_id, idempotency_key=None
    )
    delivery = provider.charge_webhook(charge)
    answers = await asyncio.gather(
        *(client.post("/webhooks/provider", content=delivery.body, headers=delivery.headers) for _ in range(20))
    )
    ok = [r for r in answers if r.status_code == 200]
    assert {r.status_code for r in answers} <= {200, 409} and len({r.content for r in ok}) == 1
    order = await get_order(client, order_id)
    assert order["state"] == "paid" and order["attempts"] == [charge.id]


async def test_webhooks_echoing_our_own_charge_and_refund_change_nothing(
    client: httpx.AsyncClient, provider: HonestProvider, caplog: pytest.LogCaptureFixture
) -> None:
    order_id, _ = await paid_order(client)
    refunded = await client.post(f"/orders/{order_id}/refunds", json={"amount": 300}, headers=key())
    before = await get_order(client, order_id)
    # New event ids (so the middleware runs them), about a charge and a refund the service already applied.
    echoes = [provider.charge_webhook(provider.ledger[-1]), provider.refund_webhook(provider.refunds[-1])]
    with caplog.at_level(logging.WARNING):
        answers = [await client.post("/webhooks/provider", content=d.body, headers=d.headers) for d in echoes]
    assert refunded.status_code == 201
    assert [(r.status_code, r.json()["applied"]) for r in answers] == [(200, False), (200, False)]
    assert await get_order(client, order_id) == before
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # other loggers may be at INFO


async def test_a_late_failure_webhook_is_an_illegal_transition_logged_and_ignored(
    client: httpx.AsyncClient, provider: HonestProvider, caplog: pytest.LogCaptureFixture
) -> None:
    order_id, _ = await paid_order(client)
    before = await get_order(client, order_id)
    late = provider.webhook("charge.failed", order_id=order_id, charge_id="ch_old", reason="expired_card")
    with caplog.at_level(logging.WARNING, logger="examples.payments.orders"):
        r = await client.post("/webhooks/provider", content=late.body, headers=late.headers)
    assert r.status_code == 200 and r.json()["applied"] is False  # 2xx: the provider must stop redelivering
    assert await get_order(client, order_id) == before
    assert any("illegal transition paid -> failed" in rec.getMessage() for rec in caplog.records)


async def test_a_forged_webhook_is_refused_and_does_not_block_the_real_one(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    order_id, charge_id = await paid_order(client)
    made = await provider.refund(charge_id=charge_id, amount=100, reference=order_id, idempotency_key=None)
    real = provider.refund_webhook(made)
    forged = await client.post(
        "/webhooks/provider", content=real.body, headers={**real.headers, "Webhook-Signature": "sha256=00"}
    )
    assert forged.status_code == 401
    genuine = await client.post("/webhooks/provider", content=real.body, headers=real.headers)
    assert genuine.status_code == 200 and not was_replayed(genuine) and genuine.json()["applied"] is True


async def test_a_webhook_for_an_unknown_order_is_not_stored(
    client: httpx.AsyncClient, provider: HonestProvider
) -> None:
    delivery = provider.webhook("charge.succeeded", order_id="ord_nope", charge_id="ch_1", amount=1)
    answers = await deliver(client, delivery, 2)
    assert [r.status_code for r in answers] == [404, 404]
    assert not any(was_replayed(r) for r in answers)  # released: a redelivery runs again


async def test_a_webhook_needs_its_id(client: httpx.AsyncClient, provider: HonestProvider) -> None:
    delivery = provider.webhook("charge.succeeded", order_id="ord_x", charge_id="ch_1", amount=1)
    headers = {k: v for k, v in delivery.headers.items() if k != "Webhook-Id"}
    r = await client.post("/webhooks/provider", content=delivery.body, headers=headers)
    # The signature covers the id, so without it the delivery is refused before the store is touched.
    assert r.status_code == 400 and r.json()["type"] == PROBLEM + "signature-malformed"


# --- OpenAPI and the selftest ---------------------------------------------------------------------


async def test_openapi_documents_the_key_on_protected_operations_only(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    pay = schema["paths"]["/orders/{order_id}/pay"]["post"]
    param = next(p for p in pay["parameters"] if p["name"] == "Idempotency-Key")
    assert param["in"] == "header" and param["required"] is True
    assert "Idempotent-Replayed" in pay["responses"]["200"]["headers"]
    assert {"400", "409", "422", "503"} <= set(pay["responses"])
    webhook = schema["paths"]["/webhooks/provider"]["post"]
    assert any(p["name"] == "Webhook-Id" and p["required"] for p in webhook["parameters"])
    read = schema["paths"]["/orders/{order_id}"]["get"]
    assert all(p["name"] != "Idempotency-Key" for p in read["parameters"])


async def test_the_selftest_passes(capsys: pytest.CaptureFixture[str]) -> None:
    from examples.payments.selftest import run

    assert await run() == 0
    out = capsys.readouterr().out
    assert "RESULT OK" in out
    assert "tab 2                   200, order paid" in out and "(the money is not stranded)" in out
