"""The same guarantee for background jobs: `@idempotent` runs an async function once per key and
returns its stored result to every repeat, in the same stores and records as HTTP requests.

    @idempotent(backend, key=lambda order_id, amount: f"charge:{order_id}")
    async def charge(order_id: str, amount: int) -> Receipt: ...

The record is an ordinary one (a 200 `StoredResponse` whose body is the msgpack-encoded result, its
fingerprint marked as a job's: `claims.surfaces`), so `stale()`, `reconcile` and the `idem-asgi` CLI
see jobs as they see requests. The fingerprint covers the arguments (see `_job_args`): the same key
with other arguments raises `KeyReused`. A repeat while the first still runs waits up to `wait`
seconds, then raises `InProgress`; a holder that died (lease over, outcome unknown) raises
`OutcomeUnknown`, unless `recover=` says what happened.

How a run ends, as on HTTP:

- it returned: its result is stored before the call returns (a write the store fails is retried,
  and the caller waits for it, up to `late_writes.WINDOW`);
- it raised: the claim is released (the next call runs again), unless the function called
  `mark_effect()` on its `JobClaim` first: then the claim is kept, outcome unknown;
- it was interrupted (cancelled by a timeout around the call or a graceful stop, `KeyboardInterrupt`,
  `SystemExit`): like a crash, the claim is kept to its lease and never released, since the work may
  have had its effect. Recovery then resolves it (`recover=`, `reconcile`, the CLI); a claim whose
  Postgres `transaction()` never committed runs again once by itself.

While a job runs, `current_idempotency()` holds its claim, so `PostgresBackend.transaction()` and
`checkpoint()` act for it as they do behind the middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, ParamSpec, TypeVar

import anyio
import msgspec

from .. import context
from .._logging import redact
from ..backends import Backend
from ..claims.decide import Action
from ..claims.recovery import RecoverHook
from ..claims.session import ClaimSession, Recover, Runtime
from ..claims.surfaces import JOB, expect_results
from ..errors import ConfigurationError, WrongAnswer
from ..errors import InProgress as InProgress  # re-exported: public imports from idem_asgi.jobs keep working
from ..errors import JobError as JobError
from ..errors import KeyReused as KeyReused
from ..errors import OutcomeUnknown as OutcomeUnknown
from ..errors import ResultNotStorable as ResultNotStorable
from ..observe import Observer
from ..records import JOB_MARK, Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from . import args as _job_args
from .args import args_key
from .checks import checked_function, checked_returns, default_namespace

P = ParamSpec("P")
R = TypeVar("R")
_KIND: Final = [(b"content-type", b"application/x-msgpack"), JOB_MARK]
_encode = msgspec.msgpack.Encoder().encode
logger = logging.getLogger("idem_asgi")


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
    replay_ttl: float | None = None  # a job's result lives as long as its key


def _runtime(backend: Backend, observer: Observer | None) -> Runtime:
    """The core's runtime over the store's one machinery in this process (shared with HTTP)."""
    return Runtime.of(backend, observer)


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
    recover: RecoverHook | None = None,
    observer: Observer | None = None,
) -> AsyncIterator[Job]:
    """The context-manager form: `async with claim(backend, "k") as job:` then `job.done` and
    `job.result` (stored bytes, for a repeat), or run and `job.store(value)`. `observer` gets the
    same `Event`s as the middleware's, with the namespace as their `route`; `recover` is asked about
    a claim whose holder died (as a route's). Inside the block `current_job()` and
    `current_idempotency()` hold the claim, and its lease is renewed."""
    terms = JobTerms(namespace, lease, ttl, wait)
    async with claimed(_runtime(backend, observer), terms, key, scope, JOB + fingerprint, recover) as job:
        yield job


@contextlib.asynccontextmanager
async def claimed(
    rt: Runtime,
    terms: JobTerms,
    key: str,
    scope: str | None,
    fingerprint: bytes,
    recover: RecoverHook | None,
    *,
    applied_if_committed: bool = False,
) -> AsyncIterator[Job]:
    """`claim`, driving the core: a repeat's `Job`, or the running one's under a renewed lease.
    `fingerprint` carries its surface's prefix (`claims.surfaces`); `applied_if_committed` (a
    message): a claim whose holder died after its `transaction()` committed counts as applied."""
    session = JobClaim(rt, terms)
    session.rkey = RecordKey.build(terms.label, scope, key)
    session.fingerprint = fingerprint
    action, outcome = await session.decided(
        await session.claim(), _recovery(session, recover, applied_if_committed=applied_if_committed)
    )
    if action is not Action.RUN:
        yield Job(session, _repeat(session, action, outcome))
        return
    assert isinstance(outcome, Claimed)
    session.begin(outcome.token)
    job = Job(session, None)
    current = context.enter(context.IdempotencyInfo(key, scope or None, session))
    try:
        yield job
    except Exception:
        with anyio.CancelScope(shield=True):
            await _settle(job)
        raise
    except BaseException:  # cancelled (a timeout around the call, a graceful stop), KeyboardInterrupt, SystemExit
        _interrupted(job)
        raise
    finally:
        if session.active:
            session.stop()
        with contextlib.suppress(ValueError):  # left in another context than entered: nothing to restore here
            context.leave(current)
    if not job.stored:  # (stored: nothing left to settle, and no cancel scope to pay for)
        with anyio.CancelScope(shield=True):
            await _settle(job)


def _recovery(session: JobClaim, hook: RecoverHook | None, *, applied_if_committed: bool) -> Recover | None:
    """What the core asks about an expired claim: the `recover` hook (as on HTTP; one that raises
    counts as "unknown"), then, for a message, an effect committed (Postgres `transaction()`) counts as
    applied. Without either, the core's own rule stays: an uncommitted `transaction()` runs again."""
    if hook is None and not applied_if_committed:
        return None

    async def recover(record: Record) -> StoredResponse | Literal["run"] | None:
        outcome: StoredResponse | Literal["run"] | None = None
        if hook is not None:
            try:
                outcome = await hook(session.key, record)
            except Exception as exc:  # its text may carry a provider's key or token
                logger.warning(
                    "idem_asgi: recover hook failed for job key %r: %s: %s",
                    session.key.key,
                    type(exc).__name__,
                    redact(str(exc)),
                )
                outcome = None
        if outcome is None and applied_if_committed and record.effect_committed:
            return stored_result(True)  # its effect committed with its claim: the message was applied
        return outcome

    return recover


