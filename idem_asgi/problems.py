"""RFC 9457 problem answers sent to HTTP clients, one stable `type` per case.

The middleware sends these itself; it never raises them into the application.
Every refusal carries `Cache-Control: no-store` so no cache keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from ._types import Send

TYPE_PREFIX: Final = "urn:idem-asgi:problem:"
_encode = msgspec.json.encode


@dataclass(frozen=True, slots=True)
class ProblemType:
    """One kind of refusal: its stable `type` suffix, HTTP status and title."""

    slug: str
    status: int
    title: str

    @property
    def type(self) -> str:
        """The full `type` URI clients can switch on."""
        return TYPE_PREFIX + self.slug


KEY_REQUIRED: Final = ProblemType("key-required", 400, "Idempotency key required")
KEY_MALFORMED: Final = ProblemType("key-malformed", 400, "Malformed idempotency key")
SCOPE_MALFORMED: Final = ProblemType("scope-malformed", 400, "Malformed idempotency scope")
BODY_TOO_LARGE: Final = ProblemType("body-too-large", 413, "Request body too large")
IN_PROGRESS: Final = ProblemType("request-in-progress", 409, "A request with this key is in progress")
FINGERPRINT_MISMATCH: Final = ProblemType(
    "fingerprint-mismatch", 422, "Idempotency key reused with a different request"
)
OUTCOME_UNKNOWN: Final = ProblemType("outcome-unknown", 409, "Outcome of the first request is unknown")
NOT_STORED: Final = ProblemType("response-not-stored", 409, "Request completed but its response was not stored")
STORE_UNAVAILABLE: Final = ProblemType("store-unavailable", 503, "Idempotency store unavailable")

ALL: Final = (
    KEY_REQUIRED,
    KEY_MALFORMED,
    SCOPE_MALFORMED,
    BODY_TOO_LARGE,
    IN_PROGRESS,
    FINGERPRINT_MISMATCH,
    OUTCOME_UNKNOWN,
    NOT_STORED,
    STORE_UNAVAILABLE,
)


async def send_problem(send: Send, problem: ProblemType, detail: str, *, retry_after: int | None = None) -> None:
    """Send `problem` as a complete `application/problem+json` response."""
    body = _encode({"type": problem.type, "title": problem.title, "status": problem.status, "detail": detail})
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode("ascii")),
        (b"cache-control", b"no-store"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode("ascii")))
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
