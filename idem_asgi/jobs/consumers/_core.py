"""What both consumer adapters share: reading a delivery, applying it once, holding it, settling it.

`Delivery` reads a message's key and fingerprint (a reader that raises, or a message without a key,
is malformed: dead-lettered at once with the reason, never retried). `applied` runs the claim core
for one delivery and says how to settle it (`Settle`, with the reason of a dead letter).
`held_until_decided` keeps a delivery that cannot be decided yet (the store is down, or the same
message still runs in this process). `Consumer` is the broker callback: each delivery's work runs
in a task of its own that the broker's cancellation does not reach, and the consumer drains on a
graceful stop.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import hashlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Final, NamedTuple

import anyio
import msgspec

from ...backends import Backend
from ...claims.recovery import RecoverHook
from ...claims.session import Runtime
from ...claims.surfaces import MESSAGE
from ...errors import BackendError, WrongAnswer
from ...observe import Observer
from ..decorator import InProgress, JobTerms, KeyReused, OutcomeUnknown, _runtime, claimed

logger = logging.getLogger("idem_asgi")
Handler = Callable[[Any], Awaitable[Any]]
KeyOf = Callable[[Any], Any]
"""Reads a message's key (a str, bytes, or None for no key) from the message the broker delivered."""
PrintOf = Callable[[Any], "bytes | str"]
"""Reads what makes two deliveries of one key the same message (hashed into the fingerprint)."""


class Settle(enum.Enum):
    """What to tell the broker about one delivery."""

    ACK = "ack"  # applied now or before
    RETRY = "retry"  # hand it back: the broker redelivers it (after a backoff) and counts the attempt
    DEAD = "dead"  # dead-letter it now: retrying cannot help
    STORE_DOWN = "store_down"  # the store could not make the claim: nothing ran, try again later
    HELD_HERE = "held_here"  # a delivery of this message still runs in this process: wait for it here


class Verdict(NamedTuple):
    """How to settle one delivery, and why (for a dead letter: what a person reads)."""

    settle: Settle
    reason: str = ""


HOLD: Final = (Settle.STORE_DOWN, Settle.HELD_HERE)
"""Settles that keep the delivery in this process and try again."""


class Malformed(Exception):
    """A message that can never be applied: no key, or a key or fingerprint that cannot be read."""


class Delivery(NamedTuple):
    """A message's key and fingerprint, read once per delivery."""

    key: str
    fingerprint: bytes


def body_of(message: Any) -> bytes:
    """The body of an aio-pika message (`body`) or a nats-py one (`data`)."""
    body = getattr(message, "body", None)
    return bytes(message.data if body is None else body)


class Reader:
    """How a consumer reads its messages: the key's source and the fingerprint's."""

    __slots__ = ("fingerprint", "key")

    def __init__(
        self,
        adapter: str,
        header: str | None,
        field: str | None,
        key: KeyOf | None,
        default: KeyOf,
        fingerprint: PrintOf | Iterable[str] | None,
        body: Callable[[Any], bytes] = body_of,
    ) -> None:
        if sum(source is not None for source in (header, field, key)) > 1:
            raise ValueError(f"{adapter} keys a message by one source: header=, field= or key=, not two")
        if key is not None:
            self.key = key
        elif header is not None:
            self.key = lambda message: (message.headers or {}).get(header)
        elif field is not None:
            self.key = lambda message: _field_of(body(message), field)
        else:
            self.key = default
        self.fingerprint = _print_reader(fingerprint, body)

    def read(self, message: Any) -> Delivery:
        """The delivery's key and fingerprint; `Malformed` (with the reason) when it has none."""
        try:
            raw = self.key(message)
        except Exception as exc:
            raise Malformed(f"its key cannot be read: {type(exc).__name__}: {exc}") from None
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        if raw is None or raw == "":
            raise Malformed("it has no key")
        try:
            printed = self.fingerprint(message)
        except Exception as exc:
            raise Malformed(f"its fingerprint cannot be read: {type(exc).__name__}: {exc}") from None
        return Delivery(str(raw), MESSAGE + printed)


