"""The simulated client: one raw ASGI call per request, and how its answer is classified and compared."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json as _json
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Container, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote

from .._types import ASGIApp, Message, Receive, Scope, Send
from ..backends import Backend
from ..http.middleware import IdempotencyMiddleware
from ..http.policy import DEFAULT_EXCLUDED_HEADERS
from ..http.problems import slug_of
from ..records import RecordKey, StoredResponse
from .inject import FailingStore, InjectedAppFailure, InjectedStoreFailure, fire, not_injected
from .report import Answer, KeyReport

ProbeValue = int | Mapping[str, int]
Probe = Callable[[], ProbeValue | Awaitable[ProbeValue]] | Mapping[str, int]
"""How `storm()` counts executions: a zero-argument callable (sync or async) returning the total
number of executions so far, or a mapping key -> executions (or a callable returning one)."""

_PACKAGE_DIR: Final = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # idem_asgi/
_TESTING_DIR: Final = os.path.dirname(os.path.abspath(__file__))  # this package: the storm's own frames


@dataclass(frozen=True)
class StormRequest:
    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes


class Storm:
    def __init__(
        self,
        app: ASGIApp,
        request: StormRequest,
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
        logger.addFilter(not_injected)
        try:
            for mw in targets:
                saved.append((mw, mw.backend, mw.app))
                mw.use_backend(FailingStore(mw.backend, self.armed, self.fired, self.writing))
                mw.use_app(self._marking(mw.app))
            self.injectable = bool(targets)
            if not targets and backend is not None:
                patched_backend = self._patch_backend(backend)
                self.injectable = patched_backend
            yield
        finally:
            logger.removeFilter(not_injected)
            for mw, store, inner in saved:
                mw.use_backend(store)
                mw.use_app(inner)
            if patched_backend:
                vars(backend).pop("complete", None)

    def _patch_backend(self, backend: Backend) -> bool:
        """No middleware found: shadow the store's `complete` on the instance itself."""
        original = backend.complete
        armed, fired = self.armed, self.fired

        async def complete(key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
            if fire(key, armed, fired):
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
            if filename.startswith(_PACKAGE_DIR + os.sep) and not filename.startswith(_TESTING_DIR + os.sep):
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
        """One raw ASGI call through a simulated client (see `_Client`); returns its classified answer."""
        body = self.request.body if body is None else body
        client = _Client(answer, body, disconnect_mid_body, lost, hang_at_send, on_last_chunk)
        call = asyncio.ensure_future(self.app(self.scope(key, len(body)), client.receive, client.send))
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
            client.finish()
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


class _Client:
    """One simulated client: it sends the body, then waits for the whole answer before it "hangs up"
    (so apps that listen for a disconnect are not cut short), unless it disconnects mid-body. With
    `lost`, the connection is gone once the body was sent: every `send` raises `OSError`, as a
    server's does for a client that left, and the client gets nothing."""

    def __init__(
        self,
        answer: Answer,
        body: bytes,
        disconnect_mid_body: bool,
        lost: bool,
        hang_at_send: asyncio.Event | None,
        on_last_chunk: Callable[[], None] | None,
    ) -> None:
        self.answer = answer
        self.disconnect_mid_body = disconnect_mid_body
        self.lost = answer.lost = lost
        self.hang_at_send = hang_at_send
        self.on_last_chunk = on_last_chunk
        self.answered = asyncio.Event()
        if lost:
            self.answered.set()  # the client is gone: a `receive` after the body is a disconnect
        half = len(body) // 2
        self.pending: list[Message] = (
            [{"type": "http.request", "body": body[:half], "more_body": True}]
            if disconnect_mid_body
            else [{"type": "http.request", "body": body, "more_body": False}]
        )
        self.chunks: list[bytes] = []

    async def receive(self) -> Message:
        if self.pending:
            # The body "arrives from the network": every request of a storm reaches the app before
            # any of them gets its body, so the concurrent requests really overlap.
            await asyncio.sleep(0)
            return self.pending.pop(0)
        if not self.disconnect_mid_body:
            await self.answered.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.lost:
            await asyncio.sleep(0)
            raise OSError("connection reset by peer (the answer is lost: injected by idem_asgi.testing)")
        answer, kind = self.answer, message["type"]
        if kind == "http.response.start" and answer.status is None:
            answer.status = int(message["status"])
            answer.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
        elif kind == "http.response.body" and not answer.complete:
            self.chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                answer.complete = True
                self.answered.set()
                if self.on_last_chunk is not None:
                    self.on_last_chunk()
        if self.hang_at_send is not None:
            self.hang_at_send.set()
            await asyncio.Event().wait()  # the client stalls here until the storm cancels the request
        await asyncio.sleep(0)  # writing to a socket lets other requests run

    def finish(self) -> None:
        """The call is over: release a waiting `receive`, and keep what arrived."""
        self.answered.set()
        self.answer.body = b"".join(self.chunks)


def _problem_slug(a: Answer) -> str | None:
    content_type = a.header("content-type") or b""
    if not content_type.startswith(b"application/problem+json"):
        return None
    try:
        kind = _json.loads(a.body).get("type", "")
    except (ValueError, AttributeError):
        return None
    return slug_of(kind) if isinstance(kind, str) and kind else None


def plural(count: int, noun: str) -> str:
    """`1 time`, `2 times`, `1 retry`, `5 retries`."""
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun[:-1]}ies" if noun.endswith("y") else f"{count} {noun}s"


def _short(body: bytes, limit: int = 80) -> str:
    return repr(body) if len(body) <= limit else repr(body[:limit]) + f"... ({len(body)} bytes)"


def changed(body: bytes) -> bytes:
    """Another request's body: a JSON object gets one more field, anything else one more suffix."""
    try:
        value = _json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict):
        value["idem_storm_changed"] = True
        return _json.dumps(value).encode()
    return body + b"-changed" if body else b"changed"


def summary(answers: Iterable[Answer]) -> str:
    counts = Counter(a.label for a in answers)
    return ", ".join(f"{label} x{n}" for label, n in counts.items())


def unexpected(kr: KeyReport, phase: str, allowed: Callable[[Answer], bool], what: str) -> None:
    bad = [a for a in kr.answers if a.phase == phase and a.kind != "middleware-error" and not a.timed_out]
    bad = [a for a in bad if not allowed(a)]
    if bad:
        kr.problems.append(f"{phase} requests got {summary(bad)}; expected {what}")
