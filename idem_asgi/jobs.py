"""The same guarantee for background jobs: `@idempotent` runs an async function once per key and
returns its stored result to every repeat, in the same stores and records as HTTP requests.

    @idempotent(backend, key=lambda order_id, amount: f"charge:{order_id}")
    async def charge(order_id: str, amount: int) -> Receipt: ...

The record is an ordinary one (a 200 `StoredResponse` whose body is the msgpack-encoded result), so
`stale()`, `reconcile` and the `idem-asgi` CLI see jobs as they see requests. The fingerprint covers
the arguments (canonical msgpack of the bound arguments, or of the `fingerprint=` ones, see
`_job_args`): the same key with other arguments raises `KeyReused`. A repeat while the first still
runs waits up to `wait` seconds, then raises `InProgress`; a holder that died (lease over, outcome
unknown) raises `OutcomeUnknown`. An exception releases the claim (the next call runs again) unless
the function called `mark_effect()` on its `JobClaim` first (then the claim is kept, outcome
unknown), as on HTTP. While a job runs, `current_idempotency()` holds its claim, so
`PostgresBackend.transaction()` and `checkpoint()` act for it as they do behind the middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, Final, ParamSpec, TypeVar

import anyio
import msgspec

from . import _job_args, context
from ._decide import Action, decide
from ._job_args import args_key
from ._job_checks import checked_function, checked_returns, default_namespace
from ._late_writes import LateWrites
from .backends import Backend
from .errors import ConfigurationError
from .errors import InProgress as InProgress  # re-exported: public imports from idem_asgi.jobs keep working
from .errors import JobError as JobError
from .errors import KeyReused as KeyReused
from .errors import OutcomeUnknown as OutcomeUnknown
from .errors import ResultNotStorable as ResultNotStorable
from .observe import Event, EventName, Observer
from .records import Claimed, Existing, RecordKey, StoredResponse

P = ParamSpec("P")
R = TypeVar("R")
_KIND: Final = [(b"content-type", b"application/x-msgpack"), (b"x-idem-job", b"1")]
_encode = msgspec.msgpack.Encoder().encode
logger = logging.getLogger("idem_asgi")
_late: weakref.WeakKeyDictionary[Backend, LateWrites] = weakref.WeakKeyDictionary()
"""Per store, the job results whose completion write failed, written again in the background."""


class JobClaim(context.HeldClaim):
    """What the running call holds: its key, and `mark_effect()` for after an irreversible effect."""

    __slots__ = ()

    @property
    def key(self) -> RecordKey:
        """The record's key (`key.key` is the job's key, to forward to a provider)."""
        assert self._rkey is not None
        return self._rkey


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
    same `Event`s as the middleware's, with the namespace as their `route`. Inside the block
    `current_job()` and `current_idempotency()` hold the claim."""
    rkey = RecordKey.build(namespace, scope, key)

    def emit(name: EventName) -> None:
        if observer is not None:
            _notify(observer, Event(name, namespace, key, scope or None))

    result = await _claimed(backend, rkey, fingerprint, lease=lease, ttl=ttl, wait=wait)
    if isinstance(result, Existing):
        yield Job(backend, rkey, None, ttl, _repeat(result, fingerprint, key, emit), emit)
        return
    emit("claimed")
    held = JobClaim(backend, rkey, result.token)
    job = Job(backend, rkey, held, ttl, None, emit)
    renewal = asyncio.get_running_loop().create_task(_renew(backend, rkey, result.token, lease))
    current = context.enter(context.IdempotencyInfo(key, scope or None, held))
    try:
        yield job
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _settle(backend, job, emit)
        raise
    finally:
        renewal.cancel()
        held.active = False
        with contextlib.suppress(ValueError):  # left in another context than entered: nothing to restore here
            context.leave(current)
    with anyio.CancelScope(shield=True):
        await _settle(backend, job, emit)


