"""What every built-in store shares: fencing-token minting and the async context-manager methods."""

from __future__ import annotations

import secrets
from types import TracebackType
from typing import Any, TypeVar

Self = TypeVar("Self", bound="ClosingMixin")


_randbits = secrets.randbits


def new_token() -> int:
    """A fresh fencing token: 62 bits of the OS's randomness, never 0 (a store may use 0 for "none").

    Never the `random` module: an app or a library that seeds it (`random.seed(42)`,
    `transformers.set_seed`) would make every later claim draw the same token, in every worker.
    """
    return _randbits(62) + 1


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