def _interrupted(job: Job) -> None:
    """The run was interrupted after its claim, before its result was stored: like a crash, the
    claim is kept to its lease (the work may have had its effect), never released."""
    if job.stored:
        return  # its result is stored (or being written): nothing is left undone
    session = job._session
    session.stop()
    session.ended(None)
    session.emit("interrupted")
    logger.warning(
        "idem_asgi: job key %r was interrupted after its claim (cancelled or stopping): kept to its lease, "
        "like a crash, so it is not run again until recovery resolves it",
        session.key.key,
    )


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
        running = InProgress(f"job key {key!r} is still running")
        running.here = isinstance(outcome, Existing) and session.rt.holds(session.key.digest, outcome.record.token)
        raise running
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
        if settled == "late":  # the caller waits for the retried write (a short-lived process must not exit first)
            self.late = not await _landed(session)
        return answer.body


async def _landed(session: JobClaim) -> bool:
    """Wait for the completion write being retried in the background; whether it landed. Cancelling
    the wait leaves the write going (it still counts as held)."""
    task = session.rt.late.task(session.key.digest, session.token)
    if task is None:
        return True
    return await asyncio.shield(task)


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


def stored_result(value: Any, *, returns: Any = Any) -> StoredResponse:
    """A job's result as its record holds it: what a `recover` hook or a `reconcile` resolver returns
    for a job (or a message) whose outcome it found out; the next call then returns `value` without
    running. With `returns` (or as `<job>.stored_result(value)`, which passes the job's return type),
    a value that would not decode as that type raises `WrongAnswer` now, not at every later call."""
    answer = StoredResponse(200, list(_KIND), _encode(value))
    if returns is not Any:
        try:
            _decoder(returns).decode(answer.body)
        except msgspec.ValidationError as exc:
            raise WrongAnswer(
                f"stored_result: {type(value).__name__} does not decode as the job's return type "
                f"{getattr(returns, '__qualname__', repr(returns))} ({exc}); pass a value of that type"
            ) from None
    return answer


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
    recover: RecoverHook | None = None,
    observer: Observer | None = None,
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """Run the decorated `async def` function once per key; repeats get the stored result (decoded
    to the function's return annotation; without one, as msgspec's natural types).

    Args:
        key: Called with the function's arguments, returns the key; or
        args: The names of the arguments the key is made of (`name=value` joined by `,`, typed and
            unambiguous: see `_job_args`).
        fingerprint: The argument names compared on a repeat (default: all of them). An argument
            equal to its parameter's default counts as not given, and names are compared in sorted
            order: a parameter added with a default, or keywords passed in another order, keep the
            earlier calls' retries replaying. Renaming or removing a parameter, changing a default,
            or passing another value changes it.
        scope: Called with the arguments, returns the owner (tenant) the key belongs to.
        ttl: Seconds a result is kept and returned to repeats, as on a route.
        lease: Seconds a claim lives without renewal, as on a route; renewed while the function runs.
        wait: Seconds a repeat of a running call waits for its result before `InProgress`.
        namespace: The key space; default `jobs:<module>.<qualified name>` of the function, so two
            functions keyed by the same arguments never return each other's results (pass one to
            keep records across a rename). A default that would not be the same in every process
            (module `__main__`, a function defined inside another, a wrapper's name) is refused:
            name one. The decorated function's `.namespace` says which.
        recover: Asked about a call whose holder died (lease over, outcome unknown), as a route's
            hook: `await recover(record_key, record)` returns `<job>.stored_result(value)` (it
            happened: every call returns `value`), `"run"` (it never happened: run it now) or None
            (unknown: `OutcomeUnknown`). A call whose Postgres `transaction()` never committed runs
            again once without a hook.
        observer: Called with an `Event` at each decision, as the middleware's (route = namespace).

    The decorated function has `.namespace` and `.stored_result(value)` (a result as its record
    holds it, checked against the return annotation: what a `recover` hook or a resolver returns).

    Raises:
        ConfigurationError: At decoration, for what cannot be made safe: not an `async def`
            function (sync functions, generators), an unstable default namespace, a return
            annotation msgspec cannot encode and decode, an `args=` name the function lacks.
    """
    names = tuple(args)
    if (key is None) == (not names):
        raise ConfigurationError("idempotent needs exactly one of key=callable or args=[argument names]")
    compared = None if fingerprint is None else tuple(fingerprint)
    spec = _Spec(backend, key, names, compared, scope, namespace, JobTerms("", lease, ttl, wait), recover, observer)
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
    recover: RecoverHook | None
    observer: Observer | None


