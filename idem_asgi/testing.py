"""Storm-test *your* app: prove that your endpoint, with your handler and your store, runs once under retries.

`storm()` drives the app in-process through raw ASGI calls (no network, no server) and fires, each
scenario with its own key:

- **the storm**: `concurrency` identical requests at once, then `repeats` more after it finished,
  then (with `mismatch=True`) the same key with a changed body;
- **faults** (`faults=`): a client that disconnects while its body is still arriving
  (`disconnect_mid_body`), the first request's task cancelled mid-flight (`cancel_first`), the store
  failing between the claim and storing the answer (`store_fails_after_claim`), the connection lost
  after the app ran, so the client never gets the answer and retries (`response_lost`), retries
  landing while the first answer is being written (`retry_during_write`), and the handler failing
  before any effect, which must free the key for the retry (`app_fails_before_effect`).

A request that moved the probe (the effect happened) and then answered 5xx or raised is allowed
once; if the key then runs again, the report says to call `mark_effect()` after the effect.

It counts the handler's executions through your `probe` and returns a `StormReport`;
`report.assert_ok()` fails with a key-by-key explanation unless the contract held. As a pytest
plugin (entry point `pytest11`, or `-p idem_asgi.testing`) it provides the fixtures `idem_storm`
(this `storm` function) and `idem_disabled` (sets `IDEM_ASGI_DISABLED=1` for one test). See
docs/testing.md.

pytest is only needed for the fixtures: importing this module without pytest works.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json as _json
import logging
import os
import types
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, cast
from urllib.parse import unquote

from ._types import ASGIApp, Message, Receive, Scope, Send
from .backends import Backend
from .errors import BackendUnavailable
from .middleware import IdempotencyMiddleware
from .policy import DEFAULT_EXCLUDED_HEADERS
from .problems import TYPE_PREFIX
from .records import ClaimResult, Record, RecordKey, StoredResponse

__all__ = [
    "FAULTS",
    "Answer",
    "InjectedAppFailure",
    "InjectedStoreFailure",
    "KeyReport",
    "StormReport",
    "find_middleware",
    "storm",
]

FAULTS: Final = (
    "disconnect_mid_body",
    "cancel_first",
    "store_fails_after_claim",
    "response_lost",
    "retry_during_write",
    "app_fails_before_effect",
)
"""Every fault `storm()` can inject (all of them by default)."""

DISABLE_ENV: Final = "IDEM_ASGI_DISABLED"

ProbeValue = int | Mapping[str, int]
Probe = Callable[[], ProbeValue | Awaitable[ProbeValue]] | Mapping[str, int]
"""How `storm()` counts executions: a zero-argument callable (sync or async) returning the total
number of executions so far, or a mapping key -> executions (or a callable returning one)."""

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))
_THIS_FILE: Final = os.path.abspath(__file__)
_WALK_LIMIT: Final = 200_000
_ATOMS: Final = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType)


# --------------------------------------------------------------------------------------------- answers


@dataclass
class Answer:
    """One request of the storm, as the client saw it (or would have: `lost` answers were dropped)."""

    phase: str
    """Which step of the scenario sent it: `concurrent`, `repeat`, `mismatch`, `retry`, `disconnect`, ..."""
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    """The app sent its last body chunk."""
    error: BaseException | None = None
    """What the ASGI call raised, if anything."""
    lost: bool = False
    """The connection was lost: the client got none of the answer (fault `response_lost`)."""
    effect: int | None = None
    """How far the probe moved while this request ran, for requests sent one at a time (else None)."""
    cancelled: bool = False
    timed_out: bool = False
    kind: str = ""
    """`run` (the app's first answer), `failed` (the app's 5xx or exception), `replay`, `problem`
    (an idem_asgi refusal), `middleware-error` (idem_asgi itself raised), or `none` (no answer)."""
    label: str = ""
    """A short description: `201`, `201-replay`, `409 request-in-progress`, `cancelled`, ..."""

    def header(self, name: str) -> bytes | None:
        """The first value of header `name` (case-insensitive), or None."""
        raw = name.lower().encode("latin-1")
        return next((v for k, v in self.headers if k.lower() == raw), None)


@dataclass
class KeyReport:
    """What happened to one idempotency key (one scenario)."""

    key: str
    scenario: str
    description: str
    answers: list[Answer] = field(default_factory=list)
    executions: int = 0
    """Handler executions for this key, as counted by the probe."""
    expected_min: int = 1
    expected_max: int = 1
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the contract held for this key."""
        return not self.problems

    @property
    def expected(self) -> str:
        """The allowed number of executions, as text (`1`, `0 to 2`)."""
        if self.expected_min == self.expected_max:
            return str(self.expected_min)
        return f"{self.expected_min} to {self.expected_max}"

    def answer_summary(self) -> str:
        """`201 x1, 409 request-in-progress x48, 201-replay x1`, in order of first appearance."""
        counts = Counter(a.label for a in self.answers)
        return ", ".join(f"{label} x{n}" for label, n in counts.items()) or "none"

    def headline(self) -> str:
        """`key K: handler ran N times (expected 1); answers: ...`"""
        times = "time" if self.executions == 1 else "times"
        return (
            f"key {self.key}: handler ran {self.executions} {times} (expected {self.expected}); "
            f"answers: {self.answer_summary()}"
        )

    def explain(self) -> str:
        """The headline, what the scenario was, and each problem and note on its own line."""
        lines = [self.headline(), f"    scenario: {self.description}"]
        lines += [f"  - {p}" for p in self.problems]
        lines += [f"    note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class StormReport:
    """The result of `storm()`: one `KeyReport` per scenario, in the order they ran."""

    method: str
    path: str
    keys: list[KeyReport] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    """Likely causes when something failed (no middleware found, switch set, no matching policy)."""
    problems: list[str] = field(default_factory=list)
    """Problems of the setup rather than of one key (a per-process store behind several workers)."""

    @property
    def ok(self) -> bool:
        """True when every key kept the contract and the setup can."""
        return not self.problems and all(k.ok for k in self.keys)

    @property
    def failures(self) -> list[KeyReport]:
        """The keys that broke the contract."""
        return [k for k in self.keys if not k.ok]

    @property
    def executions(self) -> dict[str, int]:
        """Handler executions per key."""
        return {k.key: k.executions for k in self.keys}

    def __getitem__(self, scenario_or_key: str) -> KeyReport:
        for k in self.keys:
            if scenario_or_key in (k.scenario, k.key):
                return k
        raise KeyError(scenario_or_key)

    def explain(self) -> str:
        """A readable multi-line account: failing keys first, with reasons, then the passing ones."""
        failed = self.failures
        head = f"idem_asgi storm on {self.method} {self.path}: "
        head += f"{len(failed)} of {len(self.keys)} keys broke the contract" if failed else "contract held"
        if self.problems:
            head += " in this process, but the setup cannot hold it" if not failed else ""
        lines = [head, *(f"  - {p}" for p in self.problems)]
        lines += [k.explain() for k in failed]
        lines += [f"ok  {k.headline()}" for k in self.keys if k.ok]
        if (failed or self.problems) and self.hints:
            lines += ["hints:"] + [f"  * {h}" for h in self.hints]
        return "\n".join(lines)

    __str__ = explain

    def assert_ok(self) -> None:
        """Raise AssertionError explaining every key that broke the contract."""
        __tracebackhide__ = True
        if not self.ok:
            raise AssertionError(self.explain())


# ------------------------------------------------------------------------------------ finding the middleware


def find_middleware(app: object) -> list[IdempotencyMiddleware]:
    """Every `IdempotencyMiddleware` reachable from `app`, outermost first.

    Starlette and FastAPI build their middleware stack at the first request; this builds it now,
    exactly as that first request would (so `add_middleware` is refused afterwards, as after any
    request). Litestar builds one middleware instance per route: all of them are returned.
    """
    if getattr(app, "middleware_stack", False) is None and callable(getattr(app, "build_middleware_stack", None)):
        target = cast(Any, app)
        target.middleware_stack = target.build_middleware_stack()
    found: list[IdempotencyMiddleware] = []
    seen: set[int] = set()
    queue: list[object] = [app]
    for obj in queue:  # breadth first; the list grows while we walk it
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if len(seen) > _WALK_LIMIT:
            break
        if isinstance(obj, IdempotencyMiddleware):
            found.append(obj)
        queue.extend(_children(obj))
    return found


def _children(obj: object) -> Iterator[object]:
    if isinstance(obj, Mapping):
        yield from obj.values()
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
        return
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents
            except ValueError:  # an empty cell
                continue
        return
    if isinstance(obj, types.MethodType):
        yield obj.__self__
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        yield from attrs.values()
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                descriptor = klass.__dict__.get(name)
                if isinstance(descriptor, types.MemberDescriptorType):
                    try:
                        yield descriptor.__get__(obj, klass)
                    except AttributeError:  # slot not set
                        continue


class InjectedStoreFailure(BackendUnavailable):
    """The store failure `storm()` injects; the middleware's log records about it are filtered out."""


def _not_injected(record: logging.LogRecord) -> bool:
    """A logging filter dropping the middleware's (expected) complaints about the injected failure."""
    causes = [record.exc_info[1] if record.exc_info else None, *(record.args if isinstance(record.args, tuple) else ())]
    return not any(isinstance(c, InjectedStoreFailure) for c in causes)


class _FailingStore:
    """A Backend wrapper whose `complete` raises BackendUnavailable once for each armed key."""

    def __init__(
        self, inner: Backend, armed: set[str], fired: set[str], writing: dict[str, Callable[[], None]]
    ) -> None:
        self.inner = inner
        self.wrapped = inner  # PostgresBackend.transaction() finds its own claim through wrappers
        self._armed = armed
        self._fired = fired
        self._writing = writing

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        return await self.inner.claim(key, fingerprint, lease=lease, ttl=ttl)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        return await self.inner.takeover(key, stale_token, fingerprint, lease=lease, ttl=ttl)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        if _fire(key, self._armed, self._fired):
            raise InjectedStoreFailure("store failed after the claim (injected by idem_asgi.testing)")
        starting = self._writing.pop(key.key, None)
        if starting is not None:
            starting()  # the storm's retries start now, and land while this write is in flight
            await asyncio.sleep(0)
        return await self.inner.complete(key, token, response, ttl=ttl)

    async def release(self, key: RecordKey, token: int) -> bool:
        return await self.inner.release(key, token)

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        return await self.inner.extend(key, token, lease=lease)

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        return await self.inner.mark_failed(key, token)

    async def get(self, key: RecordKey) -> Record | None:
        return await self.inner.get(key)

    async def aclose(self) -> None:
        """The storm never closes the user's store."""

    def __getattr__(self, name: str) -> Any:
        # Anything beyond the Backend protocol (maintenance methods, pool, setup) is the real store's.
        return getattr(self.inner, name)


class InjectedAppFailure(RuntimeError):
    """The handler failure `storm()` injects (fault `app_fails_before_effect`), before the app runs."""


def _fire(key: RecordKey, armed: set[str], fired: set[str]) -> bool:
    if key.key in armed and key.key not in fired:
        fired.add(key.key)
        return True
    return False


# ------------------------------------------------------------------------------------------------ storm


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class _Storm:
    def __init__(
        self,
        app: ASGIApp,
        request: _Request,
        probe: Probe,
        *,
        key_header: str,
        replay_header: str,
        request_timeout: float,
    ) -> None:
        self.app = app
        self.request = request
        self.probe = probe
        self.key_header = key_header.lower().encode("latin-1")
        self.replay_header = replay_header.lower().encode("latin-1")
        self.replay_header_name = replay_header
        self.timeout = request_timeout
        self.excluded: frozenset[bytes] = frozenset(h.encode("latin-1") for h in DEFAULT_EXCLUDED_HEADERS)
        self.release: Container[int] = range(500, 600)
        self.armed: set[str] = set()
        self.fired: set[str] = set()
        self.writing: dict[str, Callable[[], None]] = {}  # key -> called when its store write begins
        self.failing: set[str] = set()  # keys whose handler fails once, before it runs
        self.injectable = False
        self._app_errors: dict[int, BaseException] = {}
        self._clients = itertools.count(40_000)

    # -- instrumentation ---------------------------------------------------------------------------

    @contextmanager
    def instrumented(self, targets: Sequence[IdempotencyMiddleware], backend: Backend | None) -> Iterator[None]:
        """Wrap each middleware's store (fault injection) and inner app (to tell app errors from ours)."""
        saved: list[tuple[IdempotencyMiddleware, Backend, ASGIApp]] = []
        patched_backend = False
        logger = logging.getLogger("idem_asgi")
        logger.addFilter(_not_injected)
        try:
            for mw in targets:
                saved.append((mw, mw.backend, mw.app))
                mw.backend = _FailingStore(mw.backend, self.armed, self.fired, self.writing)
                mw.app = self._marking(mw.app)
            self.injectable = bool(targets)
            if not targets and backend is not None:
                patched_backend = self._patch_backend(backend)
                self.injectable = patched_backend
            yield
        finally:
            logger.removeFilter(_not_injected)
            for mw, store, inner in saved:
                mw.backend = store
                mw.app = inner
            if patched_backend:
                vars(backend).pop("complete", None)

    def _patch_backend(self, backend: Backend) -> bool:
        """No middleware found: shadow the store's `complete` on the instance itself."""
        original = backend.complete
        armed, fired = self.armed, self.fired

        async def complete(key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
            if _fire(key, armed, fired):
                raise InjectedStoreFailure("store failed after the claim (injected by idem_asgi.testing)")
            return await original(key, token, response, ttl=ttl)

        try:
            vars(backend)["complete"] = complete
        except TypeError:  # no instance __dict__ (slots): cannot inject
            return False
        return True

    def _marking(self, inner: ASGIApp) -> ASGIApp:
        errors, failing, key_header = self._app_errors, self.failing, self.key_header

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            try:
                key = next((v for k, v in scope.get("headers", ()) if k == key_header), b"").decode("latin-1")
                if key in failing:
                    failing.discard(key)
                    raise InjectedAppFailure("the handler failed before any effect (injected by idem_asgi.testing)")
                await inner(scope, receive, send)
            except BaseException as exc:
                errors[id(exc)] = exc  # raised by the app, not by idem_asgi
                raise

        return app

    def _from_middleware(self, exc: BaseException) -> bool:
        """True when idem_asgi itself raised `exc` (the app's own exceptions are marked on their way out)."""
        group = getattr(exc, "exceptions", None)
        if isinstance(group, (list, tuple)) and group:
            return any(self._from_middleware(e) for e in group if isinstance(e, BaseException))
        if self._app_errors.get(id(exc)) is exc:
            return False
        tb = exc.__traceback__
        while tb is not None:
            filename = os.path.abspath(tb.tb_frame.f_code.co_filename)
            if filename.startswith(_PACKAGE_DIR + os.sep) and filename != _THIS_FILE:
                return True
            tb = tb.tb_next
        return False

    # -- counting ------------------------------------------------------------------------------------

    async def count(self, key: str) -> int:
        value: object = self.probe
        if callable(value):
            value = value()
            if inspect.isawaitable(value):
                value = await value
        if isinstance(value, Mapping):
            return int(value.get(key, 0))
        if isinstance(value, int):
            return value
        raise TypeError(f"probe must give an int or a mapping key -> count, got {value!r}")

    # -- one request ---------------------------------------------------------------------------------

    def scope(self, key: str, length: int) -> dict[str, Any]:
        r = self.request
        headers = [(b"host", b"testserver")] if all(k != b"host" for k, _ in r.headers) else []
        headers += [h for h in r.headers if h[0] not in (b"content-length", self.key_header)]
        headers.append((b"content-length", str(length).encode("ascii")))
        headers.append((self.key_header, key.encode("latin-1")))
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": r.method,
            "scheme": "http",
            "path": unquote(r.path),
            "raw_path": r.path.encode("latin-1"),
            "query_string": r.query,
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", next(self._clients)),
            "server": ("testserver", 80),
            "state": {},
            "extensions": {},
        }

    async def drive(
        self,
        key: str,
        answer: Answer,
        *,
        body: bytes | None = None,
        disconnect_mid_body: bool = False,
        lost: bool = False,
        hang_at_send: asyncio.Event | None = None,
        on_last_chunk: Callable[[], None] | None = None,
    ) -> Answer:
        """One raw ASGI call. The client waits for the whole answer before it "hangs up" (so apps
        that listen for a disconnect are not cut short), unless it disconnects mid-body. With `lost`,
        the connection is gone once the body was sent: every `send` raises `OSError`, as a server's
        does for a client that left, and the client gets nothing."""
        body = self.request.body if body is None else body
        scope = self.scope(key, len(body))
        answered = asyncio.Event()
        half = len(body) // 2
        pending: list[Message] = (
            [{"type": "http.request", "body": body[:half], "more_body": True}]
            if disconnect_mid_body
            else [{"type": "http.request", "body": body, "more_body": False}]
        )
        chunks: list[bytes] = []
        answer.lost = lost
        if lost:
            answered.set()  # the client is gone: a `receive` after the body is a disconnect

        async def receive() -> Message:
            if pending:
                # The body "arrives from the network": every request of a storm reaches the app before
                # any of them gets its body, so the concurrent requests really overlap.
                await asyncio.sleep(0)
                return pending.pop(0)
            if not disconnect_mid_body:
                await answered.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if lost:
                await asyncio.sleep(0)
                raise OSError("connection reset by peer (the answer is lost: injected by idem_asgi.testing)")
            kind = message["type"]
            if kind == "http.response.start" and answer.status is None:
                answer.status = int(message["status"])
                answer.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            elif kind == "http.response.body" and not answer.complete:
                chunks.append(bytes(message.get("body", b"")))
                if not message.get("more_body", False):
                    answer.complete = True
                    answered.set()
                    if on_last_chunk is not None:
                        on_last_chunk()
            if hang_at_send is not None:
                hang_at_send.set()
                await asyncio.Event().wait()  # the client stalls here until the storm cancels the request
            await asyncio.sleep(0)  # writing to a socket lets other requests run

        call = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            done, _ = await asyncio.wait({call}, timeout=None if hang_at_send is not None else self.timeout)
            if not done:
                answer.timed_out = True
                call.cancel()
                await asyncio.wait({call})
        except BaseException:
            # The storm (or the test) cancelled this request: cancel the app's task too, and wait for it.
            call.cancel()
            await asyncio.wait({call})
            raise
        finally:
            answered.set()
            answer.body = b"".join(chunks)
            if call.done():
                if call.cancelled():
                    answer.cancelled = not answer.timed_out
                else:
                    answer.error = call.exception()  # retrieved even after a timeout: never "never retrieved"
        return self.classify(answer)

    def classify(self, a: Answer) -> Answer:
        if a.error is not None and self._from_middleware(a.error):
            a.kind, a.label = "middleware-error", f"middleware raised {type(a.error).__name__}"
        elif a.cancelled or a.timed_out:
            a.label = "cancelled" if a.cancelled else f"timed out after {self.timeout:g}s"
            # Already answering with a failure (say 500) when cut off: the app failed before the cancel.
            a.kind = "failed" if a.status in self.release else "none"
            if a.status is not None:
                a.label = f"{a.status} ({a.label})"
        elif a.status is None:
            a.kind = "failed" if a.error is not None else "none"
            a.label = f"raised {type(a.error).__name__}" if a.error is not None else "no answer"
        elif a.header(self.replay_header.decode("latin-1")) == b"true":
            a.kind, a.label = "replay", f"{a.status}-replay"
        elif (slug := _problem_slug(a)) is not None:
            a.kind, a.label = "problem", f"{a.status} {slug}"
        elif a.error is not None or a.status in self.release:
            a.kind = "failed"
            a.label = f"{a.status}" + (f" ({type(a.error).__name__})" if a.error is not None else "")
        elif not a.complete:
            a.kind, a.label = "none", f"{a.status} incomplete"
        else:
            a.kind, a.label = "run", f"{a.status}"
        if a.lost:
            a.label += " (lost)"
        return a

    # -- comparing answers -----------------------------------------------------------------------------

    def difference(self, first: Answer, replay: Answer) -> str | None:
        """How `replay` differs from `first` (ignoring the replay marker and headers never stored)."""
        if first.status != replay.status:
            return f"status {replay.status} != {first.status}"
        if first.body != replay.body:
            return f"body {_short(replay.body)} != {_short(first.body)}"
        expected = [
            (k, v) for k, v in first.headers if k.lower() not in self.excluded and k.lower() != self.replay_header
        ]
        got = [(k, v) for k, v in replay.headers if k.lower() != self.replay_header]
        if expected != got:
            return f"headers {got!r} != {expected!r}"
        return None


def _problem_slug(a: Answer) -> str | None:
    content_type = a.header("content-type") or b""
    if not content_type.startswith(b"application/problem+json"):
        return None
    try:
        kind = _json.loads(a.body).get("type", "")
    except (ValueError, AttributeError):
        return None
    if isinstance(kind, str) and kind.startswith(TYPE_PREFIX):
        return kind[len(TYPE_PREFIX) :]
    return None


def _n(count: int, noun: str) -> str:
    """`1 time`, `2 times`, `1 retry`, `5 retries`."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun[:-1]}ies" if noun.endswith("y") else f"{count} {noun}s"


def _short(body: bytes, limit: int = 80) -> str:
    return repr(body) if len(body) <= limit else repr(body[:limit]) + f"... ({len(body)} bytes)"


def _changed(body: bytes) -> bytes:
    """Another request's body: a JSON object gets one more field, anything else one more suffix."""
    try:
        value = _json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict):
        value["idem_storm_changed"] = True
        return _json.dumps(value).encode()
    return body + b"-changed" if body else b"changed"


