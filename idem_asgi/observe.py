"""Observability through one hook: the middleware calls `observer(event)` at each decision.

Ready-made observers: `Counters` (in-process counts, e.g. for a /metrics view or tests),
`LogObserver` (one structured log record per event), `prometheus_observer()` (prometheus-client)
and `otel_observer()` (attributes on the current OpenTelemetry span). Combine with `fan_out`.
An observer that raises is logged and ignored: observability never fails a request.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from .errors import MissingExtra, missing_extra

EventName = Literal[
    "claimed",  # a new key: the app runs
    "completed",  # its answer was stored
    "released",  # the app raised or answered a releasing status: a retry runs again
    "replayed",  # a repeat got the stored answer
    "conflict",  # a repeat while the first is running: 409
    "mismatch",  # same key, other request: 422
    "not_stored",  # completed, but the answer was too large to keep: 409
    "answer_expired",  # completed longer ago than its replay_ttl: 409 response-expired (or the current state)
    "expired",  # the holder's lease ran out: outcome unknown
    "recovered",  # the recover hook or reclaim resolved an expired lease
    "outcome_unknown",  # nothing resolved it: 409 outcome-unknown
    "unresolved",  # the app failed after its answer started or after an effect: claim kept, outcome unknown
    "interrupted",  # a job or message was cancelled or stopped after its claim: kept to its lease, like a crash
    "lease_extended",  # a long-running app's lease was renewed
    "lease_lost",  # renewal found the claim taken over
    "store_error",  # the store failed: 503 (or fail-open)
    "rejected",  # bad input: 400 or 413
    "resolved",  # an operator resolved a stuck claim (the admin app)
]
EVENT_NAMES: Final[tuple[str, ...]] = EventName.__args__  # type: ignore[attr-defined]
_log = logging.getLogger("idem_asgi")


class Event(msgspec.Struct, frozen=True, gc=False):
    """One decision of the middleware about one request (immutable; a msgspec Struct, not a frozen
    dataclass: built ten times faster, and production observers see one or two per request)."""

    name: EventName
    route: str
    """The route policy's path pattern (low cardinality: safe as a metric label)."""
    key: str | None = None
    scope: str | None = None
    status: int | None = None

    @property
    def answer(self) -> Literal["stored", "released", "kept"] | None:
        """What became of the app's answer: `stored` (replayed to every repeat, whatever its status:
        a final 402 or 409 too), `released` (a transient status or an exception: a retry runs
        again), `kept` (failed after its answer started or an effect: outcome unknown); else None."""
        return _ANSWERS.get(self.name)


Observer = Callable[[Event], None]
_ANSWERS: Final[dict[str, Literal["stored", "released", "kept"]]] = {
    "completed": "stored",
    "released": "released",
    "unresolved": "kept",
}


class Counters:
    """Counts events by name and by (route, name), in process."""

    def __init__(self) -> None:
        self.by_name: Counter[str] = Counter()
        self.by_route: Counter[tuple[str, str]] = Counter()

    def __call__(self, event: Event) -> None:
        self.by_name[event.name] += 1
        self.by_route[event.route, event.name] += 1

    def __getitem__(self, name: str) -> int:
        return self.by_name[name]


_WARNINGS: Final = frozenset({"store_error", "lease_lost", "outcome_unknown", "expired"})


def scope_digest(scope: str | None) -> str | None:
    """A short, stable digest of a scope for logs: a scope may be an API key or a token hash."""
    return None if scope is None else hashlib.sha256(scope.encode("utf-8", "surrogateescape")).hexdigest()[:16]


class LogObserver:
    """One log record per event on the logger named "idem_asgi.events", fields in `extra` for JSON formatters.

    The scope is logged as `idem_scope_digest` (16 hex characters of its sha256), never raw: some
    apps scope by an API key or a credential's hash.
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger or logging.getLogger("idem_asgi.events")
        self.level = level

    def __call__(self, event: Event) -> None:
        level = logging.WARNING if event.name in _WARNINGS else self.level
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                "idempotency %s route=%s key=%s status=%s",
                event.name,
                event.route,
                event.key,
                event.status,
                extra={
                    "idem_event": event.name,
                    "idem_route": event.route,
                    "idem_key": event.key,
                    "idem_scope_digest": scope_digest(event.scope),
                    "idem_status": event.status,
                },
            )


def fan_out(*observers: Observer) -> Observer:
    """One observer that calls each of `observers` in turn; one that raises is logged and the rest still run."""

    def observe(event: Event) -> None:
        for o in observers:
            try:
                o(event)
            except Exception:
                _log.exception("idem_asgi: observer %r failed on %r", o, event.name)

    return observe


_counters: dict[tuple[int, str], Any] = {}


def prometheus_observer(registry: Any = None, name: str = "idem_asgi_events_total") -> Observer:
    """A counter `idem_asgi_events_total{event, route}`, and `idem_asgi_answers_total{route, answer,
    status}` for what became of each app answer (stored, released, kept); needs the `prometheus`
    extra (the error says how to install it)."""
    try:
        from prometheus_client import REGISTRY
        from prometheus_client import Counter as PromCounter
    except ImportError as exc:
        raise missing_extra("prometheus_observer needs prometheus-client", "prometheus") from exc
    registry = registry or REGISTRY
    slot = (id(registry), name)
    counter = _counters.get(slot)
    if counter is None:  # a second call (an app factory, tests) reuses the series instead of failing
        counter = PromCounter(
            name.removesuffix("_total"), "Idempotency decisions", ["event", "route"], registry=registry
        )
        _counters[slot] = counter
    answers_slot = (id(registry), "idem_asgi_answers_total")
    answers = _counters.get(answers_slot)
    if answers is None:
        answers = PromCounter(
            "idem_asgi_answers",
            "What became of the app's answers: stored (replayed), released (retry runs), kept (outcome unknown)",
            ["route", "answer", "status"],
            registry=registry,
        )
        _counters[answers_slot] = answers

    def observe(event: Event) -> None:
        counter.labels(event.name, event.route).inc()
        if (answer := event.answer) is not None:
            answers.labels(event.route, answer, str(event.status or "")).inc()

    return observe


def otel_observer() -> Observer:
    """Put the decision on the current OpenTelemetry span (`idempotency.*` attributes), if any is recording."""
    try:
        from opentelemetry import trace
    except ImportError as exc:
        raise MissingExtra("otel_observer needs opentelemetry-api, which an instrumented app already has") from exc

    def observe(event: Event) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attribute("idempotency.route", event.route)
            span.set_attribute("idempotency.outcome", event.name)
            if event.answer is not None:
                span.set_attribute("idempotency.answer", event.answer)
            if event.key is not None:
                span.set_attribute("idempotency.key", event.key)
            span.add_event(f"idempotency.{event.name}")

    return observe