def _decorate(spec: _Spec, func: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The checks made at decoration, and the wrapper that claims, runs and stores."""
    signature = checked_function(func, spec.names)
    returns = checked_returns(func)
    decode = _decoder(returns).decode
    space = spec.namespace if spec.namespace is not None else default_namespace(func)
    terms = dataclasses.replace(spec.terms, label=space)
    key, names, compared, scope = spec.key, spec.names, spec.compared, spec.scope

    expect_results(space, returns)  # recover hooks, resolvers and the CLI are held to it
    rt = _runtime(spec.backend, spec.observer)  # once: the store's machinery, its abilities asked once

    @functools.wraps(func)
    async def run(*a: P.args, **kw: P.kwargs) -> R:
        bound = signature.bind(*a, **kw)
        bound.apply_defaults()
        values = bound.arguments
        the_key = key(*a, **kw) if key is not None else args_key(values, names)
        owner = scope(*a, **kw) if scope is not None else None
        picked = values if compared is None else {n: values[n] for n in compared}
        printed = JOB + _job_args.fingerprint(picked, signature)
        async with claimed(rt, terms, the_key, owner, printed, spec.recover) as job:
            if job.done:
                assert job.result is not None
                return decode(job.result)  # type: ignore[no-any-return]
            value = await func(*a, **kw)
            await job.store(value, returns=returns)
            return value

    run.namespace = space  # type: ignore[attr-defined]
    run.stored_result = functools.partial(stored_result, returns=returns)  # type: ignore[attr-defined]
    return run


def current_job() -> JobClaim | None:
    """The claim of the `@idempotent` call or `claim` block running now (for `mark_effect()`; a
    consumer adapter's handler runs in one), or None."""
    info = context.current_idempotency()
    held = None if info is None else info._claim
    return held if isinstance(held, JobClaim) else None
