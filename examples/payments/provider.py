"""A fake card provider, in-process, with a ledger of every charge it really made.

Two flavours show why the service must forward its idempotency key downstream:

- `HonestProvider` honours idempotency keys like real card APIs do: the same key returns the same
  charge (or refund) and never moves money twice; the same key with other parameters is refused.
- `ForgetfulProvider` ignores keys: every call is a new charge.

Both can be told to lose their next answer(s) after doing the work (`lose_next_responses`), the
timeout-after-success that makes the service's own retry dangerous. They also build signed
webhook deliveries, the way the provider would POST them to the service.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, cast

T = TypeVar("T")

DEMO_WEBHOOK_SECRET = "whsec_demo"
"""The shared secret the fake provider signs webhooks with (a real one comes from your provider's dashboard)."""

DECLINED_CARD = "pm_card_declined"
"""A payment method the fake provider always declines (like a card network's test card)."""


class ProviderError(Exception):
    """The provider refused the call; nothing was charged."""


class IdempotencyKeyReused(ProviderError):
    """The key was already used with different parameters (real providers answer 400 or 409 here)."""


class ProviderTimeout(Exception):
    """The provider's answer never arrived. The work may or may not have happened: retry with the SAME key."""


@dataclass(frozen=True, slots=True)
class Charge:
    """One charge the provider processed (a declined card is processed too, but moves no money)."""

    id: str
    amount: int
    currency: str
    reference: str
    status: Literal["succeeded", "failed"]
    failure_reason: str | None
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class Refund:
    """One refund the provider made."""

    id: str
    charge_id: str
    amount: int
    reference: str
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class WebhookDelivery:
    """One HTTP delivery of a webhook event: redeliveries of an event carry the same id and body."""

    id: str
    body: bytes
    headers: dict[str, str]


def webhook_signature(secret: str, webhook_id: str, body: bytes) -> str:
    """`sha256=<hex>` HMAC over `<webhook id>.<body>`, so neither the id nor the body can be swapped."""
    mac = hmac.new(secret.encode(), webhook_id.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


class Provider(Protocol):
    """What the payments service needs from a card provider."""

    async def charge(
        self, *, amount: int, currency: str, payment_method: str, reference: str, idempotency_key: str | None
    ) -> Charge: ...

    async def refund(self, *, charge_id: str, amount: int, reference: str, idempotency_key: str | None) -> Refund: ...

    async def find_charge(self, *, idempotency_key: str) -> Charge | None: ...


class FakeProvider:
    """The part both fakes share: the ledgers, the latency, lost answers and webhook deliveries."""

    def __init__(self, *, latency: float = 0.01, webhook_secret: str = DEMO_WEBHOOK_SECRET) -> None:
        self.latency = latency
        self.webhook_secret = webhook_secret
        self.ledger: list[Charge] = []
        """Every charge the provider really processed, in order: the ground truth tests count."""
        self.refunds: list[Refund] = []
        """Every refund the provider really made."""
        self.lose_next_responses = 0
        """Do the next N calls' work, then raise `ProviderTimeout` instead of answering."""
        self.drop_next_requests = 0
        """Raise `ProviderTimeout` for the next N charges without doing anything (the request never arrived)."""

    async def charge(
        self, *, amount: int, currency: str, payment_method: str, reference: str, idempotency_key: str | None
    ) -> Charge:
        """Charge a payment method; `HonestProvider` and `ForgetfulProvider` differ in what the key does."""
        raise NotImplementedError

    async def refund(self, *, charge_id: str, amount: int, reference: str, idempotency_key: str | None) -> Refund:
        """Refund part or all of a succeeded charge."""
        raise NotImplementedError

    async def find_charge(self, *, idempotency_key: str) -> Charge | None:
        """The charge made under this idempotency key, if any (how a service asks about a timed-out call)."""
        await self._network()
        self._answer()
        return next((c for c in reversed(self.ledger) if c.idempotency_key == idempotency_key), None)

    def _arrived(self) -> None:
        """Called before the work: maybe the request never reached the provider."""
        if self.drop_next_requests > 0:
            self.drop_next_requests -= 1
            raise ProviderTimeout("the provider did not answer in time (the request never arrived)")

    @property
    def succeeded(self) -> list[Charge]:
        """The charges that moved money."""
        return [c for c in self.ledger if c.status == "succeeded"]

    async def _network(self) -> None:
        await asyncio.sleep(self.latency)

    def _answer(self) -> None:
        """Called after the work is done: maybe lose the answer on its way back."""
        if self.lose_next_responses > 0:
            self.lose_next_responses -= 1
            raise ProviderTimeout("the provider did not answer in time")

    async def _make_charge(
        self, amount: int, currency: str, payment_method: str, reference: str, key: str | None
    ) -> Charge:
        self._arrived()
        await self._network()
        declined = payment_method == DECLINED_CARD
        charge = Charge(
            id=f"ch_{uuid.uuid4().hex[:16]}",
            amount=amount,
            currency=currency,
            reference=reference,
            status="failed" if declined else "succeeded",
            failure_reason="card_declined" if declined else None,
            idempotency_key=key,
        )
        self.ledger.append(charge)
        return charge

    async def _make_refund(self, charge_id: str, amount: int, reference: str, key: str | None) -> Refund:
        await self._network()
        charge = next((c for c in self.succeeded if c.id == charge_id), None)
        if charge is None:
            raise ProviderError(f"no succeeded charge {charge_id!r}")
        refunded = sum(r.amount for r in self.refunds if r.charge_id == charge_id)
        if not 0 < amount <= charge.amount - refunded:
            raise ProviderError(f"cannot refund {amount} of charge {charge_id!r} ({charge.amount - refunded} left)")
        refund_id = f"re_{uuid.uuid4().hex[:16]}"
        refund = Refund(id=refund_id, charge_id=charge_id, amount=amount, reference=reference, idempotency_key=key)
        self.refunds.append(refund)
        return refund

    def webhook(self, event_type: str, **data: Any) -> WebhookDelivery:
        """A signed delivery of a new event; POST it as often as you like to simulate redelivery."""
        event_id = f"evt_{uuid.uuid4().hex[:16]}"
        body = json.dumps({"id": event_id, "type": event_type, "data": data}, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            "Webhook-Id": event_id,
            "Webhook-Signature": webhook_signature(self.webhook_secret, event_id, body),
        }
        return WebhookDelivery(id=event_id, body=body, headers=headers)

    def charge_webhook(self, charge: Charge) -> WebhookDelivery:
        """The `charge.succeeded` or `charge.failed` event the provider sends for a charge."""
        return self.webhook(
            f"charge.{charge.status}",
            order_id=charge.reference,
            charge_id=charge.id,
            amount=charge.amount,
            reason=charge.failure_reason,
        )

    def refund_webhook(self, refund: Refund) -> WebhookDelivery:
        """The `charge.refunded` event the provider sends for a refund (including ones made in its dashboard)."""
        return self.webhook(
            "charge.refunded",
            order_id=refund.reference,
            charge_id=refund.charge_id,
            refund_id=refund.id,
            amount=refund.amount,
        )


class HonestProvider(FakeProvider):
    """Honours idempotency keys: the same key returns the first result and never charges twice."""

    def __init__(self, *, latency: float = 0.01, webhook_secret: str = DEMO_WEBHOOK_SECRET) -> None:
        super().__init__(latency=latency, webhook_secret=webhook_secret)
        self._done: dict[str, tuple[tuple[object, ...], object]] = {}
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def charge(
        self, *, amount: int, currency: str, payment_method: str, reference: str, idempotency_key: str | None
    ) -> Charge:
        result = await self._once(
            idempotency_key,
            ("charge", amount, currency, payment_method, reference),
            lambda: self._make_charge(amount, currency, payment_method, reference, idempotency_key),
        )
        self._answer()
        return result

    async def refund(self, *, charge_id: str, amount: int, reference: str, idempotency_key: str | None) -> Refund:
        result = await self._once(
            idempotency_key,
            ("refund", charge_id, amount, reference),
            lambda: self._make_refund(charge_id, amount, reference, idempotency_key),
        )
        self._answer()
        return result

    async def _once(self, key: str | None, params: tuple[object, ...], make: Callable[[], Awaitable[T]]) -> T:
        """Run `make` once per key; later calls with that key get its result (or a refusal if params differ)."""
        if key is None:
            return await make()
        async with self._locks[key]:  # concurrent calls with one key wait for the first: one charge
            seen = self._done.get(key)
            if seen is not None:
                if seen[0] != params:
                    raise IdempotencyKeyReused(f"idempotency key {key!r} was used with different parameters")
                await self._network()
                return cast(T, seen[1])
            result = await make()  # a refusal (ProviderError) is not remembered: nothing happened
            self._done[key] = (params, result)
            return result


class ForgetfulProvider(FakeProvider):
    """Ignores idempotency keys: every call charges (or refunds) again. Do not build on a provider like this."""

    async def charge(
        self, *, amount: int, currency: str, payment_method: str, reference: str, idempotency_key: str | None
    ) -> Charge:
        result = await self._make_charge(amount, currency, payment_method, reference, idempotency_key)
        self._answer()
        return result

    async def refund(self, *, charge_id: str, amount: int, reference: str, idempotency_key: str | None) -> Refund:
        result = await self._make_refund(charge_id, amount, reference, idempotency_key)
        self._answer()
        return result
