"""What every built-in store shares: fencing-token minting and the async context-manager methods."""

from __future__ import annotations

import random
from types import TracebackType
from typing import Any, TypeVar

Self = TypeVar("Self", bound="ClosingMixin")


_getrandbits = random.getrandbits


def new_token() -> int:
    """A fresh fencing token: 62 random bits, never 0 (a store may use 0 for "none")."""
    return _getrandbits(62) + 1


class ClosingMixin:
    """`async with backend:` closes it on exit (`aclose()` closes only what the backend created)."""

    async def aclose(self) -> None:  # pragma: no cover - each store defines its own
        raise NotImplementedError

    async def __aenter__(self: Self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Any:
        await self.aclose()
