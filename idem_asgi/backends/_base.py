"""What every built-in store shares: fencing-token minting, the async context-manager methods, and
the raw-key record `idem-asgi migrate` follows (`KeyForms`)."""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Awaitable, Callable
from types import ModuleType, TracebackType
from typing import Any, ClassVar, TypeVar

Self = TypeVar("Self", bound="ClosingMixin")


_DRAWN = 256  # tokens read from the OS at once: one getrandom() call per 256 claims, not per claim
_unpack = struct.Struct(f"<{_DRAWN}Q").unpack
_tokens: list[int] = []
"""Tokens read from the OS and not handed out yet (`list.pop` is atomic: threads never share one)."""

# A forked child must never hand out the tokens its parent still holds (both would draw the same).
os.register_at_fork(after_in_child=_tokens.clear)


def new_token() -> int:
    """A fresh fencing token: 62 bits of the OS's randomness (`os.urandom`, what `secrets` reads),
    never 0 (a store may use 0 for "none").

    Never the `random` module: an app or a library that seeds it (`random.seed(42)`,
    `transformers.set_seed`) would make every later claim draw the same token, in every worker.
    The bytes are read 256 tokens at a time (a system call per claim cost more than the rest of
    drawing it); a forked child drops what its parent had read.
    """
    try:
        return _tokens.pop()
    except IndexError:
        _tokens.extend((v >> 2) + 1 for v in _unpack(os.urandom(8 * _DRAWN)))
        return _tokens.pop()


class ClosingMixin:
    """`async with backend:` closes it on exit (`aclose()` closes only what the backend created), and
    what was registered with `on_close` runs first (the claim machinery drains its pending writes)."""

    async def aclose(self) -> None:  # pragma: no cover - each store defines its own
        raise NotImplementedError

    def on_close(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await `hook()` when the store closes, before it closes anything."""
        hooks: list[Callable[[], Awaitable[None]]] = self.__dict__.setdefault("_close_hooks", [])
        hooks.append(hook)

    async def _before_close(self) -> None:
        """Run the `on_close` hooks (each store's `aclose` calls this first); one that fails is logged."""
        for hook in self.__dict__.get("_close_hooks", ()):
            try:
                await hook()
            except Exception:
                logging.getLogger("idem_asgi").exception("idem_asgi: a close hook of the store failed")

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
