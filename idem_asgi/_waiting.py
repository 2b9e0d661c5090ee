"""Repeats held on a route with `wait=`: woken by the first request itself when it runs in this
process (its stored answer handed over, no store call), by the store's notice when it runs in
another (`watch`, on Redis), and otherwise by a bounded poll.

The holder pays one dict lookup when nobody waits. Waiters are keyed by the record's digest and the
holder's token, so a waiter never takes the answer of a later claim of the same key for its own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .records import StoredResponse

ENDED: Any = object()
"""What a waiter is told when the holder ended without an answer to replay (released, failed):
it must ask the store again."""


class Waiters:
    """Futures of held repeats, per digest, each with the token of the claim it waits on."""

    __slots__ = ("_by_digest",)

    def __init__(self) -> None:
        self._by_digest: dict[str, list[tuple[int, asyncio.Future[Any]]]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def watch(self, digest: str, token: int) -> asyncio.Future[Any]:
        """A future resolved with the holder's stored answer, or `ENDED`."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._by_digest.setdefault(digest, []).append((token, future))
        return future

    def forget(self, digest: str, future: asyncio.Future[Any]) -> None:
        waiting = self._by_digest.get(digest)
        if waiting is not None:
            waiting[:] = [(t, f) for t, f in waiting if f is not future]
            if not waiting:
                del self._by_digest[digest]

    def ended(self, digest: str, token: int, answer: StoredResponse | None) -> None:
        """The claim `token` ended in this process: hand its waiters `answer` (stored), or `ENDED`."""
        waiting = self._by_digest.get(digest)
        if not waiting:
            return
        outcome = ENDED if answer is None else answer
        rest = []
        for t, future in waiting:
            if t == token:
                _wake(future, outcome)
            else:
                rest.append((t, future))
        if rest:
            self._by_digest[digest] = rest
        else:
            del self._by_digest[digest]

    def changed(self, digest: str) -> None:
        """The store says the record of `digest` changed (a claim ended in another process)."""
        for _, future in self._by_digest.pop(digest, ()):
            _wake(future, ENDED)


def _wake(future: asyncio.Future[Any], outcome: Any) -> None:
    if not future.done():
        future.get_loop().call_soon_threadsafe(_resolve, future, outcome)


def _resolve(future: asyncio.Future[Any], outcome: Any) -> None:
    if not future.done():
        future.set_result(outcome)
