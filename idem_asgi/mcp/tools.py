"""`IdempotentTools`: the ASGI wrapper that claims a `tools/call`'s key and runs, replays or refuses it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any, Final, Literal

import msgspec

from .._logging import redact
from .._types import ASGIApp, Message, Receive, Scope, Send
from ..backends import Backend
from ..claims.surfaces import JOB, expect_results
from ..errors import BackendError, BackendMisconfigured, ConfigurationError, InvalidScope, MalformedKey, StoreFull
from ..http import problems
from ..http.keys import parse_key, stored_scope
from ..http.middleware import check_store
from ..http.problems import ProblemType
from ..jobs.decorator import InProgress, JobTerms, KeyReused, OutcomeUnknown, _runtime, claimed
from ..observe import Observer
from . import wire

logger = logging.getLogger("idem_asgi")

MAX_BODY: Final = 4 * 1024 * 1024
"""The largest request body read to find a key (the SDK's own limit); a larger one passes through."""
ScopeOf = Callable[[Scope], "str | int | None"]
"""Reads a call's owner (tenant, user) from the ASGI scope; None: nobody."""
_decode_result = msgspec.msgpack.Decoder(dict[str, Any]).decode
_MISMATCH: Final = "This idempotency key was already used for another tool call (another tool, or other arguments)."


class IdempotentTools:
    """Wrap an MCP server's streamable HTTP app so each `tools/call` runs once per idempotency key.

    Args:
        app: The MCP server's ASGI app (`streamable_http_app()` of the SDK's `MCPServer`, or any
            app speaking streamable HTTP).
        backend: The store: `MemoryBackend()`, `RedisBackend`, `PostgresBackend`.
        key: Where a call's key is read: `"header"` (the HTTP header `header`, as the middleware
            reads it) or `"meta"` (the string `params._meta[meta]`, which the SDK's client sends with
            `call_tool(..., meta={"idempotency_key": ...})`).
        tools: The tool names to protect (default: every tool).
        required: Refuse a protected call without a key (`key-required`) instead of running it
            unprotected.
        namespace: The key space of these tools' records (job and HTTP keys never meet it).
        scope: Called with the ASGI scope, returns the key's owner (a tenant header your gateway
            sets, `scope_from_token_hash()`); a call it names nobody for is refused
            (`scope-required`). Default: one key space for every caller. It runs before the app, so
            before any auth middleware inside the app.
        ttl: Seconds a result is kept and replayed.
        lease: Seconds a claim lives without renewal (renewed while the tool runs).
        wait: Seconds a repeat of a call still running waits for its result before the
            `request-in-progress` error.
        max_body: The largest body read to find a key; a larger one passes through unread.
        observer: Called with an `Event` at each decision (route = namespace), as the middleware's.
    """

    def __init__(
        self,
        app: ASGIApp,
        backend: Backend,
        *,
        key: Literal["header", "meta"] = "header",
        header: str = "Idempotency-Key",
        meta: str = "idempotency_key",
        tools: Collection[str] | None = None,
        required: bool = False,
        namespace: str = "mcp",
        scope: ScopeOf | None = None,
        ttl: float = 86_400,
        lease: float = 30,
        wait: float = 0,
        max_body: int = MAX_BODY,
        observer: Observer | None = None,
    ) -> None:
        if key not in ("header", "meta"):
            raise ConfigurationError(f"IdempotentTools(key=...) is 'header' or 'meta', got {key!r}")
        if isinstance(tools, str):
            raise ConfigurationError("IdempotentTools(tools=...) is a collection of tool names, not one string")
        self.app = app
        self.backend = backend
        self.key_source = key
        self.header = header.lower().encode("latin-1")
        self.meta = meta
        self.tools = None if tools is None else frozenset(tools)
        self.required = required
        self.scope = scope
        self.max_body = max_body
        self.terms = JobTerms(namespace, lease, ttl, wait)
        self.runtime = _runtime(backend, observer)  # once: the store's machinery, shared with every surface
        expect_results(namespace, dict[str, Any])  # recover hooks and resolvers answer with a result object

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            if scope["type"] == "lifespan":
                send = self._lifespan_send(send)
            await self.app(scope, receive, send)
            return
        messages, whole = await wire.read(receive, self.max_body)
        receive = wire.replaying(messages, receive)
        call = wire.tool_call(b"".join(m.get("body", b"") for m in messages)) if whole else None
        if call is None or (self.tools is not None and call.name not in self.tools):
            await self.app(scope, receive, send)
            return
        try:
            key = self._key(scope, call)
            if key is None:  # no key, none required: unprotected, whoever calls
                await self.app(scope, receive, send)
                return
            owner = self._owner(scope)
        except _Refusal as refusal:
            await wire.respond(scope, send, call.id, wire.error(refusal.problem, refusal.detail))
            return
        await self._claimed(scope, receive, send, call, key, owner)

    def _key(self, scope: Scope, call: wire.Call) -> str | None:
        """The call's key (None: it has none and need not), or `_Refusal`."""
        if self.key_source == "meta":
            value = call.meta.get(self.meta)
            if value is not None and not isinstance(value, str):
                raise _Refusal(problems.KEY_MALFORMED, f"params._meta.{self.meta} must be a string")
            raw = None if value is None else value.encode("utf-8")
        else:
            lines = [v for k, v in scope["headers"] if k == self.header]
            if len(lines) > 1:
                raise _Refusal(problems.KEY_MALFORMED, "Send exactly one idempotency key header.")
            raw = lines[0] if lines else None
        if raw is None:
            if self.required:
                raise _Refusal(problems.KEY_REQUIRED, f"The tool {call.name!r} requires an idempotency key.")
            return None
        try:
            return parse_key(raw)
        except MalformedKey as exc:
            raise _Refusal(problems.KEY_MALFORMED, f"The idempotency key is malformed: {exc}.") from None

    def _owner(self, scope: Scope) -> str | None:
        """The call's owner under `scope=` (None without one), or `_Refusal`."""
        if self.scope is None:
            return None
        try:
            found = self.scope(scope)
        except InvalidScope as exc:
            raise _Refusal(problems.SCOPE_MALFORMED, str(exc)) from None
        except Exception as exc:  # its text may carry the credential it was reading
            logger.error("idem_asgi: the MCP scope callable raised %s: %s", type(exc).__name__, redact(str(exc)))
            raise _Refusal(problems.SCOPE_MALFORMED, "The scope of this call could not be determined.") from None
        if found is None or found == "":  # nobody: an empty header is no tenant, as on HTTP
            raise _Refusal(problems.SCOPE_REQUIRED)
        try:
            return stored_scope(found)
        except InvalidScope as exc:
            raise _Refusal(problems.SCOPE_MALFORMED, str(exc)) from None

    async def _claimed(
        self, scope: Scope, receive: Receive, send: Send, call: wire.Call, key: str, owner: str | None
    ) -> None:
        """Claim the key (the claim core, as a job does): replay, refuse, or run the app once and
        store its result. Inside the app the claim is `current_job()` / `current_idempotency()`."""
        ran = False
        try:
            async with claimed(self.runtime, self.terms, key, owner, JOB + call.fingerprint, None) as job:
                if job.done:
                    assert job.result is not None
                    replay = {"result": _decode_result(job.result)}
                    await wire.respond(scope, send, call.id, replay, replayed=True)
                    return
                ran = True
                answer = wire.Answer(send, call.id)
                await self.app(scope, receive, answer.send)
                if answer.cut:
                    raise _Cut  # no answer: kept to its lease, like a crash (the tool may have run)
                result = answer.result()
                if result is None:
                    return  # an error, a failed tool, a request for input: released (kept after mark_effect())
                try:
                    await job.store(result)
                except Exception as exc:  # its client has the answer; repeats get outcome-unknown
                    logger.error("idem_asgi: tool call key %r: its result was not stored: %s", key, exc)
        except _Cut:
            return
        except (InProgress, KeyReused, OutcomeUnknown, BackendError) as exc:
            if ran:
                raise  # the app's own (a job it called), not this call's claim
            await wire.respond(scope, send, call.id, _refused(key, exc))

    def _lifespan_send(self, send: Send) -> Send:
        """Check the store once the app has started, as the middleware does."""

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                problem = await check_store(self.backend)
                if problem is not None:
                    await send({"type": "lifespan.startup.failed", "message": problem})
                    return
            await send(message)

        return lifespan_send


class _Refusal(Exception):
    """A call refused before its claim: the problem to answer it with."""

    def __init__(self, problem: ProblemType, detail: str | None = None) -> None:
        self.problem = problem
        self.detail = detail


class _Cut(BaseException):
    """The first call ended without an answer: `claimed` keeps its claim to its lease (an
    interruption, as on the job surface)."""


def _refused(key: str, exc: Exception) -> dict[str, Any]:
    """The error member for a claim that did not run the call."""
    if isinstance(exc, InProgress):
        return wire.error(problems.IN_PROGRESS, retry_after=1)
    if isinstance(exc, KeyReused):
        return wire.error(problems.FINGERPRINT_MISMATCH, _MISMATCH)
    if isinstance(exc, OutcomeUnknown):
        return wire.error(problems.OUTCOME_UNKNOWN)
    if isinstance(exc, BackendMisconfigured):
        return wire.error(problems.STORE_MISCONFIGURED)
    logger.warning("idem_asgi: tool call key %r not run, the store could not claim it: %s", key, exc)
    if isinstance(exc, StoreFull) and exc.scope_quota:
        return wire.error(problems.KEY_QUOTA, retry_after=1)
    return wire.error(problems.STORE_UNAVAILABLE, retry_after=1)
