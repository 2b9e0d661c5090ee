"""Message consumers that apply each message once: RabbitMQ (aio-pika) and NATS JetStream (nats-py).

A broker delivers at least once: a consumer that dies after the effect and before its ack gets the
message redelivered, to itself or to another consumer. Both adapters wrap your handler in
`idem_asgi.jobs.decorator.claim`, keyed by a message id, a header or a JSON body field, and settle each
delivery the same way:

- first delivery: run the handler, store that it ran (and what it returned), then ack;
- a duplicate of a message already applied: ack without running the handler;
- a duplicate while another consumer still runs it: wait up to `wait` seconds for that outcome
  (then ack), else hand it back to the broker for later (a redelivery counts toward the bound
  below, so an immediate hand-back would dead-letter the duplicates of a slow message);
- the handler raised: the claim is released and the message handed back, so the broker counts the
  attempt and its bound (RabbitMQ quorum queue `x-delivery-limit`, JetStream consumer
  `max_deliver`) ends a poison message's retries instead of looping forever;
- the store could not make the claim (down, a failover, durable replicas not confirming it):
  nothing ran, so the delivery is held and its claim retried in this process with growing backoff
  (up to 2 s apart) until the store answers; no redelivery counts toward the bound below, and a
  held delivery keeps its prefetch / `max_ack_pending` slot, so the consumer takes no new messages
  meanwhile. Never a dead letter (RabbitMQ: after `store_hold` seconds it is requeued, below the
  broker's `consumer_timeout`);
- no key, another body under the same key, or an outcome unknown (the handler called
  `current_job().mark_effect()`, then failed; its result could not be encoded; or a consumer died
  mid-handler and its lease ran out): dead-lettered at once (RabbitMQ reject without requeue;
  JetStream `term`), for a person.

Each consumer's work has a key space of its own (`namespace`): NATS derives it from the stream
and the durable (an ephemeral or ordered consumer, whose name is random, must be given one),
RabbitMQ needs it named (a message does not say which queue it came from).

**Interruptions.** Both brokers' clients cancel the callback's task when its channel or subscription
ends (a channel error, `consumer_timeout`, a lost connection, `nc.close()`, `unsubscribe()`, a
`drain()` past its timeout). The adapters run each delivery's work (claim, handler, store write,
ack) in a task of their own that such a cancellation does not reach: the handler finishes and its
result is stored, and the redelivery finds it and is acked without running. Each adapter is an
`async with` block (`async with rabbitmq_handler(...) as on_message:`): leaving it (a graceful stop
cancelling the main task, SIGINT under `asyncio.run`) takes no new delivery and waits for the
running ones to finish (`drain()`, up to `stop_timeout`), before the connection is closed. Work
still cancelled after that (the process exits) counts as a crash: the claim is kept to its lease,
never released, and recovery resolves it on the redelivery (`recover=`; a Postgres `transaction()`
that never committed runs again once; one that committed is acked as applied).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import hashlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Final

import anyio

from ..backends import Backend
from ..claims.recovery import RecoverHook
from ..claims.surfaces import MESSAGE
from ..errors import BackendError, WrongAnswer
from ..observe import Observer
from .decorator import InProgress, JobTerms, KeyReused, OutcomeUnknown, _runtime, claimed
from .nats import ConsumerBook, namespace_of, progress_interval

logger = logging.getLogger("idem_asgi")
Handler = Callable[[Any], Awaitable[Any]]


class Settle(enum.Enum):
    """What to tell the broker about one delivery."""

    ACK = "ack"  # applied now or before
    RETRY = "retry"  # hand it back: the broker redelivers it and counts the attempt
    DEAD = "dead"  # dead-letter it now: retrying cannot help
    STORE_DOWN = "store_down"  # the store could not make the claim: nothing ran, try again later
    HELD_HERE = "held_here"  # a delivery of this message still runs in this process: wait for it here


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
    recover: RecoverHook | None = None,
    observer: Observer | None = None,
) -> Settle:
    """Run `run()` once per key (fingerprinted by the body's SHA-256) and say how to settle the
    delivery; the broker-neutral core of both adapters."""
    if key is None:
        logger.error("idem_asgi: a message without a key was dead-lettered")
        return Settle.DEAD
    held = None
    terms = JobTerms(namespace, lease, ttl, wait)
    printed = MESSAGE + hashlib.sha256(body).digest()
    try:
        async with claimed(
            _runtime(backend, observer), terms, key, None, printed, recover, applied_if_committed=True
        ) as job:
            if job.done:
                return Settle.ACK  # applied before: the earlier ack was lost
            held = job.claim
            try:
                result = await run()
            except Exception as exc:  # the handler's own, even a nested job's InProgress or KeyReused
                raise _HandlerFailed from exc
            await job.store(result if result is not None else True)
    except InProgress as running:
        # Still running in this process (a redelivery after its channel closed): it will end here,
        # so wait for it rather than hand it back (a redelivery counts toward the broker's limit).
        # Another consumer holds it: let the broker offer it again.
        return Settle.HELD_HERE if running.here else Settle.RETRY
    except (KeyReused, OutcomeUnknown, WrongAnswer) as exc:
        logger.error("idem_asgi: message %r dead-lettered: %s", key, exc)
        return Settle.DEAD
    except Exception as exc:
        if held is None and isinstance(exc, BackendError):  # the claim itself failed: nothing ran
            logger.debug("idem_asgi: message %r not applied, the store could not claim it: %s", key, exc)
            return Settle.STORE_DOWN
        if held is not None and held.effect:  # after its effect (or its result): the claim is kept, outcome unknown
            logger.exception("idem_asgi: message %r failed after its effect; dead-lettered", key)
            return Settle.DEAD
        logger.exception("idem_asgi: message %r failed before any effect; handed back to the broker", key)
        return Settle.RETRY
    return Settle.ACK


class _HandlerFailed(Exception):
    """The handler raised (its exception is the cause): never read as the message's own verdict."""


KeyOf = Callable[[Any], Any]
"""Reads a message's key (a str, bytes, or None for no key) from the message the broker delivered."""


def body_digest(message: Any) -> str:
    """`key=body_digest`: the body's SHA-256 (hex) as the key, for publishers that set no stable id
    (an outbox relay republishing a row): the same body is the same message. Only when the body
    itself says what makes a message unique (an order id): two deliberate identical bodies are
    applied once."""
    body = getattr(message, "body", None)
    return hashlib.sha256(message.data if body is None else body).hexdigest()


def _key_reader(adapter: str, header: str | None, field: str | None, key: KeyOf | None, default: KeyOf) -> KeyOf:
    """The one source of a message's key: `header=`, `field=` (of a JSON body), `key=`, or `default`."""
    if sum(source is not None for source in (header, field, key)) > 1:
        raise ValueError(f"{adapter} keys a message by one source: header=, field= or key=, not two")
    if key is not None:
        return key
    if header is not None:
        return lambda message: (message.headers or {}).get(header)
    if field is not None:
        return lambda message: _field_of(_body(message), field)
    return default


def _body(message: Any) -> bytes:
    body = getattr(message, "body", None)
    return bytes(message.data if body is None else body)


_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 2.0
STOP_TIMEOUT = 30.0
"""Seconds a consumer's `async with` block waits, when it ends, for the deliveries still running."""


_HOLD: Final = (Settle.STORE_DOWN, Settle.HELD_HERE)


async def _held_until_decided(
    attempt: Callable[[], Awaitable[Settle]], hold: float | None, stopping: asyncio.Event
) -> Settle:
    """Try the delivery again in this process, holding it, while it cannot be decided yet: the store
    could not make the claim (nothing ran), or a delivery of the same message still runs in this
    process (it ends here). Nothing is redelivered or counted toward the broker's delivery limit,
    and the held delivery keeps its prefetch / `max_ack_pending` slot, so no new messages come
    while the store is down. After `hold` seconds (None: until decided), or once the consumer stops,
    the undecided settle goes back to the caller."""
    deadline = None if hold is None else time.monotonic() + hold
    delay = _FIRST_BACKOFF
    settle = await attempt()
    if settle not in _HOLD:
        return settle
    if settle is Settle.STORE_DOWN:
        logger.warning(
            "idem_asgi: the store cannot claim a message; holding it and retrying (backoff up to %gs)", _MAX_BACKOFF
        )
    while settle in _HOLD:
        pause = delay * random.uniform(0.5, 1.0)  # jitter: held messages do not retry in step
        if deadline is not None:
            if time.monotonic() >= deadline:
                return settle
            pause = min(pause, deadline - time.monotonic())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), pause)
        if stopping.is_set():
            return settle  # undecided here: another consumer takes it
        delay = min(delay * 2, _MAX_BACKOFF)
        settle = await attempt()
    logger.info("idem_asgi: a held message was settled (%s)", settle.value)
    return settle


