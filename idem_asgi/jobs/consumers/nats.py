"""The NATS JetStream adapter (nats-py): `nats_handler`, and the dead letters it keeps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from typing import Any

from ...backends import Backend
from ...claims.recovery import RecoverHook
from ...errors import ConfigurationError
from ...observe import Observer
from ._core import (
    STOP_TIMEOUT,
    Claiming,
    Consumer,
    Handler,
    KeyOf,
    Malformed,
    PrintOf,
    Reader,
    Settle,
    Verdict,
    applied,
    held_until_decided,
    malformed,
    retry_backoff,
    settled,
)
from ._nats_facts import ConsumerBook, ConsumerFacts, check_dead_letters, progress_interval

logger = logging.getLogger("idem_asgi")


def nats_handler(
    backend: Backend,
    handler: Handler,
    *,
    namespace: str,
    header: str | None = None,
    field: str | None = None,
    key: KeyOf | None = None,
    fingerprint: PrintOf | Iterable[str] | None = None,
    ttl: float = 7 * 86_400,
    lease: float = 30,
    wait: float = 10,
    retry_delay: float | None = None,
    progress_every: float | None = None,
    dead_letter: str | None = None,
    recover: RecoverHook | None = None,
    stop_timeout: float = STOP_TIMEOUT,
    observer: Observer | None = None,
) -> Consumer:
    """A nats-py JetStream callback that applies each message once; see the package docstring. Pass it
    as a push subscription's `cb=` (`await js.subscribe(subject, durable=..., cb=on_message,
    manual_ack=True)`), or call it on the messages a pull subscription fetches (`await
    asyncio.gather(*(on_message(m) for m in await sub.fetch(50)))`).

    Args:
        namespace: The key space of this consumer's work (e.g. `"charge"`): named, never derived from
            the stream or the durable, so renaming the durable, moving from push to pull or reading a
            mirror keeps the records (a derived name would apply every message again).
        header: A header holding the message's key (default: the `Nats-Msg-Id` header,
            JetStream's own publish de-duplication id).
        field: A top-level JSON body field holding the key.
        key: A callable given the message, returning its key.
        fingerprint: What makes two deliveries of one key the same message: the body (default), the
            named top-level JSON fields, or a callable given the message.
        retry_delay: The `nak` delay for a delivery whose handler raised (default: 0.5 s doubling per
            delivery, by its `num_delivered`, up to 30 s; a poison message never loops hot, even on a
            consumer with no `max_deliver`).
        progress_every: How often `in_progress()` is sent while a delivery is held or running
            (default: the smallest of `lease / 3`, 5 s and a third of the consumer's `ack_wait`; one
            above half the `ack_wait` is refused).
        dead_letter: A subject to copy each dead letter to (with `Idem-Dead-Reason`, `Idem-Stream`,
            `Idem-Stream-Seq` headers) before `term()`. Required on a work-queue or interest stream,
            which deletes a terminated message; on a limits stream the message stays in the stream
            and its MSG_TERMINATED advisory points at it.
        recover: Asked about a message whose consumer died mid-handler (as a route's hook).
        stop_timeout: Seconds the `async with` block waits for running deliveries when it ends.

    Settling: applied (now or before) → `ack()`; the handler raised → the claim is released and
    `nak(delay=...)`, the consumer's `max_deliver` bounds the attempts; no key, an unreadable key or
    body, another body under a used key, or an outcome unknown → dead letter (`term()`, after the copy);
    the store could not make the claim → the delivery is held with `in_progress()` until it can. On a
    push consumer every delivery runs in a task of its own as soon as it arrives (the subscription's
    callback returns at once), so messages never queue unseen behind a slow one: `max_ack_pending`
    bounds how many run at once. The consumer's facts (ack wait, push or pull, stream retention) are
    read on its first message and again every 30 s."""
    reader = Reader("nats_handler", header, field, key, lambda msg: (msg.headers or {}).get("Nats-Msg-Id"), fingerprint)
    if progress_every is not None and progress_every <= 0:
        raise ValueError(f"progress_every must be positive, got {progress_every!r}")
    if not namespace:
        raise ConfigurationError("nats_handler needs namespace= (the key space of this consumer's work)")
    book = ConsumerBook()
    claiming = Claiming.of(backend, namespace, ttl=ttl, lease=lease, wait=wait, recover=recover, observer=observer)

    def detach(msg: Any) -> bool | Awaitable[bool]:
        known = book.known(msg)
        return known.push if known is not None else _pushes(book, msg)

    async def work(msg: Any, stopping: asyncio.Event) -> None:
        if stopping.is_set():
            await settled(msg.nak(), None)  # stopping: another subscriber takes it now
            return
        facts = book.known(msg) or await book.facts(msg)
        # What the consumer's config refuses raises here, before anything ran: the message is left
        # unsettled (JetStream offers it again), and the error says what to change.
        every = progress_interval(facts, progress_every, lease)
        check_dead_letters(facts, dead_letter)
        ticker = asyncio.ensure_future(_in_progress(msg, every))
        try:
            try:
                delivery = reader.read(msg)
            except Malformed as exc:
                verdict = malformed(exc)
            else:
                verdict = await held_until_decided(
                    lambda: applied(delivery, lambda: handler(msg), claiming), None, stopping
                )
        finally:
            ticker.cancel()
        await _settle(msg, facts, verdict, retry_delay, dead_letter)

    return Consumer(work, stop_timeout, detach)


async def _settle(
    msg: Any, facts: ConsumerFacts, verdict: Verdict, delay: float | None, dead_letter: str | None
) -> None:
    if verdict.settle is Settle.ACK:
        await settled(msg.ack(), None)
    elif verdict.settle is Settle.DEAD:
        if dead_letter is None or await _copied(msg, facts, verdict.reason, dead_letter):
            await settled(msg.term(), None)
        else:  # not copied: keep it (redelivered later) rather than lose it
            await settled(msg.nak(delay=retry_backoff(_delivered(msg))), None)
    else:
        await settled(msg.nak(delay=retry_backoff(_delivered(msg)) if delay is None else delay), None)


async def _pushes(book: ConsumerBook, msg: Any) -> bool:
    return (await book.facts(msg)).push


def _data(msg: Any) -> bytes:
    return bytes(msg.data)


def _delivered(msg: Any) -> int:
    try:
        return int(msg.metadata.num_delivered)
    except Exception:
        return 1


async def _copied(msg: Any, facts: ConsumerFacts, reason: str, subject: str) -> bool:
    """Publish a copy of the dead letter, with its reason, to `subject` (JetStream, acknowledged)."""
    headers = dict(msg.headers or {})
    headers.update(
        {
            "Idem-Dead-Reason": reason[:1000],
            "Idem-Stream": facts.stream,
            "Idem-Consumer": facts.consumer,
            "Idem-Stream-Seq": str(getattr(msg.metadata.sequence, "stream", "")),
            "Idem-Subject": msg.subject,
        }
    )
    try:
        await msg._client.jetstream().publish(subject, msg.data, headers=headers)
    except Exception as exc:
        logger.error("idem_asgi: could not copy a dead letter to %r (%r); it is kept and redelivered", subject, exc)
        return False
    return True


async def _in_progress(msg: Any, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await msg.in_progress()
        except Exception:  # a closed connection: the redelivery it allows is still applied once
            return
