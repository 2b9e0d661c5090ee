"""The same guarantee for background jobs: `@idempotent` runs an async function once per key and
returns its stored result to every repeat, in the same stores and records as HTTP requests.

    @idempotent(backend, key=lambda order_id, amount: f"charge:{order_id}")
    async def charge(order_id: str, amount: int) -> Receipt: ...

The record is an ordinary one (a 200 `StoredResponse` whose body is the msgpack-encoded result), so
`stale()`, `reconcile` and the `idem-asgi` CLI see jobs as they see requests. The fingerprint covers
the arguments (msgpack of the bound arguments, or of the `fingerprint=` ones): the same key with
other arguments raises `KeyReused`. A repeat while the first still runs waits up to `wait` seconds,
then raises `InProgress`; a holder that died (lease over, outcome unknown) raises `OutcomeUnknown`.
An exception releases the claim (the next call runs again) unless the function called
`mark_effect()` on its `JobClaim` first (then the claim is kept, outcome unknown), as on HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from contextvars import ContextVar
from typing import Any, Final, ParamSpec, TypeVar, get_type_hints

import anyio
import msgspec

from ._decide import Action, decide
from .backends import Backend
from .errors import ConfigurationError, IdemError
from .observe import Event, EventName, Observer
from .records import Claimed, Existing, RecordKey, StoredResponse

P = ParamSpec("P")
R = TypeVar("R")
_KIND: Final = [(b"content-type", b"application/x-msgpack"), (b"x-idem-job", b"1")]
_encode = msgspec.msgpack.Encoder().encode


class JobError(IdemError):
    """Base of the errors a repeated job can raise instead of running."""


class InProgress(JobError):
    """The first call with this key is still running (after waiting `wait` seconds)."""


class KeyReused(JobError):
    """The key was used before with other arguments."""


class OutcomeUnknown(JobError):
    """A call with this key started and its holder stopped without an outcome: reconcile it."""


class JobClaim:
    """What the running call holds: its key, and `mark_effect()` for after an irreversible effect."""

    __slots__ = ("effect", "key", "token")

    def __init__(self, key: RecordKey, token: int) -> None:
        self.key = key
        self.token = token
        self.effect = False

    def mark_effect(self) -> None:
        """After this, an exception keeps the claim (outcome unknown) instead of releasing it."""
        self.effect = True


_current: ContextVar[JobClaim | None] = ContextVar("idem_asgi_job", default=None)


def _fingerprint(values: Any) -> bytes:
    try:
        return hashlib.sha256(_encode(values)).digest()
    except (TypeError, msgspec.EncodeError) as exc:
        raise ConfigurationError(
            f"idempotent: the arguments cannot be fingerprinted ({exc}); pass fingerprint=[names of encodable ones]"
        ) from None


@contextlib.asynccontextmanager
async def claim(
    backend: Backend,
    key: str,
    *,
    fingerprint: bytes = b"",
    namespace: str = "jobs",
    scope: str | None = None,
    ttl: float = 86_400,
    lease: float = 30,
    wait: float = 0,
    observer: Observer | None = None,
) -> AsyncIterator[Job]:
    """The context-manager form: `async with claim(backend, "k") as job:` then `job.done` and
    `job.result` (stored bytes, for a repeat), or run and `job.store(value)`. `observer` gets the
    same `Event`s as the middleware's, with the namespace as their `route`."""
    rkey = RecordKey.build(namespace, scope, key)

    def emit(name: EventName) -> None:
        if observer is not None:
            _notify(observer, Event(name, namespace, key, scope or None))

    result = await backend.claim(rkey, fingerprint, lease=lease, ttl=ttl)
    with anyio.move_on_after(wait):
        delay = 0.01
        while isinstance(result, Existing) and decide(result, fingerprint) is Action.IN_PROGRESS:
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.25)
            result = await backend.claim(rkey, fingerprint, lease=lease, ttl=ttl)
    if isinstance(result, Existing):
        action = decide(result, fingerprint)
        if action is Action.REPLAY and result.record.response is not None:
            emit("replayed")
            yield Job(backend, rkey, None, ttl, result.record.response.body)
            return
        if action is Action.MISMATCH:
            emit("mismatch")
            raise KeyReused(f"job key {key!r} was used before with other arguments")
        if action is Action.IN_PROGRESS:
            emit("conflict")
            raise InProgress(f"job key {key!r} is still running")
        emit("outcome_unknown")
        raise OutcomeUnknown(f"job key {key!r}: its first run stopped without an outcome; reconcile it")
    assert isinstance(result, Claimed)
    emit("claimed")
    job = Job(backend, rkey, JobClaim(rkey, result.token), ttl, None)
    renewal = asyncio.get_running_loop().create_task(_renew(backend, rkey, result.token, lease))
    current = _current.set(job.claim)  # `current_job()` inside the block, as in a decorated function
    try:
        yield job
    except BaseException:
        with anyio.CancelScope(shield=True):
            if job.claim is not None and job.claim.effect:
                await backend.mark_failed(rkey, result.token)
                emit("unresolved")
            else:
                await backend.release(rkey, result.token)
                emit("released")
        raise
    finally:
        renewal.cancel()
        with contextlib.suppress(ValueError):  # left in another context than entered: nothing to restore here
            _current.reset(current)
    if job.stored:
        emit("completed")
    else:
        with anyio.CancelScope(shield=True):
            await backend.release(rkey, result.token)  # the block ended without a result: nothing happened
        emit("released")


