"""Job functions whose annotations are strings (`from __future__ import annotations`) naming a type
imported only for the type checker, for tests/test_job_lifecycle.py: a parameter's may stay
unresolved (only the return annotation is needed to store the result); a return annotation cannot."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decimal import Decimal


async def charge(order_id: str, amount: Decimal) -> str:
    """Its parameter's type exists only for the type checker; its return type is a builtin."""
    return f"charged {order_id} {amount}"


async def quote(order_id: str) -> list[Decimal]:
    """Its return type exists only for the type checker: no repeat could decode its result."""
    return []