class _Deliveries:
    """A consumer's deliveries being worked on, and whether it is stopping."""

    __slots__ = ("running", "stop_timeout", "stopping", "work")

    def __init__(self, work: Callable[[Any, asyncio.Event], Awaitable[None]], stop_timeout: float) -> None:
        self.work = work
        self.stop_timeout = stop_timeout
        self.running: set[asyncio.Task[None]] = set()
        self.stopping: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        if self.stopping is None:
            self.stopping = asyncio.Event()
        return self.stopping


async def _deliver(deliveries: _Deliveries, message: Any) -> None:
    """The broker's callback: start the delivery's work in a task of its own, and wait for it. A
    cancellation of the callback (the channel or subscription ended) does not reach the work."""
    work = asyncio.ensure_future(deliveries.work(message, deliveries.event()))
    deliveries.running.add(work)
    work.add_done_callback(deliveries.running.discard)
    await asyncio.shield(work)


class Consumer(functools.partial[Coroutine[Any, Any, None]]):
    """A broker callback (`await consumer(message)`) whose work runs in a task of its own.

    The broker's client may cancel the callback (its channel or subscription ended); the work goes on
    (`asyncio.shield`): its handler finishes, its result is stored, and its settle call fails on the
    closed channel, harmlessly (the redelivery is acked without running). Used as `async with`, it
    drains when the block ends: no new delivery is worked on, and the running ones get up to
    `stop_timeout` seconds to finish. (A `functools.partial` of a coroutine function, so aio-pika and
    nats-py, which accept only coroutine functions as callbacks, take it as one.)"""

    def __new__(cls, work: Callable[[Any, asyncio.Event], Awaitable[None]], stop_timeout: float) -> Consumer:
        return super().__new__(cls, _deliver, _Deliveries(work, stop_timeout))

    @property
    def _deliveries(self) -> _Deliveries:
        deliveries: _Deliveries = self.args[0]
        return deliveries

    @property
    def running(self) -> int:
        """Deliveries being worked on now."""
        return len(self._deliveries.running)

    @property
    def stopping(self) -> bool:
        """True once `drain()` began: new deliveries are left to the broker."""
        stopping = self._deliveries.stopping
        return stopping is not None and stopping.is_set()

    async def drain(self, within: float | None = None) -> bool:
        """Stop taking deliveries and wait for the running ones to finish (store and settle); True
        when all did within `within` seconds (None: however long they take)."""
        deliveries = self._deliveries
        deliveries.event().set()
        deadline = None if within is None else time.monotonic() + within
        while deliveries.running:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            await asyncio.wait(set(deliveries.running), timeout=left)
        if deliveries.running:
            logger.warning(
                "idem_asgi: %d deliveries still running after %s s of draining; if the process exits now they "
                "count as crashes (kept to their lease, resolved on redelivery)",
                len(deliveries.running),
                within,
            )
            return False
        return True

    async def __aenter__(self) -> Consumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):  # a graceful stop cancels the task leaving this block
            await self.drain(self._deliveries.stop_timeout)