def _summary(answers: Iterable[Answer]) -> str:
    counts = Counter(a.label for a in answers)
    return ", ".join(f"{label} x{n}" for label, n in counts.items())


def _unexpected(kr: KeyReport, phase: str, allowed: Callable[[Answer], bool], what: str) -> None:
    bad = [a for a in kr.answers if a.phase == phase and a.kind != "middleware-error" and not a.timed_out]
    bad = [a for a in bad if not allowed(a)]
    if bad:
        kr.problems.append(f"{phase} requests got {_summary(bad)}; expected {what}")


async def storm(
    app: ASGIApp,
    method: str = "POST",
    path: str = "/payments",
    *,
    probe: Probe,
    body: bytes | str = b"",
    json: Any = None,
    headers: Mapping[str, str] | Sequence[tuple[str, str]] = (),
    key: str | None = None,
    concurrency: int = 50,
    repeats: int = 5,
    faults: Iterable[str] = FAULTS,
    mismatch: bool = True,
    middleware: IdempotencyMiddleware | Sequence[IdempotencyMiddleware] | None = None,
    backend: Backend | None = None,
    key_header: str = "Idempotency-Key",
    replay_header: str = "Idempotent-Replayed",
    request_timeout: float = 10.0,
    workers: int = 1,
) -> StormReport:
    """Fire retry storms and faults at `app` in-process; return what each key saw.

    Args:
        app: Your ASGI app, with `IdempotencyMiddleware` installed the way you install it.
        method, path: The endpoint (`path` may carry a `?query`).
        probe: Counts your handler's executions: a zero-argument callable (sync or async)
            returning the total so far (`lambda: len(charges)`), or a mapping key -> count (or a
            callable returning one). Read before and after each scenario, which run one at a time.
        body, json: The request body (bytes/str), or an object sent as JSON
            (`content-type: application/json` is added unless `headers` sets one).
        headers: Extra request headers (tenant, auth). Host, content-length and the key are set here.
        key: The storm's key; each fault uses `<key>-<fault>`. Default: `storm-<random>`.
        concurrency: Identical requests fired at once.
        repeats: Sequential repeats after the storm, and retries after each fault.
        faults: Which of `FAULTS` to inject.
        mismatch: Also send the storm's key with a changed body (expects 422). Turn off for routes
            whose fingerprint ignores the body (`event_id` webhooks).
        middleware: The `IdempotencyMiddleware` instance(s) serving `path`. Default: found in `app`.
        backend: The store to fail for `store_fails_after_claim`, when the middleware cannot be
            found (it is then patched on the instance for the duration of the storm).
        key_header, replay_header: As configured on the middleware.
        request_timeout: Seconds before one request counts as hung.
        workers: How many processes serve the app in production. With more than one, a per-process
            store (`MemoryBackend`) fails the report: each worker would run the retry again.

    The app runs without its lifespan: start it yourself if your handlers need it. While the storm
    runs, the middleware's store and inner app are wrapped (restored afterwards).
    """
    bad_faults = [f for f in faults if f not in FAULTS]
    if bad_faults:
        raise ValueError(f"unknown fault(s) {bad_faults}; choose from {list(FAULTS)}")
    if concurrency < 1 or repeats < 0 or workers < 1:
        raise ValueError("concurrency and workers must be at least 1, and repeats at least 0")
    raw_headers = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
    encoded = tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in raw_headers)
    if json is not None:
        payload = _json.dumps(json).encode()
        if all(k != b"content-type" for k, _ in encoded):
            encoded += ((b"content-type", b"application/json"),)
    else:
        payload = body.encode() if isinstance(body, str) else bytes(body)
    route, _, query = path.partition("?")
    request = _Request(method.upper(), route, query.encode("latin-1"), encoded, payload)
    prefix = key or f"storm-{uuid.uuid4().hex[:8]}"

    report = StormReport(request.method, path)
    run = _Storm(
        app, request, probe, key_header=key_header, replay_header=replay_header, request_timeout=request_timeout
    )
    if middleware is None:
        targets = find_middleware(app)
    elif isinstance(middleware, IdempotencyMiddleware):
        targets = [middleware]
    else:
        targets = list(middleware)
    if backend is not None:
        targets = [m for m in targets if m.backend is backend]
    _configure(run, report, targets)
    _per_process(report, targets, workers)

    with run.instrumented(targets, backend):
        report.keys.append(await _storm_key(run, prefix, concurrency, repeats, mismatch))
        scenarios = {
            "disconnect_mid_body": _disconnect,
            "cancel_first": _cancel_first,
            "store_fails_after_claim": _store_fails,
            "response_lost": _response_lost,
            "retry_during_write": _retry_during_write,
            "app_fails_before_effect": _app_fails,
        }
        for fault in FAULTS:
            if fault in faults:
                report.keys.append(await scenarios[fault](run, f"{prefix}-{fault}", max(repeats, 1)))
    return report


