"""`PostgresBackend.transaction()`: business writes and the claim's "effect committed" mark in one COMMIT.

Kept apart from the store's claim/complete calls because it is the one place the store reaches
into the request running in this task (its live claim) and into the caller's own connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any, Protocol

import anyio

from ...context import ClaimHandle, current_idempotency
from ...errors import ClaimLost, ConfigurationError
from ...records import RecordKey
from ._lean import LeanPool, broken_by
from ._pool import Runner
from ._sql import Statements


class EffectStore(Protocol):
    """What a transaction uses of its store: passed in by `PostgresBackend.transaction`, never imported."""

    sql: Statements
    timeout: float
    _runner: Runner

    async def _get_pool(self) -> Any: ...

    def _id(self, key: RecordKey) -> tuple[str, str, str]: ...


_open_connection: ContextVar[Any] = ContextVar("idem_asgi_postgres_transaction", default=None)
"""The connection of the `transaction()` block open in this task, for blocks nested in it."""


def _holds(backend: Any, target: EffectStore) -> bool:
    """Whether `backend` is `target`, or a wrapper around it (`.wrapped`, as the testing plugin makes)."""
    for _ in range(8):
        if backend is target:
            return True
        backend = getattr(backend, "wrapped", None)
        if backend is None:
            return False
    return False


def live_claim(store: EffectStore) -> ClaimHandle | None:
    """The claim of the protected request running in this context, if it was made in `store` and
    its answer is not final yet (a background task after the answer, or a keyless request, holds
    none: its transaction is a plain one)."""
    info = current_idempotency()
    claim = None if info is None else info.claim
    if claim is None:
        return None
    if not _holds(claim.backend, store):
        if isinstance(claim.backend, type(store)):  # another instance of the same store class
            raise ConfigurationError("this request was claimed through another PostgresBackend instance")
        return None  # claimed in another kind of store: this database's transaction is a plain one
    return claim


@contextlib.asynccontextmanager
async def effect_transaction(store: EffectStore, connection: Any = None) -> AsyncIterator[Any]:
    """See `PostgresBackend.transaction`."""
    outer = _open_connection.get()
    if connection is None and outer is not None:
        async with outer.transaction():  # nested: a savepoint of the outer block, which marks
            yield outer
        return
    claim = live_claim(store)
    async with _connection(store, connection) as conn:
        # Nothing happened before this block: mark the claim 't' first (its own statement, outside
        # the transaction), so a holder that dies before COMMIT leaves a claim recovery may run again.
        opened = (
            claim is not None
            and not claim.effect
            and not conn.is_in_transaction()  # (inside the caller's own transaction it would commit with it)
            and await _mark(store, conn, claim, "t")
        )
        reset = _open_connection.set(conn)
        try:
            async with conn.transaction():
                yield conn
                if claim is not None:
                    await _mark_effect(store, conn, claim)
            if claim is not None:
                claim.mark_effect()  # committed: a failure from now on must not release the claim
        except Exception:  # (cancelled inside it, the work ends: rolled back, nothing happened, it stays 't')
            if opened:  # rolled back: what the handler does next is outside it ('p' again)
                assert claim is not None
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await _mark(store, conn, claim, "p")
            raise
        finally:
            _open_connection.reset(reset)


@contextlib.asynccontextmanager
async def _connection(store: EffectStore, connection: Any) -> AsyncIterator[Any]:
    """`connection` as given, or one from the store's pool, handed back afterwards."""
    if connection is not None:
        yield connection
        return
    pool = await store._get_pool()
    with store._runner.errors:
        conn = await pool.acquire(timeout=store.timeout)
    try:
        yield conn
    except BaseException as exc:
        if isinstance(pool, LeanPool):  # a cancelled or timed-out block may leave it mid-statement
            pool.put(conn, broken=broken_by(exc))
        else:
            await pool.release(conn)
        raise
    await pool.release(conn)


async def _mark(store: EffectStore, conn: Any, claim: ClaimHandle, state: str) -> bool:
    """Mark the claim inside an open transaction (`t`) or not (`p`), fenced by its token; whether it
    changed (a claim already marked with an effect is left as it is)."""
    k = claim.rkey
    assert k is not None
    statement = store.sql.opening if state == "t" else store.sql.closing
    status = await conn.execute(statement, *store._id(k), claim.token, timeout=store.timeout)
    return bool(status == "UPDATE 1")


async def _mark_effect(store: EffectStore, conn: Any, claim: ClaimHandle) -> None:
    """Mark the claim effect-committed inside the open transaction, fenced by its token."""
    k = claim.rkey
    assert k is not None
    status = await conn.execute(store.sql.effect, *store._id(k), claim.token, timeout=store.timeout)
    if status != "UPDATE 1":
        raise ClaimLost(
            f"the claim on key {k.key!r} is no longer held by this request (taken over, expired "
            "or already completed); the transaction is rolled back"
        )
