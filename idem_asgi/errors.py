"""Library exceptions, raised to developers (never sent to HTTP clients). Every public one is here.

The tree::

    IdemError
    ├── ConfigurationError              bad policy, unknown URL scheme, bad CLI usage
    │   ├── MissingExtra (ImportError)  an optional dependency is not installed (the message says which extra)
    │   └── WrongAnswer                 a recover hook or resolver gave an answer of the wrong kind or shape
    ├── MalformedKey (ValueError)       an Idempotency-Key value is not a valid key (400 key-malformed)
    ├── InvalidScope (ValueError)       a scope callable refuses the request's scope (400 scope-malformed)
    ├── SignatureError (ValueError)     a webhook signature does not verify
    │   ├── SignatureMalformed          missing, repeated or unparseable (400 signature-malformed)
    │   └── SignatureInvalid            well formed, but no secret matches or it is stale (401 signature-invalid)
    └── BackendError                    a store call failed; wraps the driver error as __cause__
        ├── BackendMisconfigured        the store answers but can never work as configured (500, logged)
        ├── ClaimLost                   a write needing the request's claim found it no longer held
        └── BackendUnavailable          the store could not be reached or did not answer in time (503)
            └── StoreFull               the store has no room for another record (503, or 429 for one scope)
    JobError                            a repeated `@idempotent` job or `claim()` that does not run
    ├── InProgress                      the first call with the key still runs
    ├── KeyReused                       the key was used with other arguments
    ├── OutcomeUnknown                  a call started and stopped without an outcome: reconcile it
    └── ResultNotStorable               the work ran, its result cannot be stored (kept outcome-unknown)

HTTP clients see RFC 9457 problems instead (`idem_asgi.http.problems`).
"""

from __future__ import annotations


class IdemError(Exception):
    """Base of every exception raised by idem_asgi."""


class ConfigurationError(IdemError):
    """Raised at construction (or by the CLI) when a policy, URL or option cannot work."""


class MissingExtra(ConfigurationError, ImportError):
    """Raised when a feature's optional dependency is missing; the message says how to install it."""


def missing_extra(what: str, extra: str) -> MissingExtra:
    """`MissingExtra` for `what` (e.g. "RedisBackend needs redis-py"), with the install lines that
    work today (idem-asgi is not on the package index yet: from a clone, from the built wheel, or
    the driver alone, as this install's metadata declares it) and the published one for later."""
    import re
    from importlib import metadata

    marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
    try:
        version = metadata.version("idem-asgi")
        wanted = [r.split(";")[0].strip() for r in metadata.requires("idem-asgi") or () if marker.search(r)]
    except metadata.PackageNotFoundError:  # pragma: no cover - imported from a tree nobody installed
        version, wanted = "<version>", []
    quoted = " ".join(f'"{w}"' for w in wanted)
    alone = f", or the driver alone: pip install {quoted}" if wanted else ""
    return MissingExtra(
        f'{what}, which is not installed. From a clone of idem-asgi: pip install ".[{extra}]"; from its wheel '
        f'(python3 dev.py wheel): pip install "dist/idem_asgi-{version}-py3-none-any.whl[{extra}]"{alone}. '
        f'Once idem-asgi is on the package index: pip install "idem-asgi[{extra}]".'
    )


class WrongAnswer(ConfigurationError):
    """Raised when a recover hook, a resolver or the CLI gives a record an answer it cannot take: an
    HTTP response for a job's record, a job result for a request's, a result its job cannot return."""


class MalformedKey(IdemError, ValueError):
    """Raised by `parse_key` when a header value is not a valid idempotency key."""


class InvalidScope(IdemError, ValueError):
    """Raised by a scope callable when the request's scope is ambiguous or unusable (two tenant headers)."""


class SignatureError(IdemError, ValueError):
    """Raised by a webhook signature scheme when a delivery does not verify."""


class SignatureMalformed(SignatureError):
    """The signature header is missing, repeated or unparseable (answered 400: the sender is broken)."""


class SignatureInvalid(SignatureError):
    """The signature is well formed but no secret matches, or its timestamp is stale (answered 401)."""


class BackendError(IdemError):
    """Raised by a backend when a store operation failed; the middleware answers 503."""


class BackendMisconfigured(BackendError):
    """Raised when the store answered but refuses us for good: bad credentials, missing rights or table.

    Retrying cannot help, so the middleware answers 500 `store-misconfigured` (not 503) and logs
    the cause with its fix; at ASGI start-up it fails the start instead.
    """


class ClaimLost(BackendError):
    """Raised by `PostgresBackend.transaction()`/`checkpoint()` when the claim is no longer this request's.

    (Taken over after its lease expired, already completed, or gone.) The transaction is rolled
    back, so the effect did not happen under this claim.
    """


class BackendUnavailable(BackendError):
    """Raised when the store is unreachable, timed out, or its connection pool stayed exhausted."""


class StoreFull(BackendUnavailable):
    """Raised by a bounded store (the memory store) that has no room for another record.

    `scope_quota` is True when only the request's scope is over its share: that caller gets 429,
    every other caller keeps working.
    """

    def __init__(self, message: str, *, scope_quota: bool = False) -> None:
        super().__init__(message)
        self.scope_quota = scope_quota


class JobError(IdemError):
    """Base of the errors a repeated job can raise instead of running."""


class InProgress(JobError):
    """The first call with this key is still running (after waiting `wait` seconds); `here` is True
    when it runs in this process (it will end here: stored, released or kept)."""

    here: bool = False


class KeyReused(JobError):
    """The key was used before with other arguments."""


class OutcomeUnknown(JobError):
    """A call with this key started and its holder stopped without an outcome: reconcile it."""


class ResultNotStorable(JobError):
    """The work ran but its result cannot be stored (msgspec cannot encode it, or it does not match
    the return annotation): the claim is kept as outcome unknown, never released for a second run."""
