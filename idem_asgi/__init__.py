"""idem_asgi: a retried request has its effect once; every repeat gets the first answer back."""

from .backends import Backend, backend_from_url
from .context import IdempotencyInfo, current_idempotency, held_claim
from .errors import (
    BackendError,
    BackendMisconfigured,
    BackendUnavailable,
    ConfigurationError,
    IdemError,
    InvalidScope,
    StoreFull,
)
from .http.derived import event_id, intent_key
from .http.fingerprint import Fields, JsonIgnoring, RawBody, custom
from .http.keys import scope_from_header, scope_from_state, scope_from_token_hash, scope_from_user
from .http.middleware import IdempotencyMiddleware, startup_check
from .http.openapi import add_openapi
from .http.policy import RoutePolicy
from .http.signatures import HmacScheme, SignatureMiddleware, StandardWebhooksScheme, StripeScheme
from .records import Record, RecordKey, StaleRecord, StoredResponse

__all__ = [
    "Backend",
    "BackendError",
    "BackendMisconfigured",
    "BackendUnavailable",
    "ConfigurationError",
    "Fields",
    "HmacScheme",
    "IdemError",
    "IdempotencyInfo",
    "IdempotencyMiddleware",
    "InvalidScope",
    "JsonIgnoring",
    "RawBody",
    "Record",
    "RecordKey",
    "RoutePolicy",
    "SignatureMiddleware",
    "StaleRecord",
    "StandardWebhooksScheme",
    "StoreFull",
    "StoredResponse",
    "StripeScheme",
    "add_openapi",
    "backend_from_url",
    "current_idempotency",
    "custom",
    "event_id",
    "held_claim",
    "intent_key",
    "scope_from_header",
    "scope_from_state",
    "scope_from_token_hash",
    "scope_from_user",
    "startup_check",
]
