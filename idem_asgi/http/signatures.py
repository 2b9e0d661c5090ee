"""SignatureMiddleware: refuse webhook deliveries whose HMAC does not match, before anything else runs.

Put it OUTSIDE `IdempotencyMiddleware`: a forged delivery is then answered 401 without touching
the idempotency store, so it can neither claim an event id nor be answered with a stored response.

    app = SignatureMiddleware(
        IdempotencyMiddleware(app, routes=[RoutePolicy("/webhooks/stripe", key=event_id(field="id"), ...)]),
        paths=["/webhooks/stripe"], scheme=StripeScheme(), secrets_env="STRIPE_WEBHOOK_SECRETS",
    )

A scheme reads the signature header(s) and checks them against the raw body bytes; it raises
`SignatureMalformed` (400) or `SignatureInvalid` (401). Any object with `verify` works as a scheme.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal, Protocol, runtime_checkable

from .._types import ASGIApp, Receive, Scope, Send
from ..errors import ConfigurationError
from ..errors import SignatureInvalid as SignatureInvalid  # re-exported: schemes raise them
from ..errors import SignatureMalformed as SignatureMalformed
from . import problem_pages, problems
from .asgi import TooLarge, declared_too_large, read_body, replaying
from .derived import event_id
from .policy import Duration, seconds
from .problems import SIGNATURE_INVALID as SIGNATURE_INVALID  # re-exported: defined with their pages
from .problems import SIGNATURE_MALFORMED as SIGNATURE_MALFORMED
from .routing import PathTable, method_set

logger = logging.getLogger("idem_asgi")

Headers = Sequence[tuple[bytes, bytes]]
_DIGEST_SIZE: Final = hashlib.sha256().digest_size


@runtime_checkable
class Scheme(Protocol):
    """How one provider signs its deliveries."""

    def verify(self, headers: Headers, body: bytes, secrets: Sequence[bytes]) -> None:
        """Return if one of `secrets` signed `body`; raise SignatureMalformed or SignatureInvalid otherwise."""
        ...


def signed_headers(scheme: object) -> frozenset[str]:
    """The request headers a scheme's signature covers (lower case): its `signed_headers`, else none."""
    return frozenset(h.lower() for h in getattr(scheme, "signed_headers", ()))


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def _matches(candidates: Iterable[bytes], payload: bytes, secrets: Sequence[bytes]) -> bool:
    """True if any candidate equals the HMAC of `payload` under any secret (rotation), compared in constant time."""
    expected = [_mac(s, payload) for s in secrets]
    found = False
    for candidate in candidates:
        for mac in expected:
            # No early exit: the time taken does not tell which secret or which candidate matched.
            found |= hmac.compare_digest(candidate, mac)
    return found


def _one_header(headers: Headers, name: bytes, display: str) -> bytes:
    """The single value of header `name`; two lines would leave it ambiguous which one was checked."""
    values = [v for k, v in headers if k == name]
    if not values:
        raise SignatureMalformed(f"The {display} header is missing.")
    if len(values) > 1:
        raise SignatureMalformed(f"Send exactly one {display} header, not {len(values)}.")
    return values[0]


def _hex(value: str, display: str) -> bytes:
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise SignatureMalformed(f"The {display} header carries a signature that is not hex.") from None
    if len(raw) != _DIGEST_SIZE:
        raise SignatureMalformed(f"The {display} header carries a signature that is not an HMAC-SHA256.")
    return raw


