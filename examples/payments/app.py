"""A small payments service on FastAPI, protected by `IdempotencyMiddleware`.

    POST /orders                      create an order              (Idempotency-Key required)
    POST /orders/{order_id}/pay       charge it                    (Idempotency-Key required)
    POST /orders/{order_id}/refunds   refund part or all of it     (Idempotency-Key required)
    POST /orders/{order_id}/cancel    cancel an unpaid order       (Idempotency-Key required)
    GET  /orders/{order_id}           read it
    POST /webhooks/provider           the card provider's events   (Webhook-Id required)

Three layers keep money from moving twice:
1. the middleware: a retried request (same key) runs once; every repeat gets the first answer;
2. the provider call: the service forwards the order's reference for this payment attempt
   (`pay:<order>:<attempt>`) as the provider's idempotency key, and marks the effect
   (`mark_effect()`) once the provider answered, so a failure after that is never run again;
3. the order: one lock per order and a state machine (`orders.py`). Before the provider is called
   the order is `paying`; a provider timeout leaves it so (504, which releases the claim). Anything
   that finds it `paying` (the client's retry, a second tab with another key, a cancel) first asks
   the provider by that reference: the charge that landed is applied, never made again, and the
   money is never stranded by a cancel. The webhook resolves it too.

Orders live in process memory (`OrderStore`): swap it for your database, and the per-order lock
for a row lock (`SELECT ... FOR UPDATE`) or a conditional `UPDATE ... WHERE state = 'pending'`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from idem_asgi import (
    IdempotencyInfo,
    IdempotencyMiddleware,
    RoutePolicy,
    SignatureMiddleware,
    add_openapi,
    backend_from_url,
    scope_from_header,
)
from idem_asgi.http.policy import TRANSIENT_STATUSES
from idem_asgi.http.signatures import Headers, SignatureInvalid, SignatureMalformed

from .orders import (
    Order,
    OrderState,
    apply_refund,
    can_transition,
    mark_cancelled,
    mark_failed,
    mark_not_charged,
    mark_paid,
    payment_key,
    start_payment,
)
from .provider import (
    DEMO_WEBHOOK_SECRET,
    Charge,
    HonestProvider,
    Provider,
    ProviderError,
    ProviderTimeout,
    webhook_signature,
)

logger = logging.getLogger(__name__)

PAY_PATH = "/orders/{order_id}/pay"
WEBHOOK_PATH = "/webhooks/provider"

merchant_scope = scope_from_header("x-merchant-id")
"""Whose key is it: the merchant. Here a header a trusted gateway sets; behind your own auth
middleware use `scope_from_state("merchant_id")` instead. Never a token that can be refreshed."""


def merchant_route(path: str) -> RoutePolicy:
    """A merchant's POST: the key is required, and belongs to the merchant."""
    return RoutePolicy(path, methods=["POST"], required=True, scope=merchant_scope)


def policies() -> list[RoutePolicy]:
    """The protected routes. Everything else (GET /orders/..., /docs) passes through untouched."""
    return [
        merchant_route("/orders"),
        merchant_route(PAY_PATH),
        merchant_route("/orders/{order_id}/refunds"),
        merchant_route("/orders/{order_id}/cancel"),
        RoutePolicy(
            WEBHOOK_PATH,
            methods=["POST"],
            header="Webhook-Id",  # the provider's event id: the same on every redelivery of one event
            required=True,
            single_tenant=True,  # event ids are the provider's, not a merchant's
            ttl=timedelta(days=7),  # longer than the provider's redelivery window (often 3 days)
            # An event about an order we do not know yet (404) must not be stored: a later redelivery
            # has to run. (A forged delivery never gets here: ProviderScheme refuses it first.)
            release_statuses=TRANSIENT_STATUSES | {404},
            # The fingerprint is the body alone (the default): a redelivery may come re-signed, and must
            # still be a replay, never a 422.
        ),
    ]


