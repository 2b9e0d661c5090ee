"""What every built-in store shares: fencing-token minting, the async context-manager methods, and
the raw-key record `idem-asgi migrate` follows (`KeyForms`)."""

from __future__ import annotations

import secrets
from types import ModuleType, TracebackType
from typing import Any, ClassVar, TypeVar

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


class RawKeyRecord:
    """`KeyForms`' record of an app keeping raw keys, through the store's own `_keys` module."""

    _key_forms: ClassVar[ModuleType]
    _raw_recorded: bool

    async def record_raw_keys(self) -> None:
        """Record in the store that an app keeps raw keys (`store_keys=True` does it before its first
        write; `idem-asgi migrate --store-keys` too), so `migrate` keeps them."""
        await self._key_forms.record_raw_keys(self)
        self._raw_recorded = True

    async def raw_keys_recorded(self) -> float | None:
        """When an app with `store_keys=True` last recorded that it uses this store, or None."""
        recorded: float | None = await self._key_forms.raw_keys_recorded(self)
        return recorded

    async def forget_raw_keys(self) -> None:
        """Drop that record (`idem-asgi migrate --no-store-keys`, once no such worker runs)."""
        await self._key_forms.forget_raw_keys(self)