class StripeScheme:
    """Stripe-style `t=<unix time>,v1=<hex>[,v1=<hex>...]`, HMAC-SHA256 over `b"<t>." + body`.

    The timestamp is signed, so a captured delivery cannot be replayed once `tolerance` has passed;
    timestamps that far in the future are refused too (a forged clock is as bad as an old one).
    Several `v1` values (the provider's own rotation) are fine when one matches.
    """

    __slots__ = ("_header", "header", "tolerance")

    def __init__(self, *, header: str = "Stripe-Signature", tolerance: Duration = 300) -> None:
        self.header = header
        self._header = header.lower().encode("latin-1")
        self.tolerance = seconds(tolerance)

    def verify(self, headers: Headers, body: bytes, secrets: Sequence[bytes]) -> None:
        """Check the header against `body` and the clock."""
        value = _one_header(headers, self._header, self.header).decode("latin-1")
        timestamp: int | None = None
        signed_t = b""
        signatures: list[bytes] = []
        for item in value.split(","):
            name, eq, field = item.strip().partition("=")
            if not eq:
                raise SignatureMalformed(f"The {self.header} header is not a list of key=value items.")
            if name == "t":
                # Bounded length: int() of thousands of digits raises (or takes long) instead of answering 400.
                if timestamp is not None or not (field.isascii() and field.isdigit() and len(field) <= 12):
                    raise SignatureMalformed(f"The {self.header} header needs exactly one integer t=.")
                timestamp = int(field)
                signed_t = field.encode("ascii")  # as sent: "0170..." is signed as such, not re-formatted
            elif name == "v1":
                signatures.append(_hex(field, self.header))
            # Other schemes (v0) and unknown items are ignored: accepting them would allow a downgrade.
        if timestamp is None or not signatures:
            raise SignatureMalformed(f"The {self.header} header needs a t= timestamp and at least one v1= signature.")
        if not _matches(signatures, signed_t + b"." + body, secrets):
            raise SignatureInvalid(f"No v1 signature in {self.header} matches the body under the configured secrets.")
        skew = time.time() - timestamp
        if abs(skew) > self.tolerance:
            when = "old" if skew > 0 else "far in the future"
            raise SignatureInvalid(
                f"The signature timestamp is {abs(int(skew))} s {when}, outside the {self.tolerance:g} s tolerance."
            )


class HmacScheme:
    """A header carrying HMAC-SHA256(secret, body), hex or base64, after an optional fixed prefix.

    GitHub: `HmacScheme(header="X-Hub-Signature-256", prefix="sha256=")`; Shopify:
    `HmacScheme(header="X-Shopify-Hmac-Sha256", encoding="base64")`. A configured prefix is required,
    so a sender that drops it is caught as malformed rather than silently accepted under other rules.
    Nothing here is timestamped: pair it with `IdempotencyMiddleware` keyed by the event id, so a
    captured delivery sent again is a replay, not a second effect.
    """

    __slots__ = ("_header", "encoding", "header", "prefix")

    def __init__(self, *, header: str, encoding: Literal["hex", "base64"] = "hex", prefix: str = "") -> None:
        if encoding not in ("hex", "base64"):
            raise ConfigurationError(f"encoding must be 'hex' or 'base64', got {encoding!r}")
        self.header = header
        self._header = header.lower().encode("latin-1")
        self.encoding = encoding
        self.prefix = prefix

    def verify(self, headers: Headers, body: bytes, secrets: Sequence[bytes]) -> None:
        """Check the header against `body`."""
        value = _one_header(headers, self._header, self.header).decode("latin-1").strip()
        if not value.startswith(self.prefix):
            raise SignatureMalformed(f"The {self.header} header must start with {self.prefix!r}.")
        value = value[len(self.prefix) :]
        if self.encoding == "hex":
            signature = _hex(value, self.header)
        else:
            try:
                signature = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise SignatureMalformed(f"The {self.header} header carries a signature that is not base64.") from None
            if len(signature) != _DIGEST_SIZE:
                raise SignatureMalformed(f"The {self.header} header carries a signature that is not an HMAC-SHA256.")
        if not _matches([signature], body, secrets):
            raise SignatureInvalid(f"The {self.header} signature does not match the body under the configured secrets.")