def _configure(run: _Storm, report: StormReport, targets: Sequence[IdempotencyMiddleware]) -> None:
    """Take the replay-comparison rules from the middleware serving the path, and collect hints."""
    if os.environ.get(DISABLE_ENV):
        report.hints.append(f"{DISABLE_ENV} is set in this process: idempotency is off in every middleware built now")
    if not targets:
        report.hints.append(
            "no IdempotencyMiddleware was found in the app: is it installed? (or pass middleware=... / backend=...)"
        )
        return
    request = run.request
    routes = [r for mw in targets if (r := mw.route_for(request.method, request.path)) is not None]
    if routes:
        run.excluded = routes[0].excluded
        run.release = routes[0].release_statuses
    elif all(not mw.routes for mw in targets):
        report.hints.append("the IdempotencyMiddleware was built while idempotency was disabled (IDEM_ASGI_DISABLED)")
    else:
        report.hints.append(f"no RoutePolicy of the IdempotencyMiddleware matches {request.method} {request.path}")


def _per_process(report: StormReport, targets: Sequence[IdempotencyMiddleware], workers: int) -> None:
    """A store each process keeps for itself cannot hold the contract across several workers."""
    from .backends.memory import MemoryBackend

    local = [mw for mw in targets if isinstance(mw.backend, MemoryBackend)]
    if not local:
        return
    if workers > 1:
        report.problems.append(
            f"the store is a MemoryBackend, which each process keeps for itself: at {workers} workers a retry "
            "that reaches another worker runs again. Use RedisBackend or PostgresBackend"
        )
    else:
        report.hints.append("the store is a MemoryBackend: fine for one process, wrong as soon as there are two")