async def _claimed(
    backend: Backend, rkey: RecordKey, fingerprint: bytes, *, lease: float, ttl: float, wait: float
) -> Claimed | Existing:
    """Claim `rkey`; while another call holds it, ask again for up to `wait` seconds."""
    result = await backend.claim(rkey, fingerprint, lease=lease, ttl=ttl)
    with anyio.move_on_after(wait):
        delay = 0.01
        while isinstance(result, Existing) and decide(result, fingerprint) is Action.IN_PROGRESS:
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.25)
            result = await backend.claim(rkey, fingerprint, lease=lease, ttl=ttl)
    return result


def _repeat(result: Existing, fingerprint: bytes, key: str, emit: Callable[[EventName], None]) -> bytes:
    """The stored result of a completed first call, or the typed refusal for every other state."""
    action = decide(result, fingerprint)
    if action is Action.REPLAY and result.record.response is not None:
        emit("replayed")
        return result.record.response.body
    if action is Action.MISMATCH:
        emit("mismatch")
        raise KeyReused(f"job key {key!r} was used before with other arguments")
    if action is Action.IN_PROGRESS:
        emit("conflict")
        raise InProgress(f"job key {key!r} is still running")
    emit("outcome_unknown")
    raise OutcomeUnknown(f"job key {key!r}: its first run stopped without an outcome; reconcile it")


async def _settle(backend: Backend, job: Job, emit: Callable[[EventName], None]) -> None:
    """End a run: stored (nothing to do), kept as outcome unknown after an effect (whether the
    block raised or just ended without a result), else released."""
    held = job.claim
    assert held is not None
    if job.stored:
        emit("store_error" if job.late else "completed")
    elif held.effect:
        await backend.mark_failed(job.key, held.token)
        emit("unresolved")
    else:  # it raised before any effect, or ended without an effect or a result: nothing happened
        await backend.release(job.key, held.token)
        emit("released")


def _notify(observer: Observer, event: Event) -> None:
    try:
        observer(event)
    except Exception:  # observability never fails a job
        logger.exception("idem_asgi: observer failed on %r", event.name)


class Job:
    """One `claim` block: a repeat's stored `result`, or the running call's `store(value)`."""

    __slots__ = ("_backend", "_emit", "_ttl", "claim", "key", "late", "result", "stored")

    def __init__(
        self,
        backend: Backend,
        key: RecordKey,
        held: JobClaim | None,
        ttl: float,
        result: bytes | None,
        emit: Callable[[EventName], None],
    ) -> None:
        self._backend = backend
        self._emit = emit
        self._ttl = ttl
        self.key = key
        self.claim = held
        self.result = result
        self.stored = False
        self.late = False  # the completion write failed and is being retried in the background

    @property
    def done(self) -> bool:
        """A repeat: `result` holds the first call's stored value (msgpack bytes)."""
        return self.claim is None

    async def store(self, value: Any, *, returns: Any = Any) -> bytes:
        """Store the result for every repeat; returns its bytes.

        The work is done by now, so the effect is marked first: a value msgspec cannot encode (or,
        with `returns=`, one that would not decode as that type) raises `ResultNotStorable`, and a
        claim is kept (outcome unknown), never released for a second run. A completion write that
        fails (store down, reply lost) is retried in the background for a while, as the
        middleware's are, and the result returned: repeats meanwhile see the call in progress.
        A claim taken over meanwhile raises `OutcomeUnknown`."""
        held = self.claim
        if held is None:
            raise JobError(f"job key {self.key.key!r} is a repeat: its result is job.result, there is nothing to store")
        if self.stored:
            raise JobError(f"job key {self.key.key!r}: its result was already stored")
        held.mark_effect()
        answer = _sealed(self.key.key, value, returns)
        try:
            stored = await self._backend.complete(self.key, held.token, answer, ttl=self._ttl)
        except Exception as exc:
            self._retry_later(answer, held.token, exc)
            stored = True
        if not stored:
            raise OutcomeUnknown(f"job key {self.key.key!r}: its claim was taken over while it ran; result not stored")
        self.stored = True
        held.active = False
        return answer.body

    def _retry_later(self, answer: StoredResponse, token: int, exc: Exception) -> None:
        """Hand a failed completion write to the store's `LateWrites`; raise `exc` when it is full."""
        backend = self._backend
        late = _late.get(backend)
        if late is None:
            late = _late[backend] = LateWrites(functools.partial(_alive, weakref.ref(backend)))
        if not late.complete(self.key, token, answer, self._ttl, self._emit):
            raise exc  # too many pending: the claim is kept (the effect is marked), outcome unknown
        logger.warning("idem_asgi: could not store the result of job key %r (%r); retrying it", self.key.key, exc)
        self.late = True


