"""The order state machine: a transition table, and pure functions that move an order along it.

    pending ──> paying | paid | failed | cancelled
    paying ──> paid | failed | pending    (payment in flight: held until the provider answers, or is
                                           asked by the attempt's key and knows nothing of it)
    failed ──> paying | paid | cancelled  (a new payment attempt)
    paid ──> refunded | partially_refunded
    partially_refunded ──> partially_refunded | refunded
    refunded, cancelled: final

An illegal transition (a late `charge.failed` for an order already paid, a refund of a cancelled
order, ...) is logged with `logging.warning` and ignored: the order comes back unchanged. Orders
are immutable; every function returns the order to store. No I/O, no framework.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType
from typing import Any, Final

logger = logging.getLogger(__name__)


class OrderState(str, Enum):
    """Where an order is in its life."""

    PENDING = "pending"
    PAYING = "paying"
    """A charge was sent and its outcome is not known yet (the provider timed out): no other payment
    and no cancel until the provider is asked about this attempt."""
    PAID = "paid"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PARTIALLY_REFUNDED = "partially_refunded"
    REFUNDED = "refunded"


S = OrderState
TRANSITIONS: Final[Mapping[OrderState, frozenset[OrderState]]] = MappingProxyType(
    {
        S.PENDING: frozenset({S.PAYING, S.PAID, S.FAILED, S.CANCELLED}),
        S.PAYING: frozenset({S.PAID, S.FAILED, S.PENDING}),
        S.FAILED: frozenset({S.PAYING, S.PAID, S.CANCELLED}),
        S.PAID: frozenset({S.REFUNDED, S.PARTIALLY_REFUNDED}),
        S.PARTIALLY_REFUNDED: frozenset({S.PARTIALLY_REFUNDED, S.REFUNDED}),
        S.REFUNDED: frozenset(),
        S.CANCELLED: frozenset(),
    }
)
"""Every legal move; anything not listed is illegal."""


@dataclass(frozen=True, slots=True)
class Order:
    """An order of one merchant, in minor units (cents) of one currency."""

    id: str
    merchant_id: str
    amount: int
    currency: str
    state: OrderState = OrderState.PENDING
    charge_id: str | None = None
    """The charge that paid the order."""
    attempts: tuple[str, ...] = ()
    """Every charge applied to the order, declined ones included (so a webhook can tell it was seen)."""
    attempt: int = 0
    """The current payment attempt (1, 2, ...): the provider's idempotency key is `pay:<order>:<attempt>`,
    so every tab and every retry of one attempt is one charge at the provider."""
    refunded: int = 0
    refund_ids: tuple[str, ...] = ()
    history: tuple[str, ...] = ()
    """One line per applied transition, e.g. `pending -> paid (charge ch_123)`."""

    @property
    def refundable(self) -> int:
        """What can still be refunded: the paid amount minus refunds so far (0 unless paid)."""
        if self.state not in (OrderState.PAID, OrderState.PARTIALLY_REFUNDED):
            return 0
        return self.amount - self.refunded

    def as_json(self) -> dict[str, Any]:
        """The order as the API shows it."""
        return {
            "id": self.id,
            "amount": self.amount,
            "currency": self.currency,
            "state": self.state.value,
            "charge_id": self.charge_id,
            "attempts": list(self.attempts),
            "attempt": self.attempt,
            "refunded": self.refunded,
            "refund_ids": list(self.refund_ids),
            "history": list(self.history),
        }


def can_transition(current: OrderState, target: OrderState) -> bool:
    """Whether the table allows `current -> target`."""
    return target in TRANSITIONS[current]


def transition(order: Order, target: OrderState, reason: str) -> Order:
    """The order moved to `target`; or, if that move is illegal, the same order, with a warning logged."""
    if not can_transition(order.state, target):
        logger.warning(
            "order %s: illegal transition %s -> %s ignored (%s)", order.id, order.state.value, target.value, reason
        )
        return order
    line = f"{order.state.value} -> {target.value} ({reason})"
    return replace(order, state=target, history=(*order.history, line))


def payment_key(order: Order) -> str:
    """The provider's idempotency key for the order's current payment attempt (the order's reference)."""
    return f"pay:{order.id}:{order.attempt}"


def start_payment(order: Order) -> Order:
    """A new payment attempt begins: the order is `paying` until the provider's answer is known."""
    moved = transition(order, OrderState.PAYING, f"attempt {order.attempt + 1}")
    return order if moved is order else replace(moved, attempt=order.attempt + 1)


def mark_not_charged(order: Order) -> Order:
    """The provider, asked about the attempt in flight, has no charge for it: the order is payable again."""
    return transition(order, OrderState.PENDING, f"attempt {order.attempt} never reached the provider")


def mark_paid(order: Order, charge_id: str) -> Order:
    """A charge succeeded."""
    moved = transition(order, OrderState.PAID, f"charge {charge_id}")
    return order if moved is order else replace(moved, charge_id=charge_id, attempts=(*moved.attempts, charge_id))


def mark_failed(order: Order, charge_id: str, reason: str) -> Order:
    """A charge was declined or failed."""
    moved = transition(order, OrderState.FAILED, f"charge {charge_id}: {reason}")
    return order if moved is order else replace(moved, attempts=(*moved.attempts, charge_id))


def mark_cancelled(order: Order) -> Order:
    """The merchant cancelled an unpaid order."""
    return transition(order, OrderState.CANCELLED, "cancelled by merchant")


def apply_refund(order: Order, refund_id: str, amount: int) -> Order:
    """A refund of `amount` was made; a refund over what is left is logged and ignored like a bad move."""
    if refund_id in order.refund_ids:
        return order  # already applied (our own refund, echoed back by the provider's webhook)
    if not 0 < amount <= order.refundable:
        logger.warning(
            "order %s: refund %s of %d ignored (%d refundable in state %s)",
            order.id,
            refund_id,
            amount,
            order.refundable,
            order.state.value,
        )
        return order
    refunded = order.refunded + amount
    target = OrderState.REFUNDED if refunded == order.amount else OrderState.PARTIALLY_REFUNDED
    moved = transition(order, target, f"refund {refund_id} of {amount}")
    return order if moved is order else replace(moved, refunded=refunded, refund_ids=(*moved.refund_ids, refund_id))
