"""RFC 9457 problem answers sent to HTTP clients, one stable `type` per case, with its usual text.

The middleware sends these itself; it never raises them into the application. Every refusal
carries `Cache-Control: no-store` so no cache keeps it. Its `type` is `<problem_base><slug>`:
by default `urn:idem-asgi:problem:<slug>`, an identifier that does not pretend to be a page (no
address this project serves exists to send clients to). A deployer makes the links resolve with
one setting: `problem_base="/problems/"` (a path of the app: the middleware answers GET
`/problems/<slug>` itself, `idem_asgi.http.problem_pages`) or their own docs' URL. With either, the
refusal also carries `Link: <type>; rel="describedby"`, the documentation link
draft-ietf-httpapi-idempotency-key-header asks for on the 400 and 422 answers.

Each case's page text (what happened, what a client should do) lives here, once: the pages and
docs/problems.md are both made from it (tools/problems_doc.py; a test compares the page).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote

import msgspec

from .._types import Scope, Send
from ..errors import ConfigurationError

DEFAULT_PROBLEM_BASE: Final = "urn:idem-asgi:problem:"
"""The default `type` prefix (idem-asgi 0.1.0's too): it names the case, it locates nothing."""
_encode = msgspec.json.encode
_PATH_SAFE: Final = "/:@!$&'()*+,;=-._~"


def check_base(base: str) -> str:
    """`base` if it can prefix a `type`: the default, an http(s) URL or a path of the app (served)."""
    if base == DEFAULT_PROBLEM_BASE:
        return base
    if base.startswith(("https://", "http://")) and base.endswith(("#", "/")):
        return base
    if served(base) and "#" not in base and "?" not in base:
        return base
    raise ConfigurationError(
        "problem_base must be a path of this app ending in '/' (the middleware serves the pages there, e.g. "
        f"'/problems/') or an absolute http(s) URL of your docs ending in '#' or '/' (the slug follows), got {base!r}"
    )


def served(base: str) -> bool:
    """Whether `base` is a path of the app, where the middleware serves the problem pages itself."""
    return base.startswith("/") and not base.startswith("//") and base.endswith("/")


def located(base: str, scope: Scope) -> str:
    """`base` as the client sees it: a served path under the mount (`root_path`), anything else as is."""
    root: str = scope.get("root_path", "") if served(base) else ""
    return quote(root.rstrip("/"), safe=_PATH_SAFE) + base if root else base


def slug_of(type_value: str) -> str | None:
    """The case (`key-required`, ...) of a problem `type` made by any base: the part after the last
    `#`, `/` or `:` (the default URNs, a docs URL's anchor or path, a served page's path)."""
    slug = re.split(r"[#/:]", type_value.rstrip("/"))[-1]
    return slug or None


@dataclass(frozen=True, slots=True)
class ProblemType:
    """One kind of refusal: its stable `type` suffix, HTTP status, title, usual detail and page text."""

    slug: str
    status: int
    title: str
    detail: str = ""
    """The human `detail` sent when the caller gives none."""
    happened: str = ""
    """What happened, for its page (a paragraph; `code` in backticks)."""
    to_do: str = ""
    """What a client should do, for its page."""

    @property
    def type(self) -> str:
        """The `type` under the default base (`url(base)` for another)."""
        return DEFAULT_PROBLEM_BASE + self.slug

    def url(self, base: str = DEFAULT_PROBLEM_BASE) -> str:
        return base + self.slug


KEY_REQUIRED: Final = ProblemType(
    "key-required",
    400,
    "Idempotency key required",
    "This operation requires an idempotency key header.",
    happened="The route requires an idempotency key (`RoutePolicy(required=True)`) and the request had none, "
    "or (for a route that derives its key) lacked the fields the key is made of.",
    to_do="send the request again with an `Idempotency-Key` header (or the route's own header) holding a fresh "
    "unique value, and keep that same value for every retry of this one operation. Nothing ran.",
)
KEY_MALFORMED: Final = ProblemType(
    "key-malformed",
    400,
    "Malformed idempotency key",
    "The idempotency key is malformed.",
    happened="The key header is empty, longer than 255 characters, holds characters outside visible ASCII "
    "(0x21-0x7E), is badly quoted, or was sent twice.",
    to_do="fix the client's key generation (a UUID is fine), then send again. Nothing ran.",
)
SCOPE_MALFORMED: Final = ProblemType(
    "scope-malformed",
    400,
    "Malformed idempotency scope",
    "The value records are scoped by (e.g. a tenant header) is ambiguous or cannot be stored.",
    happened="The value records are scoped by (for example a tenant header) was sent twice, holds a NUL or is "
    "not valid Unicode, or the server's scope function returned something unusable.",
    to_do="send one well-formed scope header; if the scope comes from authentication, this is a server bug "
    "worth reporting. Nothing ran.",
)
SCOPE_REQUIRED: Final = ProblemType(
    "scope-required",
    400,
    "Idempotency scope required",
    "This operation keeps idempotency records per caller, and this request names none "
    "(no authenticated user, or no tenant header).",
    happened="The route keeps idempotency records per caller, and this request names no caller (no "
    "authenticated user, or no tenant header).",
    to_do="authenticate (or send the tenant header) and retry with the same key. Nothing ran.",
)
BODY_TOO_LARGE: Final = ProblemType(
    "body-too-large",
    413,
    "Request body too large",
    "The request body is too large.",
    happened="The request body is over the route's limit (`RoutePolicy(max_body=...)`, 1 MiB by default; for "
    "signed webhooks, `SignatureMiddleware(max_body=...)`).",
    to_do="send a smaller body; retrying the same body will be refused again. Nothing ran.",
)
IN_PROGRESS: Final = ProblemType(
    "request-in-progress",
    409,
    "A request with this key is in progress",
    "The first request with this key is still running; retry after the indicated delay.",
    happened="The first request with this key is still running on the server.",
    to_do="wait for the `Retry-After` header's delay and send exactly the same request with the same key "
    "again: you will get the first request's answer (a replay) once it has finished. Do not change the key, "
    "or the operation may run twice.",
)
FINGERPRINT_MISMATCH: Final = ProblemType(
    "fingerprint-mismatch",
    422,
    "Idempotency key reused with a different request",
    "This idempotency key was already used for a different request (method, path, query or body).",
    happened="This key was already used for a different request (a different method, path, query or body, as "
    "far as the route's fingerprint compares them). A route built with `mismatch_status=409` answers it with "
    "409 (for protocols that ask for it), the same problem otherwise.",
    to_do="this is a client bug: one key must name one operation. Use a new key for a new operation; to "
    "repeat the old one, send its original request unchanged. Nothing ran. (One exception: right after a "
    "server upgrade that changed how a route compares bodies, such as the new `Fields` encoding, a retry of a "
    "request answered before the upgrade gets this answer too; the first request did run, once.)",
)
OUTCOME_UNKNOWN: Final = ProblemType(
    "outcome-unknown",
    409,
    "Outcome of the first request is unknown",
    "A request with this key started but did not finish cleanly; its outcome is being reconciled. "
    "Check the resource's state before trying again.",
    happened="A request with this key started but did not finish cleanly (its server died mid-request, or it "
    "failed after the answer had started or after an irreversible effect), so the server does not know "
    "whether the operation happened. It will not run it again on its own.",
    to_do="do not retry blindly. Check the state of the resource (for a payment: ask for the order or charge "
    "by its reference); the server resolves the record (its `recover` hook, or `idem-asgi reconcile`), after "
    "which a retry gets the real answer.",
)
MISMATCH_409: Final = dataclasses.replace(FINGERPRINT_MISMATCH, status=409)


def mismatch(status: int) -> ProblemType:
    """`fingerprint-mismatch` under the route's `mismatch_status`: one type, one body, two statuses."""
    return MISMATCH_409 if status == 409 else FINGERPRINT_MISMATCH


NOT_STORED: Final = ProblemType(
    "response-not-stored",
    409,
    "Request completed but its response was not stored",
    "The request with this key completed, but its response was too large to store; "
    "fetch the current state of the resource instead of retrying.",
    happened="The request with this key completed, but its answer was too large to keep, so it cannot be replayed.",
    to_do="the operation happened: fetch the current state of the resource instead of retrying.",
)
RESPONSE_EXPIRED: Final = ProblemType(
    "response-expired",
    409,
    "Request completed; its answer is no longer kept",
    "The request with this key completed; its answer was kept for the route's replay period and is gone. "
    "Nothing ran again.",
    happened="The request with this key completed (the problem says when, `completed_at`, and with which status, "
    "`completed_status`; its `Location` header names what it made, when it made something). Its answer's bytes "
    "are kept for the route's `replay_ttl` only; the key still refuses to run again until its `ttl` ends.",
    to_do="the operation happened, once: do not retry it with this key. Fetch the resource it made (its "
    "`Location`) for its current state. Nothing ran.",
)
KEY_QUOTA: Final = ProblemType(
    "key-quota-exceeded",
    429,
    "Too many idempotency records for this caller",
    "This caller holds its full share of the idempotency store; retry after the indicated delay.",
    happened="This caller holds its full share of the server's in-memory idempotency store.",
    to_do="wait for `Retry-After` and retry with the same key. Nothing ran.",
)
STORE_UNAVAILABLE: Final = ProblemType(
    "store-unavailable",
    503,
    "Idempotency store unavailable",
    "The idempotency store cannot be reached, so the request was not run; retry later.",
    happened="The idempotency store could not be reached (or is full, or a durable claim was not confirmed by "
    "its replicas), so the request was not run: running it unprotected could apply it twice.",
    to_do="wait for `Retry-After` and retry with the same key. Nothing ran.",
)
STORE_MISCONFIGURED: Final = ProblemType(
    "store-misconfigured",
    500,
    "Idempotency store misconfigured",
    "The server's idempotency store refuses it (credentials, rights or schema), so the request was not run.",
    happened="The server's idempotency store refuses this server (credentials, rights or schema), so the "
    "request was not run.",
    to_do="nothing on the client side but to retry later; the server's log says how to fix it.",
)
SIGNATURE_MALFORMED: Final = ProblemType(
    "signature-malformed",
    400,
    "Malformed webhook signature",
    happened="A webhook delivery's signature header is missing, repeated or unparseable (`SignatureMiddleware`).",
    to_do="(providers) send the signature header your scheme defines. Nothing ran.",
)
SIGNATURE_INVALID: Final = ProblemType(
    "signature-invalid",
    401,
    "Invalid webhook signature",
    happened="No configured secret matches the webhook delivery's signature, or its timestamp is outside the "
    "tolerance.",
    to_do="check the signing secret on both sides (during a rotation the server accepts every configured "
    "secret); redeliver. Nothing ran.",
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
    RESPONSE_EXPIRED,
    KEY_QUOTA,
    STORE_UNAVAILABLE,
    STORE_MISCONFIGURED,
)
"""The cases `IdempotencyMiddleware` answers."""
DOCUMENTED: Final = (*ALL, SIGNATURE_MALFORMED, SIGNATURE_INVALID)
"""Every case either middleware answers: one page each (docs/problems.md, `problem_pages`)."""


async def send_problem(
    send: Send,
    problem: ProblemType,
    detail: str | None = None,
    *,
    retry_after: int | None = None,
    base: str = DEFAULT_PROBLEM_BASE,
    members: dict[str, object] | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send `problem` as a complete `application/problem+json` response, its `type` under `base`
    (`located()` for a served path); a `Link` to it unless it is the default's bare identifier.
    `members` are the problem's extension members (RFC 9457 3.2), `headers` more headers to send."""
    url = base + problem.slug
    doc: dict[str, object] = {"type": url, "title": problem.title, "status": problem.status}
    doc["detail"] = detail or problem.detail
    body = _encode({**doc, **members} if members else doc)
    sent = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode("ascii")),
        (b"cache-control", b"no-store"),
    ]
    if base != DEFAULT_PROBLEM_BASE:  # a page exists: the deployer's docs, or ours served by the middleware
        sent.append((b"link", b"<" + url.encode("ascii", "replace") + b'>; rel="describedby"'))
    if retry_after is not None:
        sent.append((b"retry-after", str(retry_after).encode("ascii")))
    if headers:
        sent += headers
    await send({"type": "http.response.start", "status": problem.status, "headers": sent})
    await send({"type": "http.response.body", "body": body, "more_body": False})
