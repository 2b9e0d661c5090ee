"""How a handler learns the idempotency key (to forward it to its payment provider)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Final

STATE_KEY: Final = "idempotency"
"""Name under which `IdempotencyInfo` is put in `scope["state"]` (Starlette: `request.state.idempotency`)."""


@dataclass(frozen=True, slots=True)
class IdempotencyInfo:
    """The key and scope of the request being run, as the middleware saw them."""

    key: str
    """The client's idempotency key, unquoted."""
    scope: str | None
    """Whom the key belongs to (the scope callable's answer), or None when unscoped."""


_current: ContextVar[IdempotencyInfo | None] = ContextVar("idem_asgi_current", default=None)


def current_idempotency() -> IdempotencyInfo | None:
    """The key and scope of the protected request running in this context, else None."""
    return _current.get()