class StandardWebhooksScheme:
    """Standard Webhooks (standardwebhooks.com; Svix, Clerk, Resend, OpenAI and others sign this way).

    Headers `webhook-id`, `webhook-timestamp` (unix seconds) and `webhook-signature`, a
    space-separated list of `v1,<base64 HMAC-SHA256>` over `"<id>.<timestamp>.<body>"`. Secrets are
    given as the provider shows them, `whsec_<base64>` (the key is the decoded bytes); several may be
    configured during a rotation, and a delivery may carry several signatures (the provider's own
    rotation): one match is enough. Other versions (`v1a`, asymmetric) are ignored, never accepted.
    The id and the timestamp are signed (`signed_headers`), so key the route by the delivery's id:
    `RoutePolicy(path, key=StandardWebhooksScheme.event_key, single_tenant=True)`.
    """

    __slots__ = ("tolerance",)

    signed_headers: Final = ("webhook-id", "webhook-timestamp")
    event_key: Final = event_id(header="webhook-id")
    """The route's key: the signed delivery id, the same on every redelivery."""

    def __init__(self, *, tolerance: Duration = 300) -> None:
        self.tolerance = seconds(tolerance)

    @staticmethod
    def key_bytes(secret: bytes) -> bytes:
        """The HMAC key of a `whsec_<base64>` secret (unpadded base64 accepted)."""
        encoded = secret[len(b"whsec_") :] if secret.startswith(b"whsec_") else secret
        try:
            key = base64.b64decode(encoded + b"==")
        except (binascii.Error, ValueError):
            raise ConfigurationError("a Standard Webhooks secret must be whsec_<base64>") from None
        if not key:
            raise ConfigurationError("an empty Standard Webhooks secret: anyone could sign with it")
        return key

    def verify(self, headers: Headers, body: bytes, secrets: Sequence[bytes]) -> None:
        """Check the signature over id, timestamp and body, and the clock."""
        msg_id = _one_header(headers, b"webhook-id", "webhook-id")
        stamp = _one_header(headers, b"webhook-timestamp", "webhook-timestamp")
        if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
            raise SignatureMalformed("The webhook-timestamp header must be an integer (unix seconds).")
        signatures: list[bytes] = []
        for item in _one_header(headers, b"webhook-signature", "webhook-signature").split():
            version, comma, value = item.partition(b",")
            if not comma:
                raise SignatureMalformed("The webhook-signature header is not a list of <version>,<signature>.")
            if version != b"v1":
                continue  # v1a (asymmetric) and unknown versions: never a way around v1
            try:
                signature = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise SignatureMalformed(
                    "The webhook-signature header carries a v1 signature that is not base64."
                ) from None
            if len(signature) != _DIGEST_SIZE:
                raise SignatureMalformed(
                    "The webhook-signature header carries a v1 signature that is not an HMAC-SHA256."
                )
            signatures.append(signature)
        if not signatures:
            raise SignatureMalformed("The webhook-signature header needs at least one v1,<signature>.")
        keys = [self.key_bytes(secret) for secret in secrets]
        if not _matches(signatures, msg_id + b"." + stamp + b"." + body, keys):
            raise SignatureInvalid("No v1 signature in webhook-signature matches under the configured secrets.")
        skew = time.time() - int(stamp)
        if abs(skew) > self.tolerance:
            when = "old" if skew > 0 else "far in the future"
            raise SignatureInvalid(
                f"The webhook-timestamp is {abs(int(skew))} s {when}, outside the {self.tolerance:g} s tolerance."
            )


def _load_secrets(secrets: Iterable[str | bytes] | str | bytes | None, secrets_env: str | None) -> tuple[bytes, ...]:
    if (secrets is None) == (secrets_env is None):
        raise ConfigurationError("pass exactly one of secrets=[...] or secrets_env='NAME'")
    if secrets_env is not None:
        where = f"environment variable {secrets_env}"
        items: Iterable[str | bytes] = os.environ.get(secrets_env, "").split(",")
    else:
        where = "secrets="
        # A bare string is one secret: iterating "whsec_x" would accept each character as a key.
        items = [secrets] if isinstance(secrets, (str, bytes)) else list(secrets or ())
    keys = tuple(s.strip().encode("utf-8") if isinstance(s, str) else s for s in items)
    if secrets_env is not None:
        keys = tuple(k for k in keys if k)  # "a,b," and " a , b " are two secrets
    if not keys:
        raise ConfigurationError(f"no webhook secret in {where}: every delivery would be refused")
    if not all(keys):
        raise ConfigurationError(f"an empty webhook secret in {where}: anyone could sign with it")
    return keys


