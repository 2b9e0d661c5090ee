"""The client half: httpx transports that mint ONE idempotency key per logical call and reuse it on every retry.

The most common cause of double charges is a client that makes a new key on each retry attempt: the
server then sees two different operations and runs both. These transports add the key once, before
the first attempt (or keep the one the caller minted when the user's intent began), and retry only
what is safe to retry with that same key::

    import httpx
    from idem_asgi.client import IdempotentRetryTransport, was_replayed

    async with httpx.AsyncClient(transport=IdempotentRetryTransport(), base_url="https://api.example") as client:
        r = await client.post("/payments", json={"amount": 1230})
        r.extensions["idempotency_key"], was_replayed(r)

Retried: transport errors (connection refused or reset, timeouts, a response lost on the way), 5xx
(incl. 503 `store-unavailable`) and 409 `request-in-progress` (its `type` under any `problem_base`: the
slug after the base is what counts). Never retried: every other 4xx (422
`fingerprint-mismatch`, 409 `outcome-unknown` and `response-not-stored`, 400, 429, ...), and never a
replayed answer (`Idempotent-Replayed: true`: it is final by definition, whatever its status). Waits
use exponential backoff with full jitter, or the server's `Retry-After` (delay-seconds or an
HTTP-date; a value that is neither is ignored) when it sends one; attempts and total time are
bounded, reading the final answer's body included.

httpx is imported here only, so the middleware never needs it: `pip install ".[client]"` from a
clone (`"idem-asgi[client]"` once published).
"""

from __future__ import annotations

import email.utils
import json
import random
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import anyio

from .errors import missing_extra

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise missing_extra("idem_asgi.client needs httpx", "client") from exc

from .http.problems import IN_PROGRESS, slug_of

__all__ = [
    "KEY_EXTENSION",
    "IdempotentRetrySyncTransport",
    "IdempotentRetryTransport",
    "new_key",
    "was_replayed",
]

T = TypeVar("T")
KEY_EXTENSION = "idempotency_key"
"""`response.extensions[KEY_EXTENSION]` is the key the call used, so callers can log or persist it."""

_ATTEMPTS_EXTENSION = "idempotency_attempts"

# Raised before anything reached the network for reasons a retry cannot fix (bad URL scheme, a
# request httpx refuses to encode): retrying would only repeat the bug.
_PERMANENT_ERRORS: tuple[type[httpx.TransportError], ...] = (httpx.UnsupportedProtocol, httpx.LocalProtocolError)


def new_key() -> str:
    """A fresh random key (uuid4, 32 hex characters); mint it once per user intent, never per attempt."""
    return uuid.uuid4().hex


def was_replayed(response: httpx.Response, header: str = "Idempotent-Replayed") -> bool:
    """True when the answer came from the server's idempotency store, so current state may have moved on."""
    return str(response.headers.get(header, "")).strip().lower() == "true"