def _alive(ref: weakref.ref[Backend]) -> Backend:
    """The store a late write goes to (held weakly: a pending write never keeps a store alive)."""
    backend = ref()
    if backend is None:
        raise ConfigurationError("the store of this job was garbage-collected before its result was written")
    return backend


def _sealed(key: str, value: Any, returns: Any) -> StoredResponse:
    """`stored_result(value)`, refused unless a repeat would decode it as `returns`."""
    try:
        answer = stored_result(value)
        if returns is not Any:
            _decoder(returns).decode(answer.body)
    except (TypeError, ValueError, OverflowError, msgspec.MsgspecError) as exc:
        raise ResultNotStorable(
            f"job key {key!r}: its result ({type(value).__name__}) cannot be stored: {exc}. The work ran, so "
            "the claim is kept as outcome-unknown (reconcile it); return a value msgspec encodes as the annotation"
        ) from exc
    return answer


@functools.lru_cache(maxsize=256)
def _decoder(returns: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(returns)


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
    """Run the decorated `async def` function once per key; repeats get the stored result (decoded
    to the function's return annotation; without one, as msgspec's natural types).

    Args:
        key: Called with the function's arguments, returns the key; or
        args: The names of the arguments the key is made of (`name=value` joined by `,`, typed and
            unambiguous: see `_job_args`).
        fingerprint: The argument names compared on a repeat (default: all of them).
        scope: Called with the arguments, returns the owner (tenant) the key belongs to.
        ttl: Seconds a result is kept and returned to repeats, as on a route.
        lease: Seconds a claim lives without renewal, as on a route; renewed while the function runs.
        wait: Seconds a repeat of a running call waits for its result before `InProgress`.
        namespace: The key space; default `jobs:<module>.<qualified name>` of the function, so two
            functions keyed by the same arguments never return each other's results (pass one to
            keep records across a rename). A default that would not be the same in every process
            (module `__main__`, a function defined inside another, a wrapper's name) is refused:
            name one. The decorated function's `.namespace` says which.
        observer: Called with an `Event` at each decision, as the middleware's (route = namespace).

    Raises:
        ConfigurationError: At decoration, for what cannot be made safe: not an `async def`
            function (sync functions, generators), an unstable default namespace, a return
            annotation msgspec cannot encode and decode, an `args=` name the function lacks.
    """
    names = tuple(args)
    if (key is None) == (not names):
        raise ConfigurationError("idempotent needs exactly one of key=callable or args=[argument names]")

    def decorate(func: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        signature = checked_function(func, names)
        returns = checked_returns(func)
        compared = None if fingerprint is None else tuple(fingerprint)
        decode = _decoder(returns).decode
        space = namespace if namespace is not None else default_namespace(func)

        @functools.wraps(func)
        async def run(*a: P.args, **kw: P.kwargs) -> R:
            bound = signature.bind(*a, **kw)
            bound.apply_defaults()
            values = bound.arguments
            the_key = key(*a, **kw) if key is not None else args_key(values, names)
            owner = scope(*a, **kw) if scope is not None else None
            picked = values if compared is None else {n: values[n] for n in compared}
            async with claim(
                backend,
                the_key,
                fingerprint=_job_args.fingerprint(picked),
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
                await job.store(value, returns=returns)
                return value

        run.namespace = space  # type: ignore[attr-defined]
        return run

    return decorate


def current_job() -> JobClaim | None:
    """The claim of the `@idempotent` call or `claim` block running now (for `mark_effect()`; a
    consumer adapter's handler runs in one), or None."""
    info = context.current_idempotency()
    held = None if info is None else info._claim
    return held if isinstance(held, JobClaim) else None