class SignatureMiddleware:
    """Pure ASGI middleware that lets a webhook delivery reach the app only if its HMAC signature matches.

    Args:
        app: The ASGI application (typically `IdempotencyMiddleware(...)`) to protect.
        paths: Protected request paths, relative to the mount (`scope["root_path"]`) as route policies are:
            `/webhooks/stripe`, `/hooks/{provider}` (one segment) or `/hooks/*`.
        scheme: How the provider signs: `StripeScheme()`, `HmacScheme(...)`, or any `Scheme`.
        secrets: The signing secrets; several at once during a rotation (any one matching is accepted).
        secrets_env: Instead of `secrets`, the environment variable holding them, comma-separated
            (read once, at construction).
        methods: Protected methods; other methods on the same paths pass through.
        max_body: Largest body buffered for verification; over it: 413.
        problem_base: What the problem `type`s are built from (see `IdempotencyMiddleware`); a path
            of the app serves the problem pages there.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        paths: Sequence[str],
        scheme: Scheme,
        secrets: Iterable[str | bytes] | str | bytes | None = None,
        secrets_env: str | None = None,
        methods: Iterable[str] = ("POST",),
        max_body: int = 1 << 20,
        problem_base: str = problems.DEFAULT_PROBLEM_BASE,
    ) -> None:
        self.app = app
        self.problem_base = problems.check_base(problem_base)
        self._pages = problems.served(self.problem_base)
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise ConfigurationError("SignatureMiddleware needs at least one path to protect")
        self.methods = method_set(methods, "SignatureMiddleware")
        self._table: PathTable[bool] = PathTable((p, self.methods, True) for p in paths)
        if not isinstance(scheme, Scheme):
            raise ConfigurationError(f"{scheme!r} has no verify(headers, body, secrets) method")
        self.scheme = scheme
        self._check_inner(app)
        self._secrets = _load_secrets(secrets, secrets_env)
        check = getattr(scheme, "key_bytes", None)  # a scheme that decodes its secrets: fail at start-up
        if check is not None:
            for secret in self._secrets:
                check(secret)
        if max_body <= 0:
            raise ConfigurationError(f"max_body must be positive, got {max_body}")
        self.max_body = max_body

    def _check_inner(self, app: ASGIApp) -> None:
        """Refuse, at start-up, an idempotency route inside us that an unsigned request could poison.

        A route keyed by the request itself (an event id) is a key space only signed deliveries may
        write to: every method it protects must be one we verify, and a key read from a header must
        come from a header the signature covers.
        """
        from .middleware import IdempotencyMiddleware

        inner: Any = app
        for _ in range(32):
            if inner is None:
                return
            if isinstance(inner, IdempotencyMiddleware):
                for route in inner.routes:
                    if route.key_source is None or not any(
                        self._table.match(route.policy.path, m) for m in self.methods
                    ):
                        continue
                    unsigned = sorted(route.methods - self.methods)
                    if unsigned:
                        raise ConfigurationError(
                            f"route {route.policy.path!r} keys requests by their content for {unsigned}, but "
                            f"SignatureMiddleware verifies only {sorted(self.methods)}: an unsigned {unsigned[0]} "
                            f"could claim a real event id. Give the RoutePolicy methods={sorted(self.methods)}"
                        )
                    header = getattr(route.key_source, "header", None)
                    if isinstance(route.key_source, event_id) and header is not None:
                        name = header.decode("latin-1")
                        if name not in signed_headers(self.scheme):
                            raise ConfigurationError(
                                f"route {route.policy.path!r} keys deliveries by the {name} header, which the "
                                f"{type(self.scheme).__name__} signature does not cover: a captured delivery "
                                "could be applied again under a new header value. Key by a signed body field "
                                "(event_id(field='id')) or use a scheme that signs the header "
                                "(its signed_headers)"
                            )
            inner = getattr(inner, "app", None)

    def __repr__(self) -> str:
        # Never the secrets: this object ends up in tracebacks and debug pages.
        return f"SignatureMiddleware(scheme={self.scheme!r}, secrets=<{len(self._secrets)} hidden>)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._pages and scope["type"] == "http" and await problem_pages.serve(self.problem_base, scope, send):
            return
        if scope["type"] != "http" or self._table.lookup(scope) is None:
            await self.app(scope, receive, send)
            return
        await self._verify(scope, receive, send)

    async def _verify(self, scope: Scope, receive: Receive, send: Send) -> None:
        if declared_too_large(scope, self.max_body):
            await self._too_large(scope, send)
            return
        try:
            body = await read_body(receive, self.max_body)
        except TooLarge:
            await self._too_large(scope, send)
            return
        if body is None:
            return  # http.disconnect: nothing verified, nothing run
        try:
            self.scheme.verify(scope["headers"], body, self._secrets)
        except SignatureMalformed as exc:
            logger.warning("idem_asgi: webhook to %s refused (400): %s", scope["path"], exc)
            await problems.send_problem(
                send, SIGNATURE_MALFORMED, str(exc), base=problems.located(self.problem_base, scope)
            )
            return
        except SignatureInvalid as exc:
            logger.warning("idem_asgi: webhook to %s refused (401): %s", scope["path"], exc)
            await problems.send_problem(
                send, SIGNATURE_INVALID, str(exc), base=problems.located(self.problem_base, scope)
            )
            return
        await self.app(scope, replaying((body,), receive), send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        await problems.send_problem(
            send,
            problems.BODY_TOO_LARGE,
            f"The webhook body exceeds the limit of {self.max_body} bytes.",
            base=problems.located(self.problem_base, scope),
        )