class ProviderScheme:
    """The provider's webhook signature, `sha256=<hex>` over `<webhook id>.<body>`, for `SignatureMiddleware`.

    It signs the event id as well as the body, so the id (the idempotency key of the webhook route)
    cannot be swapped on a captured delivery.
    """

    signed_headers = frozenset({"webhook-id"})

    def verify(self, headers: Headers, body: bytes, secrets: Sequence[bytes]) -> None:
        """Raise SignatureMalformed or SignatureInvalid unless one secret signed id and body."""
        found = dict(headers)
        webhook_id, signature = found.get(b"webhook-id"), found.get(b"webhook-signature")
        if not webhook_id or not signature:
            raise SignatureMalformed("Webhook-Id and Webhook-Signature are required.")
        expected = [webhook_signature(s.decode(), webhook_id.decode("latin-1"), body).encode() for s in secrets]
        if not any(hmac.compare_digest(signature, e) for e in expected):
            raise SignatureInvalid("The webhook signature does not match.")


# ---------------------------------------------------------------------------------------------
# storage


class OrderStore:
    """Orders in process memory, with one lock per order (stand-in for your database)."""

    def __init__(self) -> None:
        self._orders: dict[str, Order] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def lock(self, order_id: str) -> asyncio.Lock:
        """Held while an order is read, sent to the provider and written back."""
        return self._locks[order_id]

    def get(self, order_id: str, merchant_id: str | None = None) -> Order | None:
        """The order, if it exists (and belongs to `merchant_id` when given)."""
        order = self._orders.get(order_id)
        if order is None or (merchant_id is not None and order.merchant_id != merchant_id):
            return None
        return order

    def put(self, order: Order) -> None:
        self._orders[order.id] = order


# ---------------------------------------------------------------------------------------------
# request bodies and answers


class NewOrder(BaseModel):
    amount: int = Field(gt=0, description="Minor units (cents).")
    currency: str = Field(default="EUR", pattern="^[A-Z]{3}$")


class Payment(BaseModel):
    amount: int = Field(gt=0, description="The amount the customer confirmed; must equal the order's.")
    payment_method: str = Field(default="pm_card_visa", description="`pm_card_declined` is always declined.")


class NewRefund(BaseModel):
    amount: int = Field(gt=0, description="Minor units; less than what is left makes a partial refund.")


class WebhookData(BaseModel):
    order_id: str
    charge_id: str
    amount: int | None = None
    refund_id: str | None = None
    reason: str | None = None


class WebhookEvent(BaseModel):
    id: str
    type: Literal["charge.succeeded", "charge.failed", "charge.refunded"]
    data: WebhookData


def problem(status: int, slug: str, detail: str) -> JSONResponse:
    """An RFC 9457 answer, like the middleware's own refusals."""
    body = {"type": f"urn:payments-example:problem:{slug}", "title": slug.replace("-", " "), "status": status}
    return JSONResponse({**body, "detail": detail}, status_code=status, media_type="application/problem+json")


def idempotency(request: Request) -> IdempotencyInfo | None:
    """The key (and scope) the middleware claimed for this request; None on an unprotected route."""
    info: IdempotencyInfo | None = getattr(request.state, "idempotency", None)
    return info


def provider_key(operation: str, order_id: str, info: IdempotencyInfo | None) -> str | None:
    """The idempotency key sent to the provider: the client's key, bound to this operation and order.

    One client key always gives one provider key, so when the service retries a provider call (or a
    client retry re-runs a request whose first attempt failed with 5xx), the provider returns the
    charge it already made instead of making a second one.
    """
    return None if info is None else f"{operation}:{order_id}:{info.key}"


Merchant = Annotated[str, Header(alias="X-Merchant-Id", description="The merchant making the call.")]
Idempotency = Annotated[IdempotencyInfo | None, Depends(idempotency)]


# ---------------------------------------------------------------------------------------------
# the app


