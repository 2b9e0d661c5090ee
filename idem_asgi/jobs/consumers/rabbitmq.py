"""The RabbitMQ adapter (aio-pika): `rabbitmq_handler`."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable
from typing import Any

from ...backends import Backend
from ...claims.recovery import RecoverHook
from ...observe import Observer
from ._core import (
    HOLD,
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
    stopped,
)

logger = logging.getLogger("idem_asgi")


def rabbitmq_handler(
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
    store_hold: float = 900,
    retry_delay: float | None = None,
    recover: RecoverHook | None = None,
    stop_timeout: float = STOP_TIMEOUT,
    observer: Observer | None = None,
) -> Consumer:
    """An aio-pika `on_message` callback (`await queue.consume(rabbitmq_handler(store, handle, namespace=...))`)
    that applies each message once; see the package docstring.

    Args:
        namespace: The key space of this queue's work (e.g. the queue's name): two queues that get
            the same messages for different work (a fanout exchange) each need their own, or the
            second would find every message already applied. A message carries nothing that names
            its queue, so there is no default.
        header: A header holding the message's key (default: its `message_id`; aio-pika gives a
            message published without one a random one: publish with a stable id).
        field: A top-level JSON body field holding the key.
        key: A callable given the message, returning its key (e.g. `body_digest`).
        fingerprint: What makes two deliveries of one key the same message: the body (default), the
            named top-level JSON fields (`["order_id", "amount"]`: a publisher that rebuilds a
            `sent_at` stamp on retry still sends the same message), or a callable given the message.
        store_hold: Seconds a delivery is held while the store cannot claim it, then requeued. Keep
            it below the broker's `consumer_timeout` (30 min by default; AMQP cannot tell a client
            its value): past it RabbitMQ closes the channel and requeues everything on it.
        retry_delay: Seconds a delivery whose handler raised is held before it is requeued (default:
            0.5 s doubling per delivery, by its `x-delivery-count`, up to 30 s): a poison message on a
            queue with no delivery limit is retried a few times a minute, not in a hot loop.
        recover: Asked about a message whose consumer died mid-handler (as a route's hook; return
            `stored_result(value)` when it was applied, `"run"` when it never happened).
        stop_timeout: Seconds the `async with` block waits for running deliveries when it ends.

    Retries are `nack(requeue=True)`; give the queue an `x-delivery-limit` (quorum queue) and a
    dead-letter exchange to bound them. Dead letters are `reject(requeue=False)`, with the reason
    logged. Run it as `async with rabbitmq_handler(...) as on_message:` inside the connection's
    block, so a graceful stop drains it before the connection closes."""
    reader = Reader("rabbitmq_handler", header, field, key, lambda message: message.message_id, fingerprint, _body)
    claiming = Claiming.of(backend, namespace, ttl=ttl, lease=lease, wait=wait, recover=recover, observer=observer)

    async def work(message: Any, stopping: asyncio.Event) -> None:
        if stopping.is_set():
            return  # stopping: left unsettled, the broker gives it to another consumer when the channel closes
        try:
            delivery = reader.read(message)
        except Malformed as exc:
            verdict = malformed(exc)
        else:
            verdict = await held_until_decided(
                lambda: applied(delivery, lambda: handler(message), claiming), store_hold, stopping
            )
        if verdict.settle in HOLD and stopping.is_set():
            return  # left unsettled: requeued when the channel closes
        if verdict.settle is Settle.RETRY:
            count = max(_delivery_count(message), failures.count(message)) + 1
            await stopped(stopping, retry_backoff(count) if retry_delay is None else retry_delay)
        else:
            failures.forget(message)
        await settled(_settle(message, verdict, store_hold), getattr(message, "message_id", None))

    failures = _Failures()
    return Consumer(work, stop_timeout)


class _Failures:
    """Handler failures per message body in this consumer: a classic queue says only `redelivered`,
    not how often, so the backoff counts them here (bounded: the oldest are forgotten)."""

    __slots__ = ("_seen",)
    LIMIT = 10_000

    def __init__(self) -> None:
        self._seen: dict[bytes, int] = {}

    def count(self, message: Any) -> int:
        """Failures counted so far (this one included from now on)."""
        body = _identity(message)
        seen = self._seen.pop(body, 0)
        if len(self._seen) >= self.LIMIT:
            del self._seen[next(iter(self._seen))]
        self._seen[body] = seen + 1
        return seen

    def forget(self, message: Any) -> None:
        if self._seen:
            self._seen.pop(_identity(message), None)


def _identity(message: Any) -> bytes:
    return hashlib.sha256(repr((getattr(message, "message_id", None), bytes(message.body))).encode()).digest()


def _body(message: Any) -> bytes:
    return bytes(message.body)


def _delivery_count(message: Any) -> int:
    """How many times the message was delivered before this one (a quorum queue's `x-delivery-count`)."""
    headers = getattr(message, "headers", None) or {}
    try:
        return int(headers.get("x-delivery-count", 0))
    except (TypeError, ValueError):
        return 0


async def _settle(message: Any, verdict: Verdict, held: float) -> None:
    """Ack, dead-letter (reject without requeue) or requeue (a nack the quorum queue counts)."""
    if verdict.settle is Settle.ACK:
        await message.ack()
    elif verdict.settle is Settle.DEAD:
        await message.reject(requeue=False)
    else:
        if verdict.settle is Settle.STORE_DOWN:
            logger.error("idem_asgi: message %r held %gs, the store still down; requeued", message.message_id, held)
        await message.nack(requeue=True)