def rabbitmq_handler(
    backend: Backend,
    handler: Handler,
    *,
    namespace: str,
    header: str | None = None,
    field: str | None = None,
    key: KeyOf | None = None,
    ttl: float = 7 * 86_400,
    lease: float = 30,
    wait: float = 10,
    store_hold: float = 900,
    recover: RecoverHook | None = None,
    stop_timeout: float = STOP_TIMEOUT,
    observer: Observer | None = None,
) -> Consumer:
    """An aio-pika `on_message` callback (`await queue.consume(rabbitmq_handler(store, handle))`)
    that applies each message once; see the module docstring. The key is the message's
    `message_id` unless `header=`, `field=` (a top-level JSON body field) or `key=` (a callable
    given the message, e.g. `body_digest`) names another. aio-pika gives a message published
    without a `message_id` a random one, so a republished body would be a new message: publish
    with a stable id (`Message(body, message_id=...)`) or key by the business field. Retries are
    `nack(requeue=True)`; give the queue an `x-delivery-limit` (quorum queue) and a dead-letter
    exchange to bound them. While the store cannot claim a message the delivery is held for up to
    `store_hold` seconds (keep it below the broker's `consumer_timeout`, 30 min by default, or
    RabbitMQ closes the channel), then requeued. `recover` is asked about a message whose consumer
    died mid-handler (as a route's hook; return `stored_result(value)` when it was applied).

    `namespace` is the key space of this queue's work, e.g. the queue's name: two queues that get
    the same messages for different work (a fanout exchange) each need their own, or the second
    would find every message already applied and never run. A message carries nothing that names
    its queue, so there is no default.

    Run it as `async with rabbitmq_handler(...) as on_message:` inside the connection's block, so a
    graceful stop drains it (up to `stop_timeout` s) before the connection closes."""
    key_of = _key_reader("rabbitmq_handler", header, field, key, lambda message: message.message_id)
    claiming: dict[str, Any] = {
        "namespace": namespace,
        "ttl": ttl,
        "lease": lease,
        "wait": wait,
        "recover": recover,
        "observer": observer,
    }

    async def work(message: Any, stopping: asyncio.Event) -> None:
        if stopping.is_set():
            return  # stopping: left unsettled, the broker gives it to another consumer when the channel closes
        message_key = _key_of(key_of(message))
        attempt = functools.partial(
            apply_once, backend, message_key, message.body, lambda: handler(message), **claiming
        )
        settle = await _held_until_decided(attempt, store_hold, stopping)
        if settle in _HOLD and stopping.is_set():
            return  # left unsettled: requeued when the channel closes
        await _settled(_settle_rabbitmq(message, settle, message_key, store_hold), message_key)

    return Consumer(work, stop_timeout)