def _executions(kr: KeyReport, before: int, after: int) -> None:
    kr.executions = after - before
    if kr.executions > kr.expected_max:
        kr.problems.insert(
            0,
            f"the handler ran {_n(kr.executions, 'time')} for one key; the contract allows {kr.expected}",
        )
        effectful = [a for a in kr.answers if a.kind == "failed" and a.effect]
        if effectful:
            kr.problems.insert(
                1,
                f"{_n(len(effectful), 'request')} had the effect (the probe moved) and then failed "
                f"({_summary(effectful)}): the claim was released and a retry ran it again. Call "
                "request.state.idempotency.mark_effect() right after the effect, so a later failure keeps the "
                "claim (outcome-unknown) instead",
            )
    elif kr.executions < kr.expected_min:
        kr.problems.insert(
            0,
            f"the handler ran {_n(kr.executions, 'time')} but the app answered {_n(kr.expected_min, 'request')} with "
            "success: does the probe count this endpoint's executions (read live, not a copy)?",
        )


def _judge(run: _Storm, kr: KeyReport) -> Answer | None:
    """Checks every scenario shares; sets the allowed executions; returns the first answer."""
    for a in kr.answers:
        if a.kind == "middleware-error":
            kr.problems.append(f"idem_asgi itself raised {a.error!r} on a {a.phase} request (a 500 of its own)")
    runs = [a for a in kr.answers if a.kind == "run"]
    failed = [a for a in kr.answers if a.kind == "failed"]
    if len(runs) > 1:
        kr.problems.append(
            f"{len(runs)} requests got a first answer from the app ({_summary(runs)}): expected one; every "
            f"other one must be a replay marked {run.replay_header_name}: true, or a 409"
        )
    first = runs[0] if runs else None
    # A failure before any effect is released, and its retry may run again; one after the effect
    # (the probe moved during it) is the effect itself, which must never happen twice.
    effectful = [a for a in failed if a.effect]
    before_effect = [a for a in failed if not a.effect]  # effect 0, or unknown (concurrent requests)
    if failed:
        kr.notes.append(
            f"the app itself failed {_n(len(failed), 'time')} ({_summary(failed)}): its own error; a failure "
            "before any effect is released and a retry may run again"
        )
    kr.expected_min = 1 if first is not None and first.status is not None and 200 <= first.status < 300 else 0
    hung = [a for a in kr.answers if a.timed_out]  # may have run before it was cut off
    if hung:
        phases = ", ".join(sorted({a.phase for a in hung}))
        kr.problems.append(f"{_n(len(hung), 'request')} ({phases}) got no answer within {run.timeout:g}s: hung")
    kr.expected_max = (1 if first is not None or effectful else 0) + len(before_effect) + len(hung)
    replays = [a for a in kr.answers if a.kind == "replay"]
    base = first or (replays[0] if replays else None)
    diffs = [(a, d) for a in replays if base is not None and (d := run.difference(base, a)) is not None]
    for a, d in diffs[:3]:
        what = "the first answer" if first is not None else "the first replay"
        kr.problems.append(f"a {a.phase} replay is not byte-identical to {what}: {d}")
    if len(diffs) > 3:
        kr.problems.append(f"... and {len(diffs) - 3} more replays differ")
    if first is not None and first.status is not None and not 200 <= first.status < 300:
        kr.notes.append(f"the first answer was {first.label}, not 2xx: check the request the storm sends")
    return first


