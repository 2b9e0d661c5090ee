"""What the stores' notice channels share (Redis pub/sub, Postgres LISTEN): one background task per
backend that keeps a subscription up, and the listeners it tells `digest` (a claim ended) or
`None` (notices were interrupted: any claim may have ended unseen)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

logger = logging.getLogger("idem_asgi")


class Listeners:
    """Subclasses run the subscription in `_run(ready)`, set `ready` once it is up, and call
    `_tell_all`; `_refused` turns notices off for good (repeats poll)."""

    def __init__(self) -> None:
        self._listeners: list[Callable[[str | None], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None
        self._refused = False

    async def listen(self, on_change: Callable[[str | None], None], timeout: float) -> bool:
        """Call `on_change(digest)` for every end told (`None` when notices were interrupted);
        True once subscribed (within `timeout`)."""
        if self._refused:
            return False
        if on_change not in self._listeners:
            self._listeners.append(on_change)
        if self._task is None or self._task.done():
            self._ready = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._ready))
        assert self._ready is not None
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except TimeoutError:
            return False
        return not self._refused

    async def _run(self, ready: asyncio.Event) -> None:
        raise NotImplementedError

    def _tell_all(self, digest: str | None) -> None:
        for listener in self._listeners:
            try:
                listener(digest)
            except Exception:  # pragma: no cover - the middleware's listener does not raise
                logger.exception("idem_asgi: a notice listener failed")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
