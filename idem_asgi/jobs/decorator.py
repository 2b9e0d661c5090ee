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

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, ParamSpec, TypeVar

import anyio
import msgspec

from ..backends import Backend
from ..claims import context
from ..claims.decide import Action
from ..claims.late_writes import LateWrites
from ..claims.leases import Leases
from ..claims.session import ClaimSession, Runtime
from ..claims.waiting import Waiters
from ..errors import ConfigurationError
from ..errors import InProgress as InProgress  # re-exported: public imports from idem_asgi.jobs keep working
from ..errors import JobError as JobError
from ..errors import KeyReused as KeyReused
from ..errors import OutcomeUnknown as OutcomeUnknown
from ..errors import ResultNotStorable as ResultNotStorable
from ..observe import Observer
from ..records import JOB_MARK, Claimed, ClaimResult, Existing, RecordKey, StoredResponse
from . import args as _job_args
from .args import args_key
from .checks import checked_function, checked_returns, default_namespace

P = ParamSpec("P")
R = TypeVar("R")
_KIND: Final = [(b"content-type", b"application/x-msgpack"), JOB_MARK]
_encode = msgspec.msgpack.Encoder().encode


class JobClaim(ClaimSession):
    """What the running call holds: its key, and `mark_effect()` for after an irreversible effect."""

    __slots__ = ()

    @property
    def key(self) -> RecordKey:
        """The record's key (`key.key` is the job's key, to forward to a provider)."""
        assert self.rkey is not None
        return self.rkey


@dataclass(frozen=True, slots=True)
class JobTerms:
    """A job's claim terms; its events name the namespace as their route."""

    label: str
    lease: float
    ttl: float
    wait: float


class _Shared(NamedTuple):
    """What the jobs of one store share: one lease renewer, one late-write retrier, the repeats held."""

    leases: Leases
    late: LateWrites
    waiters: Waiters


_shared: weakref.WeakKeyDictionary[Backend, _Shared] = weakref.WeakKeyDictionary()
"""Per store (held weakly: nothing here refers back to it)."""