def _stored(a: Answer) -> bool:
    return a.kind == "replay" or a.label.startswith("409 response-not-stored")


def _in_progress(a: Answer) -> bool:
    return a.label.startswith(("409 request-in-progress", "409 outcome-unknown"))


async def _sequential(run: _Storm, kr: KeyReport, phase: str, n: int, **kwargs: Any) -> None:
    """`n` requests one after another, each with the probe's movement during it (`Answer.effect`)."""
    for _ in range(n):
        before = await run.count(kr.key)
        answer = await run.drive(kr.key, Answer(phase), **kwargs)
        answer.effect = await run.count(kr.key) - before
        kr.answers.append(answer)


async def _storm_key(run: _Storm, key: str, concurrency: int, repeats: int, mismatch: bool) -> KeyReport:
    what = f"{concurrency} concurrent identical requests, then {_n(repeats, 'repeat')}"
    kr = KeyReport(key, "storm", what + (", then the same key with a changed body" if mismatch else ""))
    before = await run.count(key)
    kr.answers += await asyncio.gather(*(run.drive(key, Answer("concurrent")) for _ in range(concurrency)))
    await _sequential(run, kr, "repeat", repeats)
    first = next((a for a in kr.answers if a.kind == "run"), None)
    if mismatch and first is not None:
        await _sequential(run, kr, "mismatch", 1, body=_changed(run.request.body))
    elif mismatch:
        kr.notes.append("no answer was stored for this key, so the changed-body request was not sent")
    first = _judge(run, kr)
    _executions(kr, before, await run.count(key))
    _unexpected(
        kr,
        "concurrent",
        lambda a: a.kind in ("run", "failed", "replay") or _in_progress(a),
        "the app's answer, replays, or 409 request-in-progress",
    )
    if first is not None:
        _unexpected(kr, "repeat", _stored, "replays of the first answer")
    _unexpected(kr, "mismatch", lambda a: a.label == "422 fingerprint-mismatch", "422 fingerprint-mismatch")
    return kr