class _Rules:
    """The retry rules both transports share, kept free of I/O so sync and async cannot drift apart."""

    def __init__(
        self,
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        header: str = "Idempotency-Key",
        max_attempts: int = 5,
        total_timeout: float = 30.0,
        backoff_base: float = 0.1,
        backoff_cap: float = 5.0,
        key_factory: Callable[[], str] = new_key,
        replay_header: str = "Idempotent-Replayed",
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if not total_timeout > 0:
            raise ValueError(f"total_timeout must be positive, got {total_timeout}")
        if backoff_base < 0 or backoff_cap < backoff_base:
            raise ValueError(f"need 0 <= backoff_base <= backoff_cap, got {backoff_base} and {backoff_cap}")
        if not header:
            raise ValueError("header must not be empty")
        self.methods = frozenset(m.upper() for m in methods)
        self.header = header
        self.max_attempts = max_attempts
        self.total_timeout = float(total_timeout)
        self.backoff_base = float(backoff_base)
        self.backoff_cap = float(backoff_cap)
        self.key_factory = key_factory
        self.replay_header = replay_header

    def key_for(self, request: httpx.Request) -> str | None:
        """The call's key, minted and added now if the caller brought none; None leaves the request alone.

        A request is protected when its method is one of `methods`, or when the caller attached a key
        to it anyway (opting in for, say, a DELETE).
        """
        supplied = request.headers.get(self.header)
        if supplied is not None:
            return str(supplied)
        if request.method.upper() not in self.methods:
            return None
        key = self.key_factory()
        request.headers[self.header] = key
        return key

    def cap_timeouts(self, request: httpx.Request, original: Any, remaining: float) -> None:
        """No single network operation of an attempt may outlive the call's deadline."""
        if not isinstance(original, dict):
            return
        request.extensions = {
            **request.extensions,
            "timeout": {k: remaining if v is None else min(float(v), remaining) for k, v in original.items()},
        }

    @staticmethod
    def retryable_error(exc: httpx.TransportError) -> bool:
        return not isinstance(exc, _PERMANENT_ERRORS)

    @staticmethod
    def needs_body(response: httpx.Response) -> bool:
        """Only a 409 problem needs its body read to tell `request-in-progress` from the final 409s."""
        return response.status_code == 409 and "json" in response.headers.get("content-type", "")

    def retryable(self, response: httpx.Response, body: bytes | None) -> bool:
        if was_replayed(response, self.replay_header):
            return False  # the stored answer of an earlier attempt: final, whatever its status
        if response.status_code >= 500:
            return True
        if response.status_code != 409 or body is None:
            return False
        try:
            problem = json.loads(body)
        except ValueError:
            return False
        # The slug after whatever base the server builds its types from (`<problem_base><slug>`):
        # a server behind its own docs' base is as much in progress as one with the default.
        kind = problem.get("type") if isinstance(problem, dict) else None
        return isinstance(kind, str) and slug_of(kind) == IN_PROGRESS.slug

    def wait(self, attempt: int, response: httpx.Response | None, deadline: float) -> float | None:
        """Seconds to sleep before the next attempt, or None to stop and hand over the last outcome.

        `Retry-After` (seconds) is honoured exactly, plus a little jitter so callers do not return in
        lockstep; without it the wait is full-jitter exponential backoff. A wait that would end at or
        past the deadline stops instead: the server asked us not to come back sooner.
        """
        if attempt >= self.max_attempts:
            return None
        retry_after = _retry_after(response) if response is not None else None
        if retry_after is not None:
            delay = retry_after + random.uniform(0, self.backoff_base)
        else:
            delay = random.uniform(0, min(self.backoff_cap, self.backoff_base * 2 ** (attempt - 1)))
        if time.monotonic() + delay >= deadline:
            return None
        return delay


def _retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds from now, as HTTP defines it (RFC 9110 10.2.3): delay-seconds (ASCII
    digits) or an HTTP-date (a date in the past means now). Anything else is ignored: None."""
    value = response.headers.get("retry-after", "").strip()
    if not value:
        return None
    if value.isascii() and value.isdigit():
        # More than a day's worth of digits is a day: never int() thousands of them (ValueError).
        digits = value.lstrip("0") or "0"
        return 86_400.0 if len(digits) > 5 else float(min(int(digits), 86_400))
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000" and obsolete forms: HTTP dates are UTC
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _rebuilt(response: httpx.Response, raw: bytes) -> tuple[httpx.Response, bytes]:
    """A fresh response around a body we had to read, so httpx still streams and times it; plus the decoded body.

    The fresh response keeps the raw bytes (its `Content-Encoding` still applies); the decoded copy is
    only for reading the problem's `type`.
    """
    try:
        decoded = httpx.Response(response.status_code, headers=response.headers, content=raw).content
    except httpx.DecodingError:
        decoded = b""  # unreadable, so not a problem we know: treated as final, handed over as received
    fresh = httpx.Response(
        response.status_code, headers=response.headers, stream=httpx.ByteStream(raw), extensions=response.extensions
    )
    return fresh, decoded


def _finish(response: httpx.Response, key: str, attempt: int) -> httpx.Response:
    response.extensions[KEY_EXTENSION] = key
    response.extensions[_ATTEMPTS_EXTENSION] = attempt
    return response


class _Keyed(Generic[T]):
    """The settings both transports take; see `IdempotentRetryTransport` for what each means."""

    def __init__(
        self,
        inner: T | None = None,
        *,
        methods: Iterable[str] = ("POST", "PATCH"),
        header: str = "Idempotency-Key",
        max_attempts: int = 5,
        total_timeout: float = 30.0,
        backoff_base: float = 0.1,
        backoff_cap: float = 5.0,
        key_factory: Callable[[], str] = new_key,
        replay_header: str = "Idempotent-Replayed",
    ) -> None:
        """Validate the rules now, so a bad setting fails at start-up rather than on the first payment."""
        self._rules = _Rules(
            methods=methods,
            header=header,
            max_attempts=max_attempts,
            total_timeout=total_timeout,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            key_factory=key_factory,
            replay_header=replay_header,
        )
        self._inner: T = inner if inner is not None else self._default()

    @staticmethod
    def _default() -> T:  # pragma: no cover - each transport defines its own
        raise NotImplementedError


class IdempotentRetryTransport(_Keyed[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport):
    """Wraps an async transport so each logical call has one key and safe, bounded retries.

    Args:
        inner: The transport that does the I/O; defaults to `httpx.AsyncHTTPTransport()`. Pass
            `httpx.ASGITransport(app)` to test against an app in-process.
        methods: Methods that get a key minted when the caller sent none. Any request that already
            carries the header is protected too; everything else passes through untouched, one attempt.
        header: The key header, as the server's middleware expects it.
        max_attempts: Attempts per logical call, the first included.
        total_timeout: Seconds from the first attempt until the transport gives up; an attempt still
            running then is cancelled and `httpx.TimeoutException` raised.
        backoff_base: First backoff ceiling in seconds; it doubles per attempt (full jitter).
        backoff_cap: Largest backoff ceiling in seconds.
        key_factory: Mints a key when the caller supplied none; called once per logical call.
        replay_header: The header the server marks replays with; a replayed answer is never retried.
    """

    @staticmethod
    def _default() -> httpx.AsyncBaseTransport:
        return httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send one logical call: key it once, then attempt until an answer is final or the budget is spent."""
        rules = self._rules
        key = rules.key_for(request)
        if key is None:
            return await self._inner.handle_async_request(request)
        await request.aread()  # a streamed body is read once, so every attempt can send it again
        timeouts = request.extensions.get("timeout")
        deadline = time.monotonic() + rules.total_timeout
        for attempt in range(1, rules.max_attempts + 1):
            remaining = max(deadline - time.monotonic(), 0.001)
            rules.cap_timeouts(request, timeouts, remaining)
            outcome: tuple[httpx.Response, bytes | None] | None = None
            try:
                with anyio.move_on_after(remaining):
                    outcome = await self._attempt(request)
            except httpx.TransportError as exc:
                delay = rules.wait(attempt, None, deadline) if rules.retryable_error(exc) else None
                if delay is None:
                    raise
                await anyio.sleep(delay)
                continue
            if outcome is None:
                raise httpx.TimeoutException(
                    f"idempotent call gave up after total_timeout={rules.total_timeout}s (attempt {attempt}); "
                    f"retry later with the same key {key!r}",
                    request=request,
                )
            response, body = outcome
            delay = rules.wait(attempt, response, deadline) if rules.retryable(response, body) else None
            if delay is None:
                return _finish(await self._read(response, request, deadline), key, attempt)
            await response.aclose()
            await anyio.sleep(delay)
        raise AssertionError("unreachable: the last attempt always returns or raises")  # pragma: no cover

    async def _read(self, response: httpx.Response, request: httpx.Request, deadline: float) -> httpx.Response:
        """The final answer with its body read within the call's deadline (`total_timeout` covers it)."""
        if response.is_stream_consumed:
            return response
        raw: bytes | None = None
        try:
            with anyio.move_on_after(max(deadline - time.monotonic(), 0.001)):
                raw = b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()
        if raw is None:
            raise httpx.TimeoutException(
                f"idempotent call gave up reading the answer after total_timeout={self._rules.total_timeout}s",
                request=request,
            )
        return _rebuilt(response, raw)[0]

    async def _attempt(self, request: httpx.Request) -> tuple[httpx.Response, bytes | None]:
        """One attempt; a 409 problem's body is read here, inside the deadline, to learn its type."""
        response = await self._inner.handle_async_request(request)
        if not self._rules.needs_body(response):
            return response, None
        if response.is_stream_consumed:  # built in memory (MockTransport and the like): the body is already here
            return response, response.content
        try:
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()
        return _rebuilt(response, raw)

    async def aclose(self) -> None:
        """Close the inner transport, which this wrapper owns once given."""
        await self._inner.aclose()


class IdempotentRetrySyncTransport(_Keyed[httpx.BaseTransport], httpx.BaseTransport):
    """The same rules for `httpx.Client`.

    Args:
        inner: The transport that does the I/O; defaults to `httpx.HTTPTransport()`.
        methods: Methods that get a key minted when the caller sent none.
        header: The key header.
        max_attempts: Attempts per logical call, the first included.
        total_timeout: Seconds from the first attempt until the transport gives up. A blocking call
            cannot be cancelled, so each network operation's timeout is capped to the time left instead.
        backoff_base: First backoff ceiling in seconds; it doubles per attempt (full jitter).
        backoff_cap: Largest backoff ceiling in seconds.
        key_factory: Mints a key when the caller supplied none; called once per logical call.
        replay_header: The header the server marks replays with; a replayed answer is never retried.
    """

    @staticmethod
    def _default() -> httpx.BaseTransport:
        return httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        """Send one logical call: key it once, then attempt until an answer is final or the budget is spent."""
        rules = self._rules
        key = rules.key_for(request)
        if key is None:
            return self._inner.handle_request(request)
        request.read()  # a streamed body is read once, so every attempt can send it again
        timeouts = request.extensions.get("timeout")
        deadline = time.monotonic() + rules.total_timeout
        for attempt in range(1, rules.max_attempts + 1):
            rules.cap_timeouts(request, timeouts, max(deadline - time.monotonic(), 0.001))
            try:
                response, body = self._attempt(request)
            except httpx.TransportError as exc:
                delay = rules.wait(attempt, None, deadline) if rules.retryable_error(exc) else None
                if delay is None:
                    raise
                time.sleep(delay)
                continue
            delay = rules.wait(attempt, response, deadline) if rules.retryable(response, body) else None
            if delay is None:
                return _finish(self._read(response, request, deadline), key, attempt)
            response.close()
            time.sleep(delay)
        raise AssertionError("unreachable: the last attempt always returns or raises")  # pragma: no cover

    def _read(self, response: httpx.Response, request: httpx.Request, deadline: float) -> httpx.Response:
        """The final answer with its body read, given up between two chunks once the deadline passed."""
        if response.is_stream_consumed:
            return response
        chunks: list[bytes] = []
        try:
            for chunk in response.iter_raw():
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise httpx.TimeoutException(
                        f"idempotent call gave up reading the answer after total_timeout={self._rules.total_timeout}s",
                        request=request,
                    )
        finally:
            response.close()
        return _rebuilt(response, b"".join(chunks))[0]

    def _attempt(self, request: httpx.Request) -> tuple[httpx.Response, bytes | None]:
        """One attempt; a 409 problem's body is read here to learn its type."""
        response = self._inner.handle_request(request)
        if not self._rules.needs_body(response):
            return response, None
        if response.is_stream_consumed:  # built in memory (MockTransport and the like): the body is already here
            return response, response.content
        try:
            raw = b"".join(response.iter_raw())
        finally:
            response.close()
        return _rebuilt(response, raw)

    def close(self) -> None:
        """Close the inner transport, which this wrapper owns once given."""
        self._inner.close()
