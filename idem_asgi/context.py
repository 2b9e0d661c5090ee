"""How a handler learns the idempotency key (to forward it to its payment provider)."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Final

import msgspec

STATE_KEY: Final = "idempotency"
"""Name under which `IdempotencyInfo` is put in `scope["state"]` (Starlette: `request.state.idempotency`)."""


class IdempotencyInfo(msgspec.Struct, frozen=True, gc=False):
    """The key and scope of the request being run, as the middleware saw them.

    A frozen msgspec Struct (one is made per protected request: a frozen dataclass costs five
    times as much to build, since its `__init__` goes through `object.__setattr__`).
    """

    key: str
    """The client's idempotency key, unquoted."""
    scope: str | None
    """Whom the key belongs to (the scope callable's answer), or None when unscoped."""


_current: ContextVar[IdempotencyInfo | None] = ContextVar("idem_asgi_current", default=None)


def current_idempotency() -> IdempotencyInfo | None:
    """The key and scope of the protected request running in this context, else None."""
    return _current.get()