def nats_handler(
    backend: Backend,
    handler: Handler,
    *,
    header: str | None = None,
    field: str | None = None,
    key: KeyOf | None = None,
    namespace: str | None = None,
    ttl: float = 7 * 86_400,
    lease: float = 30,
    wait: float = 10,
    retry_delay: float | None = None,
    progress_every: float | None = None,
    recover: RecoverHook | None = None,
    stop_timeout: float = STOP_TIMEOUT,
    observer: Observer | None = None,
) -> Consumer:
    """A nats-py JetStream callback (`await js.subscribe(subject, durable=..., cb=nats_handler(store,
    handle), manual_ack=True)`, or called on each message a pull subscription fetches) that applies
    each message once; see the module docstring. The key is the `Nats-Msg-Id` header (the one
    JetStream also uses for its publish de-duplication window) unless `header=` names another,
    `field=` a top-level JSON body field or `key=` a callable given the message. Retries are
    `nak(delay=retry_delay)`; the consumer's `max_deliver` bounds them (JetStream then publishes a
    MAX_DELIVERIES advisory), dead letters are `term()` (a MSG_TERMINATED advisory). While the
    store cannot claim a message, the delivery is held (kept with `in_progress()`) until it can.
    `recover` is asked about a message whose consumer died mid-handler (as a route's hook).

    On a consumer's first message the adapter reads its config (consumer info, once). `namespace`
    defaults to `nats:<stream>:<durable>`: the consumers of one durable share a key space, and two
    durables doing different work on the same stream never see each other's records; an ephemeral
    or ordered consumer (a random name) without `namespace=` is refused with `ConfigurationError`.
    While the handler runs (or a duplicate waits) the adapter sends `in_progress()` every
    `progress_every` seconds (default: the smallest of `lease / 3`, 5 s and a third of the
    consumer's `ack_wait`; one above half the `ack_wait` is refused), so a handler longer than
    `ack_wait` is not redelivered to another consumer meanwhile.

    Run it as `async with nats_handler(...) as on_message:` inside the connection's block, so a
    graceful stop drains it (up to `stop_timeout` s) before `nc.close()`."""
    key_of = _key_reader("nats_handler", header, field, key, lambda msg: (msg.headers or {}).get("Nats-Msg-Id"))
    if progress_every is not None and progress_every <= 0:
        raise ValueError(f"progress_every must be positive, got {progress_every!r}")
    book = ConsumerBook()
    claiming: dict[str, Any] = {"ttl": ttl, "lease": lease, "wait": wait, "recover": recover, "observer": observer}

    async def work(msg: Any, stopping: asyncio.Event) -> None:
        if stopping.is_set():
            await _settled(msg.nak(), None)  # stopping: another subscriber takes it now
            return
        facts = await book.facts(msg)
        space = namespace_of(facts, namespace)
        attempt = functools.partial(
            apply_once, backend, _key_of(key_of(msg)), msg.data, lambda: handler(msg), namespace=space, **claiming
        )
        ticker = asyncio.ensure_future(_in_progress(msg, progress_interval(facts, progress_every, lease)))
        try:
            settle = await _held_until_decided(attempt, None, stopping)
        finally:
            ticker.cancel()
        if settle is Settle.ACK:
            await _settled(msg.ack(), None)
        elif settle is Settle.DEAD:
            await _settled(msg.term(), None)
        else:
            await _settled(msg.nak(delay=retry_delay), None)

    return Consumer(work, stop_timeout)


async def _settled(call: Awaitable[None], key: str | None) -> None:
    """Settle a delivery; on a channel or connection that closed meanwhile the broker redelivers it,
    and the redelivery finds what this one stored."""
    try:
        await call
    except Exception as exc:
        logger.info("idem_asgi: could not settle message %r (%r); the broker redelivers it", key, exc)


async def _settle_rabbitmq(message: Any, settle: Settle, key: str | None, held: float) -> None:
    """Ack, dead-letter (reject without requeue) or requeue (a nack the quorum queue counts)."""
    if settle is Settle.ACK:
        await message.ack()
    elif settle is Settle.DEAD:
        await message.reject(requeue=False)
    else:
        if settle is Settle.STORE_DOWN:
            logger.error("idem_asgi: message %r held %gs, the store still down; requeued", key, held)
        await message.nack(requeue=True)


async def _in_progress(msg: Any, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await msg.in_progress()
        except Exception:  # a closed connection: the redelivery it allows is still applied once
            return