async def _disconnect(run: _Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "disconnect_mid_body",
        f"the client leaves with half its body sent, then retries with the whole body, then {_n(repeats, 'repeat')}",
    )
    before = await run.count(key)
    await _sequential(run, kr, "disconnect", 1, disconnect_mid_body=True)
    early = await run.count(key) - before
    await _sequential(run, kr, "retry", 1)
    await _sequential(run, kr, "repeat", repeats)
    _judge(run, kr)
    # A request whose body never arrived earns no extra execution, even one that failed.
    kr.expected_max -= sum(a.kind == "failed" for a in kr.answers if a.phase == "disconnect")
    kr.expected_max = max(kr.expected_max, kr.expected_min)
    _executions(kr, before, await run.count(key))
    if early or kr.answers[0].kind == "run":
        kr.problems.append(
            f"the handler ran {_n(early, 'time')} for the request whose client left mid-body "
            f"({kr.answers[0].label}): nothing may run before the whole body has arrived"
        )
    retry = kr.answers[1]
    if retry.kind == "replay":
        kr.problems.append("the retry got a replay, but the first request never sent its whole body")
    elif retry.kind not in ("run", "failed", "middleware-error"):
        kr.problems.append(f"the retry got {retry.label}: a client that left mid-body must leave nothing claimed")
    if retry.kind == "run":
        _unexpected(kr, "repeat", _stored, "replays of the retry's answer")
    return kr


