"""The faults a storm injects inside the middleware: a failing or slow store write, a handler that fails first."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..backends import Backend
from ..errors import BackendUnavailable, IdemError
from ..records import ClaimResult, Record, RecordKey, StoredResponse


class InjectedStoreFailure(BackendUnavailable):
    """The store failure `storm()` injects; the middleware's log records about it are filtered out."""


def not_injected(record: logging.LogRecord) -> bool:
    """A logging filter dropping the middleware's (expected) complaints about the injected failure."""
    causes = [record.exc_info[1] if record.exc_info else None, *(record.args if isinstance(record.args, tuple) else ())]
    return not any(isinstance(c, InjectedStoreFailure) for c in causes)


class FailingStore:
    """A Backend wrapper whose `complete` raises BackendUnavailable once for each armed key."""

    def __init__(
        self, inner: Backend, armed: set[str], fired: set[str], writing: dict[str, Callable[[], None]]
    ) -> None:
        self.inner = inner
        self.wrapped = inner  # PostgresBackend.transaction() finds its own claim through wrappers
        self._armed = armed
        self._fired = fired
        self._writing = writing

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        return await self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        return await self.inner.takeover(key, stale_token, fingerprint, lease=lease, ttl=ttl)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        if fire(key, self._armed, self._fired):
            raise InjectedStoreFailure("store failed after the claim (injected by idem_asgi.testing)")
        starting = self._writing.pop(key.key, None)
        if starting is not None:
            starting()  # the storm's retries start now, and land while this write is in flight
            await asyncio.sleep(0)
        return await self.inner.complete(key, token, response, ttl=ttl)

    async def release(self, key: RecordKey, token: int) -> bool:
        return await self.inner.release(key, token)

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        return await self.inner.extend(key, token, lease=lease)

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        return await self.inner.mark_failed(key, token)

    async def get(self, key: RecordKey) -> Record | None:
        return await self.inner.get(key)

    async def aclose(self) -> None:
        """The storm never closes the user's store."""

    def __getattr__(self, name: str) -> Any:
        # Anything beyond the Backend protocol (maintenance methods, pool, setup) is the real store's.
        return getattr(self.inner, name)


class InjectedAppFailure(IdemError, RuntimeError):
    """The handler failure `storm()` injects (fault `app_fails_before_effect`), before the app runs."""


def fire(key: RecordKey, armed: set[str], fired: set[str]) -> bool:
    if key.key in armed and key.key not in fired:
        fired.add(key.key)
        return True
    return False