def create_app(
    backend_url: str = "memory://",
    provider: Provider | None = None,
    *,
    routes: Sequence[RoutePolicy] | None = None,
    webhook_secret: str | Sequence[str] = DEMO_WEBHOOK_SECRET,
) -> FastAPI:
    """The payments service.

    Args:
        backend_url: The idempotency store: `memory://`, `redis://...` or `postgresql://...`.
        provider: The card provider; defaults to an `HonestProvider`.
        routes: The protected routes; defaults to `policies()`. Pass fewer to see what breaks.
        webhook_secret: The secret the provider signs webhooks with (several during a rotation).
    """
    provider = provider if provider is not None else HonestProvider()
    store = OrderStore()
    backend = backend_from_url(backend_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await backend.aclose()

    app = FastAPI(title="idem_asgi payments example", lifespan=lifespan)
    app.state.provider = provider
    app.state.orders = store
    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend,
        routes=list(policies() if routes is None else routes),  # strict: a route without a scope refuses to start
    )
    # Added last, so it runs first: a forged delivery is refused (401) before it reaches the store.
    secrets = [webhook_secret] if isinstance(webhook_secret, str) else list(webhook_secret)
    app.add_middleware(SignatureMiddleware, paths=[WEBHOOK_PATH], scheme=ProviderScheme(), secrets=secrets)

    @app.post("/orders", status_code=201)
    async def create_order(new: NewOrder, merchant: Merchant) -> JSONResponse:
        order = Order(id=f"ord_{uuid.uuid4().hex[:16]}", merchant_id=merchant, amount=new.amount, currency=new.currency)
        store.put(order)
        return JSONResponse(order.as_json(), status_code=201)

    @app.get("/orders/{order_id}")
    async def get_order(order_id: str, merchant: Merchant) -> JSONResponse:
        order = store.get(order_id, merchant)
        if order is None:
            return problem(404, "order-not-found", f"No order {order_id!r}.")
        return JSONResponse(order.as_json())

    async def ask_provider(order: Order) -> Order:
        """The order `paying`: ask the provider about that attempt, and apply what it says."""
        found = await provider.find_charge(idempotency_key=payment_key(order))  # may raise ProviderTimeout
        order = mark_not_charged(order) if found is None else settle(order, found)
        store.put(order)
        return order

    @app.post(PAY_PATH)
    async def pay(order_id: str, payment: Payment, merchant: Merchant, info: Idempotency) -> JSONResponse:
        async with store.lock(order_id):  # two different keys (two tabs) for one order: one at a time
            order = store.get(order_id, merchant)
            if order is None:
                return problem(404, "order-not-found", f"No order {order_id!r}.")
            if payment.amount != order.amount:
                return problem(400, "amount-mismatch", f"The order is for {order.amount}, not {payment.amount}.")
            if order.state is OrderState.PAYING:
                # An earlier attempt (this key or another tab's) got no answer: ask before charging again.
                try:
                    order = await ask_provider(order)
                except ProviderTimeout:
                    return problem(503, "payment-in-flight", "The provider has not answered yet; retry shortly.")
                if order.state is not OrderState.PENDING:
                    return charged(order, None)
            if not can_transition(order.state, OrderState.PAYING):
                return problem(409, "order-not-payable", f"The order is {order.state.value}; it cannot be paid.")
            order = start_payment(order)
            store.put(order)  # paying: held until the provider's answer is known
            try:
                charge = await provider.charge(
                    amount=order.amount,
                    currency=order.currency,
                    payment_method=payment.payment_method,
                    reference=order.id,
                    idempotency_key=payment_key(order),
                )
            except ProviderTimeout:
                # Maybe charged, maybe not: the order stays `paying`. A 5xx releases the middleware's claim,
                # so the client's retry runs this again and asks the provider by the attempt's key first.
                return problem(504, "provider-timeout", "The card provider did not answer; retry with the same key.")
            except ProviderError as exc:
                store.put(mark_not_charged(order))
                return problem(502, "provider-error", str(exc))
            # Money may have moved: from here on a failure (say, the order write below raising) must
            # not release the claim for a retry to charge again; the record ends outcome-unknown.
            if info is not None:
                info.mark_effect()
            order = settle(order, charge)
            store.put(order)
        return charged(order, charge)

    @app.post("/orders/{order_id}/refunds", status_code=201)
    async def refund(order_id: str, new: NewRefund, merchant: Merchant, info: Idempotency) -> JSONResponse:
        async with store.lock(order_id):
            order = store.get(order_id, merchant)
            if order is None:
                return problem(404, "order-not-found", f"No order {order_id!r}.")
            if order.charge_id is None or order.refundable == 0:
                return problem(409, "order-not-refundable", f"The order is {order.state.value}; nothing to refund.")
            if new.amount > order.refundable:
                return problem(400, "refund-too-large", f"Only {order.refundable} is left to refund.")
            try:
                made = await provider.refund(
                    charge_id=order.charge_id,
                    amount=new.amount,
                    reference=order.id,
                    idempotency_key=provider_key("refund", order.id, info),
                )
            except ProviderTimeout:
                return problem(504, "provider-timeout", "The card provider did not answer; retry with the same key.")
            except ProviderError as exc:
                return problem(502, "provider-error", str(exc))
            if info is not None:
                info.mark_effect()  # the refund went out: never run again because of a later failure
            order = apply_refund(order, made.id, made.amount)
            store.put(order)
        return JSONResponse({"order": order.as_json(), "refund": asdict(made)}, status_code=201)

    @app.post("/orders/{order_id}/cancel")
    async def cancel(order_id: str, merchant: Merchant) -> JSONResponse:
        async with store.lock(order_id):
            order = store.get(order_id, merchant)
            if order is None:
                return problem(404, "order-not-found", f"No order {order_id!r}.")
            if order.state is OrderState.PAYING:  # a charge may have landed: never cancel over the money
                try:
                    order = await ask_provider(order)
                except ProviderTimeout:
                    return problem(503, "payment-in-flight", "The provider has not answered yet; retry shortly.")
            cancelled = mark_cancelled(order)
            if cancelled is order:
                detail = f"The order is {order.state.value}; it cannot be cancelled."
                return problem(409, "order-not-cancellable", detail)
            store.put(cancelled)
        return JSONResponse(cancelled.as_json())

    @app.post(WEBHOOK_PATH)
    async def provider_webhook(request: Request) -> JSONResponse:
        # Signed (SignatureMiddleware) and claimed by its Webhook-Id (IdempotencyMiddleware) already.
        body = await request.body()
        try:
            event = WebhookEvent.model_validate_json(body)
        except ValidationError as exc:
            return problem(400, "bad-event", str(exc.errors()[0]["msg"]))
        data = event.data
        async with store.lock(data.order_id):
            order = store.get(data.order_id)
            if order is None:  # maybe not written yet: 404 releases the claim, so a redelivery runs again
                return problem(404, "order-not-found", f"No order {data.order_id!r}.")
            updated = apply_event(order, event)
            store.put(updated)
        answer: dict[str, Any] = {
            "event": event.id,
            "type": event.type,
            "applied": updated is not order,
            "order": {"id": updated.id, "state": updated.state.value, "refunded": updated.refunded},
        }
        return JSONResponse(answer)  # 2xx even when ignored: the provider must not redeliver it

    add_openapi(app)
    return app