async def _cancel_first(run: _Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key, "cancel_first", f"the first request's task is cancelled mid-flight, then {_n(repeats, 'retry')}"
    )
    loop = asyncio.get_running_loop()
    before = await run.count(key)
    stalled = asyncio.Event()
    first = Answer("cancelled")
    task = asyncio.ensure_future(run.drive(key, first, hang_at_send=stalled))
    deadline = loop.time() + run.timeout
    for spin in itertools.count():
        # Cancel as soon as the handler has counted, or has started answering (the client stalls there).
        if task.done() or stalled.is_set() or loop.time() > deadline or await run.count(key) > before:
            break
        await asyncio.sleep(0 if spin < 1000 else 0.001)
    if task.done():
        kr.notes.append("the first request finished before it could be cancelled")
    task.cancel()
    await asyncio.wait({task})
    kr.answers.append(run.classify(first))
    at_cancel = await run.count(key) - before
    await _sequential(run, kr, "retry", repeats)
    _judge(run, kr)
    if first.kind == "none":
        kr.expected_min = kr.expected_max = at_cancel  # retries must add nothing
    _executions(kr, before, await run.count(key))
    if first.kind == "failed":
        kr.notes.append("the app had already failed when it was cancelled: the claim may be released")
    elif first.cancelled:
        _unexpected(
            kr,
            "retry",
            _in_progress,
            "409 request-in-progress or outcome-unknown: a cancelled request "
            "may have had its effect, so it keeps its claim and is never run again",
        )
    else:
        _unexpected(kr, "retry", _stored, "replays of the first answer")
    return kr


