"""What `nats_handler` asks JetStream about the consumer and stream a message came from.

A message's metadata names its stream and consumer, but not what decides how the adapter must treat
it: how long JetStream waits for an ack (`in_progress()` must come sooner, or a message still running
is redelivered and counted toward `max_deliver`), whether the consumer pushes (its subscription's
callback runs one message at a time, so the adapter hands each message to a task of its own and
returns, and every message held gets `in_progress()`), and the stream's retention (on a work-queue or
interest stream a `term()`ed message is deleted, so a dead letter must be copied out first). The facts
are read on a consumer's first message and read again after `REFRESH` seconds, so a config changed in
place (an `ack_wait` lowered) is followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

from ...errors import ConfigurationError

logger = logging.getLogger("idem_asgi")

REFRESH: Final = 30.0
"""Seconds the facts of a consumer are used before they are read again (in the background)."""


@dataclass(frozen=True)
class ConsumerFacts:
    """A consumer's stream and name, its shortest ack wait (s), whether it pushes, its stream's retention."""

    stream: str
    consumer: str
    ack_wait: float
    push: bool = False
    retention: str = "limits"


async def _look_up(msg: Any) -> ConsumerFacts:
    meta = msg.metadata
    js = msg._client.jetstream()
    info = await js.consumer_info(meta.stream, meta.consumer)
    config = info.config
    waits = [float(w) for w in (config.ack_wait, *(config.backoff or ())) if w]  # backoff overrides ack_wait
    stream = await js.stream_info(meta.stream)
    retention = getattr(stream.config.retention, "value", stream.config.retention) or "limits"
    return ConsumerFacts(
        meta.stream,
        meta.consumer,
        min(waits) if waits else 30.0,
        push=bool(config.deliver_subject),
        retention=str(retention),
    )


class ConsumerBook:
    """`ConsumerFacts` per (stream, consumer): looked up on a consumer's first message, read again in
    the background once older than `REFRESH` (the old facts serve meanwhile); a failed look-up is not
    kept (the next message asks again)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], tuple[asyncio.Future[ConsumerFacts], float]] = {}

    def known(self, msg: Any) -> ConsumerFacts | None:
        """The facts of the message's consumer when they are in and fresh (no await: the usual case)."""
        entry = self._known.get((msg.metadata.stream, msg.metadata.consumer))
        if entry is None or not entry[0].done() or entry[0].cancelled() or entry[0].exception() is not None:
            return None
        if time.monotonic() - entry[1] > REFRESH:
            return None  # `facts` refreshes them
        return entry[0].result()

    async def facts(self, msg: Any) -> ConsumerFacts:
        """The message's consumer facts; a look-up JetStream did not answer is asked again (with
        `in_progress()` before each retry, so the message is kept meanwhile), never raised into
        the caller's fetch loop."""
        delay = 0.1
        while True:
            try:
                return await self._once(msg)
            except Exception as exc:
                logger.warning("idem_asgi: no consumer info for %r (%r); asking again", msg.metadata.consumer, exc)
            with contextlib.suppress(Exception):
                await msg.in_progress()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _once(self, msg: Any) -> ConsumerFacts:
        name = (msg.metadata.stream, msg.metadata.consumer)
        entry = self._known.get(name)
        now = time.monotonic()
        if entry is None:
            entry = self._known[name] = (asyncio.ensure_future(_look_up(msg)), now)
        elif now - entry[1] > REFRESH and entry[0].done():
            self._refresh(name, msg, entry[0])
        known = entry[0]
        try:
            return await asyncio.shield(known)
        except Exception:
            if self._known.get(name, (None,))[0] is known and known.done():
                del self._known[name]
            raise

    def _refresh(self, name: tuple[str, str], msg: Any, current: asyncio.Future[ConsumerFacts]) -> None:
        """Read the facts again in the background; keep serving `current` until they are in."""
        self._known[name] = (current, time.monotonic())  # one refresh at a time
        fresh = asyncio.ensure_future(_look_up(msg))

        def done(task: asyncio.Future[ConsumerFacts]) -> None:
            if not task.cancelled() and task.exception() is None:
                self._known[name] = (task, time.monotonic())

        fresh.add_done_callback(done)


def progress_interval(facts: ConsumerFacts, given: float | None, lease: float) -> float:
    """How often to send `in_progress()`: `given` when it is at most half the consumer's ack wait
    (else refused), by default the smallest of `lease / 3`, 5 s and a third of the ack wait."""
    if given is None:
        return min(lease / 3, 5.0, facts.ack_wait / 3)
    if given > facts.ack_wait / 2:
        raise ConfigurationError(
            f"nats_handler: progress_every={given!r} s cannot keep a message whose consumer waits "
            f"{facts.ack_wait:g} s for an ack (JetStream would redeliver a message still running); "
            f"use at most {facts.ack_wait / 2:g} s or raise the consumer's ack_wait"
        )
    return given


def check_dead_letters(facts: ConsumerFacts, dead_letter: str | None) -> None:
    """A work-queue or interest stream deletes a `term()`ed message: refuse to dead-letter there
    without a subject to copy it to first (a charge in doubt would be lost)."""
    if dead_letter is None and facts.retention != "limits":
        raise ConfigurationError(
            f"nats_handler: stream {facts.stream!r} has {facts.retention} retention, which deletes a message "
            "once it is terminated, so a dead letter would be lost; pass dead_letter='<subject>' (a subject a "
            "stream of yours keeps) and the adapter copies each dead letter there, with its reason, before term()"
        )
