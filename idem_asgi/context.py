"""How a handler learns the idempotency key (to forward it to its payment provider) and marks its effect.

On the ground floor of the package: the stores read the live claim from here (`PostgresBackend.transaction()`),
the claim core and the surfaces put it here. The claim's store is just an object here (compared by identity),
so nothing here reaches up into `idem_asgi.backends`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from .records import RecordKey

STATE_KEY: Final = "idempotency"
"""Name under which `IdempotencyInfo` is put in `scope["state"]` (Starlette: `request.state.idempotency`)."""


class ClaimHandle(Protocol):
    """The claim a protected request holds while its app runs (read by `PostgresBackend.transaction`)."""

    token: int
    effect: bool
    """True once an effect was marked (`mark_effect()`, or a committed `transaction()`)."""

    @property
    def backend(self) -> object:
        """The store the claim was made in (possibly wrapped: its `wrapped` attribute)."""
        ...

    @property
    def rkey(self) -> RecordKey | None:
        """The record's key in that store."""
        ...

    @property
    def active(self) -> bool:
        """True until the answer is final (stored or released): later work is not part of the claim."""
        ...

    def mark_effect(self) -> None:
        """Note that an irreversible effect happened: a failure from now on never releases the claim."""
        ...


class IdempotencyInfo:
    """The key and scope of the request being run, as the middleware saw them.

    `key` is the client's idempotency key, unquoted (or the key the route derived: an event id,
    an intent hash); `scope` is whom it belongs to (the scope callable's answer), or None.
    """

    __slots__ = ("_claim", "key", "scope")

    def __init__(self, key: str, scope: str | None, claim: ClaimHandle | None = None) -> None:
        self.key = key
        self.scope = scope
        self._claim = claim

    def mark_effect(self) -> None:
        """Say that an irreversible effect has happened (the provider was called, money moved).

        Call it right after the call that may have moved money. From then on, an exception or a
        releasing status (5xx, 429, ...) no longer releases the claim for a retry to run again: the
        record ends `outcome-unknown` until the `recover` hook, `reconcile` or the CLI resolves it.
        Before it, a failure releases the claim as usual. A no-op when nothing is claimed
        (fail-open, `IDEM_ASGI_DISABLED`).
        """
        if self._claim is not None:
            self._claim.mark_effect()

    @property
    def claim(self) -> ClaimHandle | None:
        """The live claim this request holds, or None (nothing claimed, or its answer is already final)."""
        claim = self._claim
        return claim if claim is not None and claim.active else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IdempotencyInfo):
            return NotImplemented
        return (self.key, self.scope) == (other.key, other.scope)

    def __hash__(self) -> int:
        return hash((self.key, self.scope))

    def __repr__(self) -> str:
        return f"IdempotencyInfo(key={self.key!r}, scope={self.scope!r})"


_current: ContextVar[IdempotencyInfo | None] = ContextVar("idem_asgi_current", default=None)


def current_idempotency() -> IdempotencyInfo | None:
    """The key and scope of the protected request running in this context, else None."""
    return _current.get()


enter: Callable[[IdempotencyInfo], Token[IdempotencyInfo | None]] = _current.set
"""Make `info` what `current_idempotency()` returns, until `leave(token)` (no context manager, and
the ContextVar's own method, not a function around it: the middleware's hot path)."""

leave: Callable[[Token[IdempotencyInfo | None]], None] = _current.reset
"""Undo `enter`."""


class HeldClaim:
    """A claim made outside the middleware (a job, a test), as a `ClaimHandle` for `held_claim`."""

    __slots__ = ("_backend", "_rkey", "active", "effect", "token")

    def __init__(self, backend: object, rkey: RecordKey, token: int) -> None:
        self._backend = backend
        self._rkey = rkey
        self.token = token
        self.active = True
        self.effect = False

    @property
    def backend(self) -> object:
        """The store the claim was made in."""
        return self._backend

    @property
    def rkey(self) -> RecordKey | None:
        """The record's key."""
        return self._rkey

    def mark_effect(self) -> None:
        """Note that the effect happened."""
        self.effect = True


@contextmanager
def held_claim(backend: object, rkey: RecordKey, token: int) -> Iterator[HeldClaim]:
    """Make a claim you took yourself (`backend.claim(...)`) the current one for this block.

    Inside it, `PostgresBackend.transaction()` and `checkpoint()` act for that claim, as they do in
    a handler behind the middleware; after it, they act for none.
    """
    claim = HeldClaim(backend, rkey, token)
    entered = enter(IdempotencyInfo(rkey.key, rkey.scope or None, claim))
    try:
        yield claim
    finally:
        leave(entered)
        claim.active = False
