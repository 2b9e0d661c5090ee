"""Message consumers that apply each message once: RabbitMQ (aio-pika) and NATS JetStream (nats-py).

A broker delivers at least once: a consumer that dies after the effect and before its ack gets the
message redelivered, to itself or to another consumer. Both adapters wrap your handler in
`idem_asgi.jobs.claim`, keyed by a message id, a header or a JSON body field, and settle each
delivery the same way:

- first delivery: run the handler, store that it ran (and what it returned), then ack;
- a duplicate of a message already applied: ack without running the handler;
- a duplicate while another consumer still runs it: wait up to `wait` seconds for that outcome
  (then ack), else hand it back to the broker for later (a redelivery counts toward the bound
  below, so an immediate hand-back would dead-letter the duplicates of a slow message);
- the handler raised: the claim is released and the message handed back, so the broker counts the
  attempt and its bound (RabbitMQ quorum queue `x-delivery-limit`, JetStream consumer
  `max_deliver`) ends a poison message's retries instead of looping forever;
- no key, another body under the same key, or an outcome unknown (the handler called
  `current_job().mark_effect()`, then failed; its result could not be encoded; or a consumer died
  mid-handler and its lease ran out): dead-lettered at once (RabbitMQ reject without requeue;
  JetStream `term`), for a person.

Each consumer's work has a key space of its own (`namespace`): NATS derives it from the stream
and the durable, RabbitMQ needs it named (a message does not say which queue it came from).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .backends import Backend
from .jobs import InProgress, KeyReused, OutcomeUnknown, claim
from .observe import Observer

logger = logging.getLogger("idem_asgi")
Handler = Callable[[Any], Awaitable[Any]]


class Settle(enum.Enum):
    """What to tell the broker about one delivery."""

    ACK = "ack"  # applied now or before
    RETRY = "retry"  # hand it back: the broker redelivers it and counts the attempt
    DEAD = "dead"  # dead-letter it now: retrying cannot help


def _key_of(value: Any) -> str | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return None if value is None or value == "" else str(value)


def _field_of(body: bytes, field: str) -> Any:
    try:
        return json.loads(body).get(field)
    except (ValueError, AttributeError):
        return None


async def apply_once(
    backend: Backend,
    key: str | None,
    body: bytes,
    run: Callable[[], Awaitable[Any]],
    *,
    namespace: str,
    ttl: float,
    lease: float,
    wait: float,
    observer: Observer | None = None,
) -> Settle:
    """Run `run()` once per key (fingerprinted by the body's SHA-256) and say how to settle the
    delivery; the broker-neutral core of both adapters."""
    if key is None:
        logger.error("idem_asgi: a message without a key was dead-lettered")
        return Settle.DEAD
    held = None
    try:
        async with claim(
            backend,
            key,
            fingerprint=hashlib.sha256(body).digest(),
            namespace=namespace,
            ttl=ttl,
            lease=lease,
            wait=wait,
            observer=observer,
        ) as job:
            if job.done:
                return Settle.ACK  # applied before: the earlier ack was lost
            held = job.claim
            try:
                result = await run()
            except Exception as exc:  # the handler's own, even a nested job's InProgress or KeyReused
                raise _HandlerFailed from exc
            await job.store(result if result is not None else True)
    except InProgress:
        return Settle.RETRY  # another consumer holds it: let the broker offer it again
    except (KeyReused, OutcomeUnknown) as exc:
        logger.error("idem_asgi: message %r dead-lettered: %s", key, exc)
        return Settle.DEAD
    except Exception:
        if held is not None and held.effect:  # after its effect (or its result): the claim is kept, outcome unknown
            logger.exception("idem_asgi: message %r failed after its effect; dead-lettered", key)
            return Settle.DEAD
        logger.exception("idem_asgi: message %r failed before any effect; handed back to the broker", key)
        return Settle.RETRY
    return Settle.ACK


class _HandlerFailed(Exception):
    """The handler raised (its exception is the cause): never read as the message's own verdict."""


def _one_key_source(adapter: str, header: str | None, field: str | None) -> None:
    if header is not None and field is not None:
        raise ValueError(f"{adapter} keys a message by one source: header= or field=, not both")


def rabbitmq_handler(
    backend: Backend,
    handler: Handler,
    *,
    namespace: str,
    header: str | None = None,
    field: str | None = None,
    ttl: float = 7 * 86_400,
    lease: float = 30,
    wait: float = 10,
    observer: Observer | None = None,
) -> Callable[[Any], Awaitable[None]]:
    """An aio-pika `on_message` callback (`await queue.consume(rabbitmq_handler(store, handle))`)
    that applies each message once; see the module docstring. The key is the message's
    `message_id` unless `header=` or `field=` (a top-level JSON body field) names another; publish
    with a stable id (`Message(body, message_id=...)`). Retries are `nack(requeue=True)`; give the
    queue an `x-delivery-limit` (quorum queue) and a dead-letter exchange to bound them.

    `namespace` is the key space of this queue's work, e.g. the queue's name: two queues that get
    the same messages for different work (a fanout exchange) each need their own, or the second
    would find every message already applied and never run. A message carries nothing that names
    its queue, so there is no default."""
    _one_key_source("rabbitmq_handler", header, field)

    async def on_message(message: Any) -> None:
        if header is not None:
            raw = (message.headers or {}).get(header)
        elif field is not None:
            raw = _field_of(message.body, field)
        else:
            raw = message.message_id
        settle = await apply_once(
            backend,
            _key_of(raw),
            message.body,
            lambda: handler(message),
            namespace=namespace,
            ttl=ttl,
            lease=lease,
            wait=wait,
            observer=observer,
        )
        if settle is Settle.ACK:
            await message.ack()
        elif settle is Settle.RETRY:
            await message.nack(requeue=True)
        else:
            await message.reject(requeue=False)

    return on_message


def nats_handler(
    backend: Backend,
    handler: Handler,
    *,
    header: str | None = None,
    field: str | None = None,
    namespace: str | None = None,
    ttl: float = 7 * 86_400,
    lease: float = 30,
    wait: float = 10,
    retry_delay: float | None = None,
    progress_every: float | None = None,
    observer: Observer | None = None,
) -> Callable[[Any], Awaitable[None]]:
    """A nats-py JetStream callback (`await js.subscribe(subject, durable=..., cb=nats_handler(store,
    handle), manual_ack=True)`, or called on each message a pull subscription fetches) that applies
    each message once; see the module docstring. The key is the `Nats-Msg-Id` header (the one
    JetStream also uses for its publish de-duplication window) unless `header=` names another or
    `field=` a top-level JSON body field. Retries are `nak(delay=retry_delay)`; the consumer's
    `max_deliver` bounds them (JetStream then publishes a MAX_DELIVERIES advisory), dead letters
    are `term()` (a MSG_TERMINATED advisory). `namespace` defaults to `nats:<stream>:<consumer>`
    from each message's metadata: the consumers of one durable share a key space, and two durables
    doing different work on the same stream never see each other's records. While the handler
    runs (or a duplicate waits) the adapter sends `in_progress()` every `progress_every` seconds
    (default: the smaller of `lease / 3` and 5 s; keep the consumer's `ack_wait` above it), so a
    handler longer than `ack_wait` is not redelivered to another consumer meanwhile."""
    _one_key_source("nats_handler", header, field)
    source = header or "Nats-Msg-Id"
    every = progress_every if progress_every is not None else min(lease / 3, 5.0)
    if every <= 0:
        raise ValueError(f"progress_every must be positive, got {progress_every!r}")

    async def on_message(msg: Any) -> None:
        headers: Mapping[str, str] = msg.headers or {}
        raw = _field_of(msg.data, field) if field is not None else headers.get(source)

        space = namespace if namespace is not None else f"nats:{msg.metadata.stream}:{msg.metadata.consumer}"
        ticker = asyncio.ensure_future(_in_progress(msg, every))
        try:
            settle = await apply_once(
                backend,
                _key_of(raw),
                msg.data,
                lambda: handler(msg),
                namespace=space,
                ttl=ttl,
                lease=lease,
                wait=wait,
                observer=observer,
            )
        finally:
            ticker.cancel()
        if settle is Settle.ACK:
            await msg.ack()
        elif settle is Settle.RETRY:
            await msg.nak(delay=retry_delay)
        else:
            await msg.term()

    return on_message


async def _in_progress(msg: Any, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await msg.in_progress()
        except Exception:  # a closed connection: the redelivery it allows is still applied once
            return
