"""Message consumers that apply each message once: RabbitMQ through aio-pika.

A broker delivers at least once: a consumer that dies after the effect and before its ack gets the
message redelivered, to itself or to another consumer. `rabbitmq_handler` wraps your handler in
`idem_asgi.jobs.claim`, keyed by the message id (or a header, or a JSON body field):

- first delivery: run the handler, store that it ran (and what it returned), then ack;
- a duplicate of a message already applied: ack without running the handler;
- a duplicate while another consumer still runs it: requeue it (nack, requeue) for later;
- the handler raised: the claim is released and the message requeued (nack, requeue), so the broker
  counts the attempt; a quorum queue with `x-delivery-limit` then dead-letters a poison message after
  that many attempts instead of looping forever;
- no key, another body under the same key, or an outcome unknown (the handler marked its effect,
  then failed): rejected without requeue, i.e. to the queue's dead-letter exchange, for a person.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .backends import Backend
from .jobs import InProgress, KeyReused, OutcomeUnknown, claim

logger = logging.getLogger("idem_asgi")
Handler = Callable[[Any], Awaitable[Any]]


def _key_of(message: Any, header: str | None, field: str | None) -> str | None:
    if header is not None:
        value = (message.headers or {}).get(header)
    elif field is not None:
        try:
            value = json.loads(message.body).get(field)
        except (ValueError, AttributeError):
            value = None
    else:
        value = message.message_id
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return None if value is None or value == "" else str(value)


def rabbitmq_handler(
    backend: Backend,
    handler: Handler,
    *,
    header: str | None = None,
    field: str | None = None,
    namespace: str = "rabbitmq",
    ttl: float = 7 * 86_400,
    lease: float = 30,
) -> Callable[[Any], Awaitable[None]]:
    """An aio-pika `on_message` callback (`await queue.consume(rabbitmq_handler(store, handle))`)
    that applies each message once; see the module docstring. The key is the message's
    `message_id` unless `header=` or `field=` (a top-level JSON body field) names another; publish
    with a stable id (`Message(body, message_id=...)`). The fingerprint is the body's SHA-256."""
    if header is not None and field is not None:
        raise ValueError("rabbitmq_handler keys by message_id, or header=, or field=; not both")

    async def on_message(message: Any) -> None:
        key = _key_of(message, header, field)
        if key is None:
            logger.error("idem_asgi: a message without a key was rejected (dead-lettered)")
            await message.reject(requeue=False)
            return
        try:
            async with claim(
                backend,
                key,
                fingerprint=hashlib.sha256(message.body).digest(),
                namespace=namespace,
                ttl=ttl,
                lease=lease,
            ) as job:
                if job.done:
                    await message.ack()  # applied before: the earlier ack was lost
                    return
                result = await handler(message)
                await job.store(result if result is not None else True)
        except InProgress:
            await message.nack(requeue=True)  # another consumer holds it: let the broker offer it again
            return
        except (KeyReused, OutcomeUnknown) as exc:
            logger.error("idem_asgi: message %r rejected (dead-lettered): %s", key, exc)
            await message.reject(requeue=False)
            return
        except Exception:
            logger.exception("idem_asgi: handler failed on message %r; requeued", key)
            await message.nack(requeue=True)
            return
        await message.ack()

    return on_message