def settle(order: Order, charge: Charge) -> Order:
    """The order after the provider's answer about a charge (succeeded or declined)."""
    if charge.status == "succeeded":
        return mark_paid(order, charge.id)
    return mark_failed(order, charge.id, charge.failure_reason or "failed")


def charged(order: Order, charge: Charge | None) -> JSONResponse:
    """The answer to a payment: 200 paid, 402 declined (an answer too: stored and replayed)."""
    status = 402 if order.state is OrderState.FAILED else 200
    charge_json = None if charge is None else asdict(charge)
    if charge is None and order.charge_id is not None:
        charge_json = {"id": order.charge_id, "status": "succeeded"}
    return JSONResponse({"order": order.as_json(), "charge": charge_json}, status_code=status)


def apply_event(order: Order, event: WebhookEvent) -> Order:
    """The order after a provider event; unchanged if the event was already applied or is an illegal move.

    The middleware makes a redelivery of one event (same Webhook-Id) a replay. These checks are for
    *different* events about something already known, e.g. the webhook echoing a charge or refund the
    service made itself and already applied from the provider's synchronous answer.
    """
    data = event.data
    if event.type == "charge.refunded":
        if data.refund_id is None or data.amount is None or data.charge_id != order.charge_id:
            logger.warning("order %s: event %s ignored: not a refund of the order's charge", order.id, event.id)
            return order
        return apply_refund(order, data.refund_id, data.amount)
    if data.charge_id in order.attempts:
        return order
    if event.type == "charge.succeeded":
        return mark_paid(order, data.charge_id)
    return mark_failed(order, data.charge_id, data.reason or "failed")