def _notify(observer: Observer, event: Event) -> None:
    try:
        observer(event)
    except Exception:  # observability never fails a job
        logging.getLogger("idem_asgi").exception("idem_asgi: observer failed on %r", event.name)


class Job:
    """One `claim` block: a repeat's stored `result`, or the running call's `store(value)`."""

    __slots__ = ("_backend", "_ttl", "claim", "key", "result", "stored")

    def __init__(self, backend: Backend, key: RecordKey, held: JobClaim | None, ttl: float, result: bytes | None):
        self._backend = backend
        self._ttl = ttl
        self.key = key
        self.claim = held
        self.result = result
        self.stored = False

    @property
    def done(self) -> bool:
        """A repeat: `result` holds the first call's stored value (msgpack bytes)."""
        return self.claim is None

    async def store(self, value: Any) -> bytes:
        """Store the result (msgspec-encodable) for every repeat; returns its bytes.

        The work is done by now: a store that fails here keeps the claim (outcome unknown), never
        releases it for a second run; a claim taken over meanwhile raises `OutcomeUnknown`."""
        assert self.claim is not None, "a repeat has nothing to store"
        answer = stored_result(value)
        self.claim.mark_effect()
        if not await self._backend.complete(self.key, self.claim.token, answer, ttl=self._ttl):
            raise OutcomeUnknown(f"job key {self.key.key!r}: its claim was taken over while it ran; result not stored")
        self.stored = True
        return answer.body


def stored_result(value: Any) -> StoredResponse:
    """A job's result as its record holds it: what a `reconcile` resolver returns for a job whose
    outcome it found out (the next call then returns `value` without running)."""
    return StoredResponse(200, list(_KIND), _encode(value))


async def _renew(backend: Backend, key: RecordKey, token: int, lease: float) -> None:
    while True:
        await anyio.sleep(lease / 3)
        with contextlib.suppress(Exception):  # a failed renewal is retried at the next tick
            await backend.extend(key, token, lease=lease)


def idempotent(
    backend: Backend,
    *,
    key: Callable[..., str] | None = None,
    args: Iterable[str] = (),
    fingerprint: Iterable[str] | None = None,
    namespace: str | None = None,
    scope: Callable[..., str | None] | None = None,
    ttl: float = 86_400,
    lease: float = 30,
    wait: float = 0,
    observer: Observer | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Run the decorated async function once per key; repeats get the stored result (decoded to the
    function's return annotation).

    Args:
        key: Called with the function's arguments, returns the key; or
        args: The names of the arguments the key is made of (`"<name>=<value>"` joined).
        fingerprint: The argument names compared on a repeat (default: all of them).
        scope: Called with the arguments, returns the owner (tenant) the key belongs to.
        ttl, lease: As on a route; the lease is renewed while the function runs.
        wait: Seconds a repeat of a running call waits for its result before `InProgress`.
        namespace: The key space; default `jobs:<module>.<qualified name>` of the function, so two
            functions keyed by the same arguments never return each other's results (pass one to
            keep records across a rename). The decorated function's `.namespace` says which.
        observer: Called with an `Event` at each decision, as the middleware's (route = namespace).
    """
    names = tuple(args)
    if (key is None) == (not names):
        raise ConfigurationError("idempotent needs exactly one of key=callable or args=[argument names]")

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        signature = inspect.signature(func)
        returns = get_type_hints(func).get("return", Any)
        compared = None if fingerprint is None else tuple(fingerprint)
        decode = msgspec.msgpack.Decoder(returns).decode
        space = namespace if namespace is not None else f"jobs:{func.__module__}.{func.__qualname__}"

        @functools.wraps(func)
        async def run(*a: P.args, **kw: P.kwargs) -> R:
            bound = signature.bind(*a, **kw)
            bound.apply_defaults()
            values = bound.arguments
            the_key = key(*a, **kw) if key is not None else ",".join(f"{n}={values[n]}" for n in names)
            owner = scope(*a, **kw) if scope is not None else None
            picked = values if compared is None else {n: values[n] for n in compared}
            async with claim(
                backend,
                the_key,
                fingerprint=_fingerprint(picked),
                namespace=space,
                scope=owner,
                ttl=ttl,
                lease=lease,
                wait=wait,
                observer=observer,
            ) as job:
                if job.done:
                    assert job.result is not None
                    return decode(job.result)  # type: ignore[no-any-return]
                value = await func(*a, **kw)
                await job.store(value)
                return value

        run.namespace = space  # type: ignore[attr-defined]
        return run

    return decorate


def current_job() -> JobClaim | None:
    """The claim of the `@idempotent` call or `claim` block running now (for `mark_effect()`; a
    consumer adapter's handler runs in one), or None."""
    return _current.get()
