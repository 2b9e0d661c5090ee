"""The base of `RedisBackend`: what a call needs before it reaches Redis (a cluster client's
start-up, a `max_concurrency` slot, the one error mapping), and the ops half built on it
(`Maintenance`: `stale`, `purge`; `KeyForms`: raw keys kept or blanked for `idem-asgi migrate`).
Never on a request's path but for `_start` and `_slot`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any, ClassVar

from ...errors import BackendUnavailable
from ...history import Step
from ...records import RecordKey, StaleRecord
from ...sealed_keys import KeySeal
from .._base import RawKeyRecord
from . import _history, _keys
from ._errors import DRIVER_ERRORS
from ._stale import scan_stale

CLOSED = "redis: this backend was closed (aclose()); build a new one"


class Tools(RawKeyRecord):
    """Set up by `RedisBackend.__init__`; a class of its own only to keep the ops half apart."""

    client: Any
    prefix: str
    timeout: float
    _cluster: bool
    _closed: bool = False  # aclose() ran: no call reconnects
    key_seal: KeySeal | None
    _raw_recorded: bool
    _key_forms: ClassVar[ModuleType] = _keys
    _starting: bool
    _start_lock: asyncio.Lock
    _slots: asyncio.Semaphore | None
    history: int

    async def _start(self) -> None:
        async with self._start_lock:
            if self._starting:
                await self.client.initialize()
                self._starting = False

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One `max_concurrency` slot, waited for up to `timeout` (nothing to wait for without a limit)."""
        slots = self._slots
        if slots is None:
            yield
            return
        try:
            await asyncio.wait_for(slots.acquire(), self.timeout)
        except TimeoutError:
            raise BackendUnavailable(f"redis: no free connection within {self.timeout}s") from None
        try:
            yield
        finally:
            slots.release()

    # -- ops tools: stale claims and purge --------------------------------------------------

    @contextlib.asynccontextmanager
    async def _tool_call(self) -> AsyncIterator[None]:
        """One `max_concurrency` slot and the same error mapping as `_call`, for multi-command tools and
        durable calls; refused at once once the backend is closed."""
        with DRIVER_ERRORS:
            if self._closed:
                raise BackendUnavailable(CLOSED)
            if self._starting:
                await self._start()
            async with self._slot():
                yield

    async def read_history(self, key: RecordKey) -> list[Step]:
        """The key's steps, oldest first."""
        return await _history.read(self, key)

    async def ping(self) -> None:
        """One round trip on the tools' client (which finds a Sentinel's primary or a Cluster's slots
        first): raises `BackendUnavailable` when the store does not answer."""
        async with self._tool_call():
            await self.client.ping()

    async def stale(
        self, older_than: float = 0.0, limit: int = 1000, *, namespace: str | None = None, scan_count: int = 500
    ) -> list[StaleRecord]:
        """In-progress records whose lease ended more than `older_than` seconds ago (by Redis's clock).

        Walks the keys under `prefix` with `SCAN ... COUNT scan_count TYPE hash` (on every primary
        of a cluster), and reads each batch with one pipelined round trip (`TIME` and one `HMGET`
        per key). Never blocks Redis for long, so it is safe while serving; it costs one pass over
        the keyspace, so run it every few minutes, not per request. Stops once `limit` records are
        found: those are in scan order, not the oldest of all (sorted by lease end among
        themselves). Records written before namespace, scope and key were stored are listed with
        "?" for each (and never match a `namespace` filter).
        """
        if limit < 1:
            return []
        if scan_count < 1:
            raise ValueError("scan_count must be at least 1")
        return await scan_stale(self, older_than, limit, namespace, scan_count)

    async def hash_stored_keys(self, scan_count: int = 500) -> tuple[int, int]:
        """Blank the raw scope and key (fields `o`, `k`) in records of earlier versions or of
        `store_keys=True`, walking `prefix*` with `SCAN` (every primary of a cluster) and fixing
        each batch in one pipelined round trip; `idem-asgi migrate` runs it. Blanks nothing while
        an app with `store_keys=True` is recorded under this prefix (`raw_keys_recorded`).
        Returns (rewritten, 0)."""
        return await _keys.hash_stored_keys(self, scan_count)

    async def purge(self, batch_size: int = 1000) -> int:
        """Nothing to do: every record key carries its TTL (`PEXPIRE`), so Redis deletes it itself.

        Returns 0. Kept so that one purge job works with every store.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        return 0