async def _store_fails(run: _Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "store_fails_after_claim",
        f"the store fails between the claim and storing the answer, then {_n(repeats, 'retry')}",
    )
    if not run.injectable:
        kr.problems.append(
            "could not inject the store failure: no IdempotencyMiddleware found in the app (pass "
            "middleware=... or backend=..., or leave store_fails_after_claim out of faults=)"
        )
    run.armed.add(key)
    before = await run.count(key)
    await _sequential(run, kr, "first", 1)
    await _sequential(run, kr, "retry", repeats)
    _judge(run, kr)
    _executions(kr, before, await run.count(key))
    first = kr.answers[0]
    if first.kind == "run" and run.injectable and key not in run.fired:
        kr.problems.append(
            "the injected store failure never fired: the answer was stored through another store "
            "(pass the middleware= or backend= serving this path)"
        )
    elif first.kind == "problem":
        kr.problems.append(
            f"the first request got {first.label}: the app's answer must reach the client even when storing it fails"
        )
    elif first.kind == "failed":
        kr.notes.append("the app failed, so storing was never attempted: this fault was not exercised")
    if first.kind == "run" and run.injectable:
        _unexpected(
            kr,
            "retry",
            lambda a: _in_progress(a) or a.kind == "replay",
            "409 request-in-progress or outcome-unknown (the effect happened but its answer was not "
            "stored, so the claim is kept and never run again), or a replay once a later attempt stored it",
        )
    return kr


async def _response_lost(run: _Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "response_lost",
        f"the connection is lost after the app ran (the client gets nothing), then {_n(repeats, 'retry')}",
    )
    before = await run.count(key)
    await _sequential(run, kr, "lost", 1, lost=True)
    await _sequential(run, kr, "retry", repeats)
    _judge(run, kr)
    lost = kr.answers[0]
    if lost.effect:  # it ran: that was the one execution, and every retry must replay its answer
        kr.expected_min = 1
        kr.expected_max = 1 + sum(a.kind == "failed" and not a.effect for a in kr.answers[1:])
    _executions(kr, before, await run.count(key))
    if lost.effect:
        _unexpected(
            kr,
            "retry",
            lambda a: _stored(a) or a.label.startswith("409 outcome-unknown"),
            "replays of the lost answer (the app ran; its client hanging up must not free the key), or "
            "409 outcome-unknown when the app failed after its effect",
        )
    return kr


async def _retry_during_write(run: _Storm, key: str, repeats: int) -> KeyReport:
    n = max(repeats, 1)
    kr = KeyReport(
        key,
        "retry_during_write",
        f"{_n(n, 'retry')} land while the first answer is being written, then {_n(repeats, 'repeat')}",
    )
    retries: list[asyncio.Future[Answer]] = []

    def fire() -> None:
        if not retries:
            retries.extend(asyncio.ensure_future(run.drive(key, Answer("during-write"))) for _ in range(n))

    before = await run.count(key)
    if run.injectable:
        run.writing[key] = fire  # when the store write begins
        first = await run.drive(key, Answer("first"))
    else:
        first = await run.drive(key, Answer("first"), on_last_chunk=fire)  # as the last byte arrives
    run.writing.pop(key, None)
    first.effect = None
    kr.answers.append(first)
    if retries:
        kr.answers += await asyncio.gather(*retries)
    else:
        kr.notes.append("the first request never got to writing its answer, so no retry landed during the write")
    await _sequential(run, kr, "repeat", repeats)
    _judge(run, kr)
    _executions(kr, before, await run.count(key))
    _unexpected(
        kr,
        "during-write",
        lambda a: _in_progress(a) or a.kind == "replay",
        "409 request-in-progress or a replay: the key stays held until its answer is stored",
    )
    if first.kind == "run":
        _unexpected(kr, "repeat", _stored, "replays of the first answer")
    return kr


async def _app_fails(run: _Storm, key: str, repeats: int) -> KeyReport:
    kr = KeyReport(
        key,
        "app_fails_before_effect",
        f"the handler fails once before any effect (injected), then {_n(max(repeats, 1), 'retry')}",
    )
    if not run.injectable:
        kr.problems.append(
            "could not inject the handler failure: no IdempotencyMiddleware found in the app (pass "
            "middleware=..., or leave app_fails_before_effect out of faults=)"
        )
    run.failing.add(key)
    before = await run.count(key)
    await _sequential(run, kr, "failing", 1)
    run.failing.discard(key)
    await _sequential(run, kr, "retry", max(repeats, 1))
    _judge(run, kr)
    _executions(kr, before, await run.count(key))
    failing, retry = kr.answers[0], kr.answers[1]
    if run.injectable and failing.kind == "failed" and retry.kind not in ("run", "failed", "middleware-error"):
        kr.problems.append(
            f"the retry after a failure before any effect got {retry.label}: the key must be released so the "
            "retry runs (a layer that keeps it answers 409 for as long as the record lives)"
        )
    if retry.kind == "run":
        _unexpected(kr, "retry", lambda a: a is retry or _stored(a), "the retry's answer, then replays of it")
    return kr


# ----------------------------------------------------------------------------------------- pytest plugin

try:
    import pytest
except ImportError:  # pytest is a dev dependency: storm() works without it, the fixtures need it
    pass
else:

    @pytest.fixture
    def idem_storm() -> Callable[..., Awaitable[StormReport]]:
        """`await idem_storm(app, path="/payments", json={...}, probe=lambda: charges)`: see `storm()`."""
        return storm

    @pytest.fixture
    def idem_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
        """Turn idempotency off for one test: sets IDEM_ASGI_DISABLED=1.

        Read when each IdempotencyMiddleware is built, so build the app inside the test (Starlette
        and FastAPI build theirs at their first request, Litestar at `Litestar(...)`).
        """
        monkeypatch.setenv(DISABLE_ENV, "1")
