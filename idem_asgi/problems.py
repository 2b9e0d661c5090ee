"""RFC 9457 problem answers sent to HTTP clients, one stable `type` per case, with its usual text.

The middleware sends these itself; it never raises them into the application.
Every refusal carries `Cache-Control: no-store` so no cache keeps it, and
`Link: <type>; rel="describedby"`: the `type` is a URL (`problem_base` + the case's slug) whose
page says what happened and what a client should do (docs/problems.md, one anchor per slug), as
draft-ietf-httpapi-idempotency-key-header asks for the 400 and 422 answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from ._types import Send
from .errors import ConfigurationError

DEFAULT_PROBLEM_BASE: Final = "https://github.com/idem-asgi/idem-asgi/blob/main/docs/problems.md#"
"""Where the `type` URLs point by default: this project's docs/problems.md, one anchor per slug."""
LEGACY_PREFIX: Final = "urn:idem-asgi:problem:"
"""The `type` prefix of idem-asgi 0.1.0 (URNs nobody could follow); `slug_of` still reads it."""
_encode = msgspec.json.encode


def check_base(base: str) -> str:
    """`base` if it can prefix a followable `type` URL (absolute http(s), ending in `#` or `/`)."""
    if not base.startswith(("https://", "http://")) or not base.endswith(("#", "/")):
        raise ConfigurationError(
            f"problem_base must be an absolute http(s) URL ending in '#' or '/' (the slug follows), got {base!r}"
        )
    return base


def slug_of(type_value: str) -> str | None:
    """The case (`key-required`, ...) of a problem `type` made by any base, or by 0.1.0's URNs."""
    if type_value.startswith(LEGACY_PREFIX):
        return type_value[len(LEGACY_PREFIX) :]
    slug = type_value.rsplit("#", 1)[-1] if "#" in type_value else type_value.rstrip("/").rsplit("/", 1)[-1]
    return slug or None


@dataclass(frozen=True, slots=True)
class ProblemType:
    """One kind of refusal: its stable `type` suffix, HTTP status, title and usual detail."""

    slug: str
    status: int
    title: str
    detail: str = ""
    """The human `detail` sent when the caller gives none."""

    @property
    def type(self) -> str:
        """The `type` URL under the default base (`url(base)` for another)."""
        return DEFAULT_PROBLEM_BASE + self.slug

    def url(self, base: str = DEFAULT_PROBLEM_BASE) -> str:
        return base + self.slug


KEY_REQUIRED: Final = ProblemType(
    "key-required", 400, "Idempotency key required", "This operation requires an idempotency key header."
)
KEY_MALFORMED: Final = ProblemType(
    "key-malformed", 400, "Malformed idempotency key", "The idempotency key is malformed."
)
SCOPE_MALFORMED: Final = ProblemType(
    "scope-malformed",
    400,
    "Malformed idempotency scope",
    "The value records are scoped by (e.g. a tenant header) is ambiguous or cannot be stored.",
)
SCOPE_REQUIRED: Final = ProblemType(
    "scope-required",
    400,
    "Idempotency scope required",
    "This operation keeps idempotency records per caller, and this request names none "
    "(no authenticated user, or no tenant header).",
)
BODY_TOO_LARGE: Final = ProblemType("body-too-large", 413, "Request body too large", "The request body is too large.")
IN_PROGRESS: Final = ProblemType(
    "request-in-progress",
    409,
    "A request with this key is in progress",
    "The first request with this key is still running; retry after the indicated delay.",
)
FINGERPRINT_MISMATCH: Final = ProblemType(
    "fingerprint-mismatch",
    422,
    "Idempotency key reused with a different request",
    "This idempotency key was already used for a different request (method, path, query or body).",
)
OUTCOME_UNKNOWN: Final = ProblemType(
    "outcome-unknown",
    409,
    "Outcome of the first request is unknown",
    "A request with this key started but did not finish cleanly; its outcome is being reconciled. "
    "Check the resource's state before trying again.",
)
NOT_STORED: Final = ProblemType(
    "response-not-stored",
    409,
    "Request completed but its response was not stored",
    "The request with this key completed, but its response was too large to store; "
    "fetch the current state of the resource instead of retrying.",
)
KEY_QUOTA: Final = ProblemType(
    "key-quota-exceeded",
    429,
    "Too many idempotency records for this caller",
    "This caller holds its full share of the idempotency store; retry after the indicated delay.",
)
STORE_UNAVAILABLE: Final = ProblemType(
    "store-unavailable",
    503,
    "Idempotency store unavailable",
    "The idempotency store cannot be reached, so the request was not run; retry later.",
)
STORE_MISCONFIGURED: Final = ProblemType(
    "store-misconfigured",
    500,
    "Idempotency store misconfigured",
    "The server's idempotency store refuses it (credentials, rights or schema), so the request was not run.",
)

ALL: Final = (
    KEY_REQUIRED,
    KEY_MALFORMED,
    SCOPE_MALFORMED,
    SCOPE_REQUIRED,
    BODY_TOO_LARGE,
    IN_PROGRESS,
    FINGERPRINT_MISMATCH,
    OUTCOME_UNKNOWN,
    NOT_STORED,
    KEY_QUOTA,
    STORE_UNAVAILABLE,
    STORE_MISCONFIGURED,
)


async def send_problem(
    send: Send,
    problem: ProblemType,
    detail: str | None = None,
    *,
    retry_after: int | None = None,
    base: str = DEFAULT_PROBLEM_BASE,
) -> None:
    """Send `problem` as a complete `application/problem+json` response, its `type` under `base`."""
    url = base + problem.slug
    body = _encode({"type": url, "title": problem.title, "status": problem.status, "detail": detail or problem.detail})
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode("ascii")),
        (b"cache-control", b"no-store"),
        (b"link", b"<" + url.encode("ascii", "replace") + b'>; rel="describedby"'),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode("ascii")))
    await send({"type": "http.response.start", "status": problem.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
