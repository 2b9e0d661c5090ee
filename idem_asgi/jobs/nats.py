"""What `nats_handler` asks JetStream about the consumer a message came from, once per consumer.

A message's metadata names its stream and consumer, but not whether the consumer is durable or how
long JetStream waits for an ack. Both decide something the adapter cannot guess: the key space (a
durable's name is stable; an ephemeral or ordered consumer's is random, so records keyed by it
would never be found after a restart and every message would be applied again) and how often
`in_progress()` must be sent (slower than `ack_wait`, JetStream redelivers a message that is still
running, and the redeliveries count toward `max_deliver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError

logger = logging.getLogger("idem_asgi")


@dataclass(frozen=True)
class ConsumerFacts:
    """The consumer's durable name (None: ephemeral or ordered) and its shortest ack wait (s)."""

    stream: str
    durable: str | None
    ack_wait: float


async def _look_up(msg: Any) -> ConsumerFacts:
    meta = msg.metadata
    info = await msg._client.jetstream().consumer_info(meta.stream, meta.consumer)
    config = info.config
    waits = [float(w) for w in (config.ack_wait, *(config.backoff or ())) if w]  # backoff overrides ack_wait
    return ConsumerFacts(meta.stream, config.durable_name or None, min(waits) if waits else 30.0)


class ConsumerBook:
    """`ConsumerFacts` per (stream, consumer), looked up on a consumer's first message and kept
    (a failed look-up is not kept: the next message asks again)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], asyncio.Future[ConsumerFacts]] = {}

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
        known = self._known.get(name)
        if known is None:
            known = self._known[name] = asyncio.ensure_future(_look_up(msg))
        try:
            return await asyncio.shield(known)
        except Exception:
            if self._known.get(name) is known and known.done():
                del self._known[name]
            raise


def namespace_of(facts: ConsumerFacts, given: str | None) -> str:
    """The key space: `given`, else `nats:<stream>:<durable>`; an ephemeral or ordered consumer
    (a random name) without `namespace=` is refused."""
    if given is not None:
        return given
    if facts.durable is None:
        raise ConfigurationError(
            f"nats_handler: the consumer of this message on stream {facts.stream!r} is ephemeral or ordered "
            "(no durable name): its name is random, so a key space derived from it would apply every message "
            "again after a restart; use a durable consumer or pass namespace= (e.g. the stream and the work)"
        )
    return f"nats:{facts.stream}:{facts.durable}"


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