def _runtime(backend: Backend, observer: Observer | None) -> Runtime:
    shared = _shared.get(backend)
    if shared is None:
        shared = _shared[backend] = _Shared(Leases(3600.0), LateWrites(), Waiters())  # ticks at lease / 3
    return Runtime(backend, shared.leases, shared.late, shared.waiters, observer)


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
    `current_job()` and `current_idempotency()` hold the claim, and its lease is renewed."""
    async with _claimed(
        _runtime(backend, observer), JobTerms(namespace, lease, ttl, wait), key, scope, fingerprint
    ) as job:
        yield job


@contextlib.asynccontextmanager
async def _claimed(rt: Runtime, terms: JobTerms, key: str, scope: str | None, fingerprint: bytes) -> AsyncIterator[Job]:
    """`claim`, driving the core: a repeat's `Job`, or the running one's under a renewed lease."""
    session = JobClaim(rt, terms)
    session.rkey = RecordKey.build(terms.label, scope, key)
    session.fingerprint = fingerprint
    action, outcome = await session.decided(await session.claim(), None)
    if action is not Action.RUN:
        yield Job(session, _repeat(session, action, outcome))
        return
    assert isinstance(outcome, Claimed)
    session.begin(outcome.token)
    job = Job(session, None)
    current = context.enter(context.IdempotencyInfo(key, scope or None, session))
    try:
        yield job
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _settle(job)
        raise
    finally:
        if session.active:
            session.stop()
        with contextlib.suppress(ValueError):  # left in another context than entered: nothing to restore here
            context.leave(current)
    with anyio.CancelScope(shield=True):
        await _settle(job)


def _repeat(session: JobClaim, action: Action, outcome: ClaimResult | StoredResponse) -> bytes:
    """The stored result of a completed first call, or the typed refusal for every other state."""
    key = session.key.key
    if action is Action.REPLAY:
        if isinstance(outcome, StoredResponse):  # handed over by the call running in this process
            return outcome.body
        assert isinstance(outcome, Existing) and outcome.record.response is not None
        return outcome.record.response.body
    if action is Action.MISMATCH:
        raise KeyReused(f"job key {key!r} was used before with other arguments")
    if action is Action.IN_PROGRESS:
        raise InProgress(f"job key {key!r} is still running")
    if action is Action.EXPIRED:
        session.emit("outcome_unknown")
    raise OutcomeUnknown(f"job key {key!r}: its first run stopped without an outcome; reconcile it")


async def _settle(job: Job) -> None:
    """End a run: stored (nothing to do), kept as outcome unknown after an effect (whether the
    block raised or just ended without a result), else released (nothing happened)."""
    session = job.claim
    assert session is not None
    if not job.stored:
        await session.end(None, keep=session.effect)


class Job:
    """One `claim` block: a repeat's stored `result`, or the running call's `store(value)`."""

    __slots__ = ("_session", "claim", "late", "result", "stored")

    def __init__(self, session: JobClaim, result: bytes | None) -> None:
        self._session = session
        self.claim = None if result is not None else session
        self.result = result
        self.stored = False
        self.late = False  # the completion write failed and is being retried in the background

    @property
    def key(self) -> RecordKey:
        return self._session.key

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
        session = self.claim
        if session is None:
            raise JobError(f"job key {self.key.key!r} is a repeat: its result is job.result, there is nothing to store")
        if self.stored:
            raise JobError(f"job key {self.key.key!r}: its result was already stored (store() is called once)")
        session.mark_effect()
        answer = _sealed(self.key.key, value, returns)
        session.stop()
        settled = await session.complete(answer)
        if settled == "lost":
            raise OutcomeUnknown(f"job key {self.key.key!r}: its claim was taken over while it ran; result not stored")
        if settled == "dropped":
            raise OutcomeUnknown(
                f"job key {self.key.key!r}: its result could not be stored (the store failed, and too many writes "
                "wait for it); the claim is kept as outcome-unknown: reconcile it"
            )
        self.stored = True
        self.late = settled == "late"
        return answer.body


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
    compared = None if fingerprint is None else tuple(fingerprint)
    spec = _Spec(backend, key, names, compared, scope, namespace, JobTerms("", lease, ttl, wait), observer)
    return functools.partial(_decorate, spec)


@dataclass(frozen=True, slots=True)
class _Spec:
    """What `@idempotent(...)` was given, for `_decorate`."""

    backend: Backend
    key: Callable[..., str] | None
    names: tuple[str, ...]
    compared: tuple[str, ...] | None
    scope: Callable[..., str | None] | None
    namespace: str | None
    terms: JobTerms  # its label (the namespace) is filled in per function
    observer: Observer | None


def _decorate(spec: _Spec, func: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The checks made at decoration, and the wrapper that claims, runs and stores."""
    signature = checked_function(func, spec.names)
    returns = checked_returns(func)
    decode = _decoder(returns).decode
    space = spec.namespace if spec.namespace is not None else default_namespace(func)
    terms = dataclasses.replace(spec.terms, label=space)
    key, names, compared, scope = spec.key, spec.names, spec.compared, spec.scope

    @functools.wraps(func)
    async def run(*a: P.args, **kw: P.kwargs) -> R:
        bound = signature.bind(*a, **kw)
        bound.apply_defaults()
        values = bound.arguments
        the_key = key(*a, **kw) if key is not None else args_key(values, names)
        owner = scope(*a, **kw) if scope is not None else None
        picked = values if compared is None else {n: values[n] for n in compared}
        rt = _runtime(spec.backend, spec.observer)
        async with _claimed(rt, terms, the_key, owner, _job_args.fingerprint(picked)) as job:
            if job.done:
                assert job.result is not None
                return decode(job.result)  # type: ignore[no-any-return]
            value = await func(*a, **kw)
            await job.store(value, returns=returns)
            return value

    run.namespace = space  # type: ignore[attr-defined]
    return run


def current_job() -> JobClaim | None:
    """The claim of the `@idempotent` call or `claim` block running now (for `mark_effect()`; a
    consumer adapter's handler runs in one), or None."""
    info = context.current_idempotency()
    held = None if info is None else info._claim
    return held if isinstance(held, JobClaim) else None
