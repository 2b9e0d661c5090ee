"""Route policies: which requests are protected, and how.

Policies match the request path relative to the mount (`scope["path"]` minus `scope["root_path"]`,
see `idem_asgi.http.routing`), never a framework's route template: a pure ASGI middleware runs before
routing and cannot see templates.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

from ..claims.recovery import RecoverHook as RecoverHook  # re-exported: the route's `recover=` type
from ..errors import ConfigurationError
from .fingerprint import FingerprintRule

if TYPE_CHECKING:
    from ..records import StoredResponse
    from .derived import KeySource
    from .keys import ScopeFunc

Duration = int | float | timedelta

DEFAULT_EXCLUDED_HEADERS: frozenset[str] = frozenset(
    {
        "set-cookie",
        "www-authenticate",
        "proxy-authenticate",
        "authorization",
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "transfer-encoding",
        "upgrade",
    }
)


TRANSIENT_STATUSES: frozenset[int] = frozenset({*range(500, 600), 401, 407, 408, 425, 429})
"""Answers that mean "try again" (server error, authenticate, timeout, too early, rate limited): released."""


def seconds(value: Duration) -> float:
    """Seconds in `value` (a number of seconds or a timedelta)."""
    s = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not s > 0:
        raise ConfigurationError(f"durations must be positive, got {value!r}")
    return s


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """How one group of routes is protected."""

    path: str
    """`/payments`, `/orders/{order_id}/refunds` (one path segment per `{name}`), or `/api/*` (prefix)."""

    methods: Iterable[str] = ("POST", "PATCH")
    """HTTP methods protected on this path; other methods pass through."""

    ttl: Duration = 86_400
    """How long a completed answer is kept and replayed (seconds or timedelta); 24 h by default."""

    lease: Duration = 30
    """How long a claim stays live without renewal; renewed every third of it while the app runs."""

    required: bool = False
    """Answer 400 when the key is missing; otherwise a request without a key passes through unprotected."""

    header: str | None = None
    """Key header name for this route; defaults to the middleware's (`Idempotency-Key`)."""

    max_body: int = 1 << 20
    """Largest request body buffered, in bytes; larger requests get 413 before any claim."""

    max_stored_body: int = 1 << 20
    """Largest response body stored for replay; a larger one reaches the first client whole and
    is recorded as completed-not-replayable."""

    release_statuses: Container[int] = TRANSIENT_STATUSES
    """Statuses that release the claim instead of storing it, so a retry runs again: every 5xx and
    401, 407, 408, 425, 429 by default (a retry after a refreshed token or a rate-limit wait must run).
    Other answers (400, 403, 404, 409, 422, ...) are stored and replayed. After the handler marked
    an effect (`mark_effect()`), no status releases: the record ends outcome-unknown instead."""

    fingerprint: FingerprintRule | None = None
    """What makes two requests the same operation: `RawBody()` (the default), `JsonIgnoring("ts")` or
    `custom(fn)`. With a derived `key`, the key's own rule is the default."""

    key: KeySource | None = None
    """Derive the key from the request instead of the header: `intent_key(...)`, `event_id(...)`, or any
    `fn(scope, body, header_key) -> str | None` (None: no key; 400 when `required`)."""

    scope: ScopeFunc | None = None
    """Who the key belongs to (tenant, user, API key id); overrides the middleware's scope callable."""

    single_tenant: bool = False
    """Declare that this route has one key space for every caller (webhooks, internal jobs): no scope
    callable applies. Without it, a route needs a scope callable (strict mode, the default)."""

    anonymous: bool = False
    """When the scope callable names nobody, run the request in one key space kept for anonymous
    callers instead of refusing it with 400 `scope-required`."""

    wait: Duration | None = None
    """Hold a repeat of an in-progress request up to this long and replay when done; None answers 409 at once."""

    retry_after: int = 1
    """Seconds put in `Retry-After` on 409 in-progress and 503 answers."""

    advertise_expiry: bool = False
    """Add `Idempotency-Expires: <HTTP-date>` to the first answer and to every replay: until when the
    stored answer is replayed (after it, the same key runs again). Never stored with the answer."""

    replay_ttl: Duration | None = None
    """How long after completion the answer's bytes are replayed, when shorter than `ttl` (e.g. 24 h
    under a 30-day `ttl`): after it the store keeps a small tombstone that still refuses to run the
    key again, and a repeat gets 409 `response-expired` (when and with which status it completed),
    or the current state on a `replay="current"` route. None: the bytes live as long as the key."""

    replay: Literal["stored", "current"] = "stored"
    """What a repeat of a completed key gets: `stored`, the first answer byte for byte; `current`, the
    current state of what it made, fetched with a `GET` of its `Location` through the app, under
    the first answer's status (the stored answer when there is nothing to fetch or the fetch fails;
    see `idem_asgi.http.current`)."""

    locate: Callable[[StoredResponse], str | None] | None = None
    """With `replay="current"`: the path of the resource a first answer made (default: its `Location`)."""

    mismatch_status: Literal[409, 422] = 422
    """The status of `fingerprint-mismatch` (the key reused with another request): 422, as the IETF
    draft asks, or 409 for protocols that ask for it (UCP). The problem body is the same either way."""

    on_expired: Literal["block", "reclaim"] = "block"
    """A lease that expired means the holder died with the outcome unknown. `block` answers
    `outcome-unknown` until the recover hook, the reconcile tool or the TTL resolves it;
    `reclaim` re-runs the request (only for handlers whose effects are idempotent downstream)."""

    recover: RecoverHook | None = None
    """Awaited on an expired lease before anything runs again: return a `StoredResponse` (store and
    replay it), `"run"` (the operation did not happen; run it now), or None (unknown; block)."""

    excluded_headers: Iterable[str] = DEFAULT_EXCLUDED_HEADERS
    """Response headers never stored (the first client still gets them)."""
