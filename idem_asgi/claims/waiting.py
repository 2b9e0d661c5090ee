"""Repeats held on a route with `wait=`: woken by the first request itself when it runs in this
process (its stored answer handed over, no store call), by the store's notice when it runs in
another (`watch`, on Redis), and otherwise by a bounded poll.

The holder pays one dict lookup when nobody waits. Waiters are keyed by the record's digest and the
holder's token, so a waiter never takes the answer of a later claim of the same key for its own.
Adding and removing a waiter are dict operations, whatever the number held on one key; each is
woken once, by the end it waits for (or by its own deadline, which its request keeps).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..records import StoredResponse

ENDED: Any = object()
"""What a waiter is told when the holder ended without an answer to replay (released, failed,
lost its claim), or when the store's notices were interrupted: it must ask the store again."""


class Waiters:
    """Futures of held repeats, per digest, each with the token of the claim it waits on."""

    __slots__ = ("by_digest",)

    def __init__(self) -> None:
        self.by_digest: dict[str, dict[asyncio.Future[Any], int]] = {}
        """Empty while nobody waits: what a holder looks at (a dict's truth, no method call)."""

    def __bool__(self) -> bool:
        return bool(self.by_digest)

    def watch(self, digest: str, token: int) -> asyncio.Future[Any]:
        """A future resolved with the holder's stored answer, or `ENDED`."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.by_digest.setdefault(digest, {})[future] = token
        return future

    def forget(self, digest: str, future: asyncio.Future[Any]) -> None:
        waiting = self.by_digest.get(digest)
        if waiting is not None:
            waiting.pop(future, None)
            if not waiting:
                del self.by_digest[digest]

    def ended(self, digest: str, token: int, answer: StoredResponse | None) -> None:
        """The claim `token` ended in this process: hand its waiters `answer` (stored), or `ENDED`."""
        waiting = self.by_digest.get(digest)
        if not waiting:
            return
        woken = [future for future, t in waiting.items() if t == token]
        for future in woken:
            del waiting[future]
        if not waiting:
            del self.by_digest[digest]
        _wake(woken, ENDED if answer is None else answer)

    def changed(self, digest: str | None) -> None:
        """The store says the record of `digest` changed (a claim ended in another process); None:
        its notices were interrupted, so any record may have changed unseen."""
        if digest is None:
            everyone, self.by_digest = self.by_digest, {}
            for waiting in everyone.values():
                _wake(list(waiting), ENDED)
            return
        _wake(list(self.by_digest.pop(digest, ())), ENDED)


def _wake(futures: list[asyncio.Future[Any]], outcome: Any) -> None:
    """Resolve each future: at once on this loop, or through its own loop's thread-safe queue."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    for future in futures:
        if future.done():
            continue
        loop = future.get_loop()
        if loop is running:
            future.set_result(outcome)
        else:
            loop.call_soon_threadsafe(_resolve, future, outcome)


def _resolve(future: asyncio.Future[Any], outcome: Any) -> None:
    if not future.done():
        future.set_result(outcome)