def _print_reader(given: PrintOf | Iterable[str] | None, body: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """SHA-256 of the body (default), of the JSON body's named top-level fields (a publisher that
    rebuilds a `sent_at` stamp on retry still sends the same message), or of what a callable reads."""
    if given is None:
        return lambda message: hashlib.sha256(body(message)).digest()
    if callable(given):
        func = given

        def custom(message: Any) -> bytes:
            value = func(message)
            return hashlib.sha256(value.encode() if isinstance(value, str) else bytes(value)).digest()

        return custom
    fields = tuple(sorted(given))

    def picked(message: Any) -> bytes:
        document = json.loads(body(message))
        if not isinstance(document, dict):
            raise ValueError("the body is not a JSON object")
        return hashlib.sha256(_ordered({f: document.get(f) for f in fields})).digest()

    return picked


_ordered = msgspec.msgpack.Encoder(order="deterministic").encode


def _field_of(body: bytes, field: str) -> Any:
    try:
        return json.loads(body).get(field)
    except (ValueError, AttributeError):
        return None


def body_digest(message: Any) -> str:
    """`key=body_digest`: the body's SHA-256 (hex) as the key, for publishers that set no stable id
    (an outbox relay republishing a row): the same body is the same message. Only when the body
    itself says what makes a message unique (an order id): two deliberate identical bodies are
    applied once."""
    return hashlib.sha256(body_of(message)).hexdigest()


class Claiming(NamedTuple):
    """What a consumer claims every delivery with, built once: the core's runtime over its store, its
    terms and its recover hook."""

    runtime: Runtime
    terms: JobTerms
    recover: RecoverHook | None

    @classmethod
    def of(
        cls,
        backend: Backend,
        namespace: str,
        *,
        ttl: float,
        lease: float,
        wait: float,
        recover: RecoverHook | None,
        observer: Observer | None,
    ) -> Claiming:
        return cls(_runtime(backend, observer), JobTerms(namespace, lease, ttl, wait), recover)


async def applied(delivery: Delivery, run: Callable[[], Awaitable[Any]], claiming: Claiming) -> Verdict:
    """Run `run()` once per key and say how to settle the delivery: the broker-neutral core of both
    adapters (see the package docstring)."""
    key = delivery.key
    held = None
    runtime, terms = claiming.runtime, claiming.terms
    try:
        async with claimed(
            runtime, terms, key, None, delivery.fingerprint, claiming.recover, applied_if_committed=True
        ) as job:
            if job.done:
                return Verdict(Settle.ACK)  # applied before: the earlier ack was lost
            held = job.claim
            try:
                result = await run()
            except Exception as exc:  # the handler's own, even a nested job's InProgress or KeyReused
                raise _HandlerFailed from exc
            await job.store(result if result is not None else True)
    except InProgress as running:
        # Still running in this process (a redelivery after its channel closed): it ends here, so
        # wait for it rather than hand it back (a redelivery counts toward the broker's limit).
        # Another consumer holds it: let the broker offer it again.
        return Verdict(Settle.HELD_HERE if running.here else Settle.RETRY)
    except KeyReused:
        return _dead(key, "its key was used before with another message (another body, or the fields compared)")
    except OutcomeUnknown:
        return _dead(key, "its first run stopped without an outcome (outcome unknown): reconcile it")
    except WrongAnswer as exc:
        return _dead(key, f"the recover hook's answer was refused: {exc}")
    except Exception as exc:
        if held is None and isinstance(exc, BackendError):  # the claim itself failed: nothing ran
            logger.debug("idem_asgi: message %r not applied, the store could not claim it: %s", key, exc)
            return Verdict(Settle.STORE_DOWN)
        if held is not None and held.effect:  # after its effect (or its result): the claim is kept, outcome unknown
            logger.exception("idem_asgi: message %r failed after its effect; dead-lettered", key)
            return Verdict(Settle.DEAD, "it failed after its effect (outcome unknown): reconcile it")
        logger.exception("idem_asgi: message %r failed before any effect; handed back to the broker", key)
        return Verdict(Settle.RETRY)
    return Verdict(Settle.ACK)


def _dead(key: str, reason: str) -> Verdict:
    logger.error("idem_asgi: message %r dead-lettered: %s", key, reason)
    return Verdict(Settle.DEAD, reason)


def malformed(exc: Malformed) -> Verdict:
    """A message that can never be applied: dead-lettered at once, with the reason."""
    logger.error("idem_asgi: a message was dead-lettered: %s", exc)
    return Verdict(Settle.DEAD, str(exc))


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
    delivery: `applied` for a key and body given directly."""
    if key is None:
        return malformed(Malformed("it has no key")).settle
    delivery = Delivery(key, MESSAGE + hashlib.sha256(body).digest())
    claiming = Claiming.of(backend, namespace, ttl=ttl, lease=lease, wait=wait, recover=recover, observer=observer)
    return (await applied(delivery, run, claiming)).settle


class _HandlerFailed(Exception):
    """The handler raised (its exception is the cause): never read as the message's own verdict."""


FIRST_BACKOFF: Final = 0.05
MAX_BACKOFF: Final = 2.0


async def held_until_decided(
    attempt: Callable[[], Awaitable[Verdict]], hold: float | None, stopping: asyncio.Event
) -> Verdict:
    """Try the delivery again in this process, holding it, while it cannot be decided yet: the store
    could not make the claim (nothing ran), or a delivery of the same message still runs in this
    process (it ends here). Nothing is redelivered or counted toward the broker's delivery limit,
    and the held delivery keeps its prefetch / `max_ack_pending` slot, so no new messages come
    while the store is down. After `hold` seconds (None: until decided), or once the consumer stops,
    the undecided verdict goes back to the caller."""
    deadline = None if hold is None else time.monotonic() + hold
    delay = FIRST_BACKOFF
    verdict = await attempt()
    if verdict.settle not in HOLD:
        return verdict
    if verdict.settle is Settle.STORE_DOWN:
        logger.warning(
            "idem_asgi: the store cannot claim a message; holding it and retrying (backoff up to %gs)", MAX_BACKOFF
        )
    while verdict.settle in HOLD:
        pause = delay * random.uniform(0.5, 1.0)  # jitter: held messages do not retry in step
        if deadline is not None:
            if time.monotonic() >= deadline:
                return verdict
            pause = min(pause, deadline - time.monotonic())
        if await stopped(stopping, pause):
            return verdict  # undecided here: another consumer takes it
        delay = min(delay * 2, MAX_BACKOFF)
        verdict = await attempt()
    logger.info("idem_asgi: a held message was settled (%s)", verdict.settle.value)
    return verdict


async def stopped(stopping: asyncio.Event, within: float) -> bool:
    """Wait up to `within` seconds for the consumer to stop; whether it did."""
    if within > 0 and not stopping.is_set():
        with anyio.move_on_after(within):
            await stopping.wait()
    return stopping.is_set()


RETRY_FIRST: Final = 0.5
RETRY_MAX: Final = 30.0


def retry_backoff(delivered: int) -> float:
    """How long a message whose handler failed waits before it is offered again, by how many times
    it was delivered: 0.5 s, doubling, at most 30 s. A poison message on a consumer with no delivery
    limit is then retried a few times a minute, not in a hot loop."""
    return min(RETRY_FIRST * 2.0 ** max(delivered - 1, 0), RETRY_MAX)


async def settled(call: Awaitable[object], key: str | None) -> None:
    """Settle a delivery; on a channel or connection that closed meanwhile the broker redelivers it,
    and the redelivery finds what this one stored."""
    try:
        await call
    except Exception as exc:
        logger.info("idem_asgi: could not settle message %r (%r); the broker redelivers it", key, exc)


STOP_TIMEOUT: Final = 30.0
"""Seconds a consumer's `async with` block waits, when it ends, for the deliveries still running."""
Work = Callable[[Any, asyncio.Event], Awaitable[None]]
Detach = Callable[[Any], "bool | Awaitable[bool]"]
"""Whether the callback may return once a delivery's work started (the client needs no wait)."""


class _Deliveries:
    """A consumer's deliveries being worked on, and whether it is stopping."""

    __slots__ = ("detach", "running", "stop_timeout", "stopping", "work")

    def __init__(self, work: Work, stop_timeout: float, detach: Detach | None) -> None:
        self.work = work
        self.detach = detach
        self.stop_timeout = stop_timeout
        self.running: set[asyncio.Task[None]] = set()
        self.stopping: asyncio.Event | None = None

    def event(self) -> asyncio.Event:
        if self.stopping is None:
            self.stopping = asyncio.Event()
        return self.stopping


async def _deliver(deliveries: _Deliveries, message: Any) -> None:
    """The broker's callback: start the delivery's work in a task of its own, and wait for it (or,
    when `detach` says so, a push subscription's: return at once, so the client hands over its next
    message). A cancellation of the callback (the channel or subscription ended) never reaches it."""
    work = asyncio.ensure_future(deliveries.work(message, deliveries.event()))
    deliveries.running.add(work)
    work.add_done_callback(deliveries.running.discard)
    detach = deliveries.detach
    if detach is not None:
        detached = detach(message)
        if detached is True or (detached is not False and await detached):
            work.add_done_callback(_logged)  # nobody awaits it: its error is logged
            return
    await asyncio.shield(work)


def _logged(work: asyncio.Task[None]) -> None:
    if not work.cancelled() and (exc := work.exception()) is not None:
        logger.error("idem_asgi: a delivery's work failed: %r", exc, exc_info=exc)


class Consumer(functools.partial[Coroutine[Any, Any, None]]):
    """A broker callback (`await consumer(message)`) whose work runs in a task of its own.

    The broker's client may cancel the callback (its channel or subscription ended); the work goes on
    (`asyncio.shield`): its handler finishes, its result is stored, and its settle call fails on the
    closed channel, harmlessly (the redelivery is acked without running). Used as `async with`, it
    drains when the block ends: no new delivery is worked on, and the running ones get up to
    `stop_timeout` seconds to finish. (A `functools.partial` of a coroutine function, so aio-pika and
    nats-py, which accept only coroutine functions as callbacks, take it as one.)"""

    def __new__(cls, work: Work, stop_timeout: float, detach: Detach | None = None) -> Consumer:
        return super().__new__(cls, _deliver, _Deliveries(work, stop_timeout, detach))

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
