"""Library exceptions, raised to developers (never sent to HTTP clients).

The tree::

    IdemError
    ├── ConfigurationError          bad policy, unknown URL scheme, missing extra
    ├── InvalidScope (ValueError)   a scope callable refuses the request's scope (400 scope-malformed)
    └── BackendError                a store call failed; wraps the driver error as __cause__
        ├── BackendMisconfigured    the store answers but can never work as configured (500, logged)
        └── BackendUnavailable      the store could not be reached or did not answer in time (503)
            └── StoreFull           the store has no room for another record (503, or 429 for one scope)

HTTP clients see RFC 9457 problems instead (`idem_asgi.problems`).
"""

from __future__ import annotations


class IdemError(Exception):
    """Base of every exception raised by idem_asgi."""


class ConfigurationError(IdemError):
    """Raised at construction when a policy, URL or option cannot work."""


class InvalidScope(IdemError, ValueError):
    """Raised by a scope callable when the request's scope is ambiguous or unusable (two tenant headers)."""


class BackendError(IdemError):
    """Raised by a backend when a store operation failed; the middleware answers 503."""


class BackendMisconfigured(BackendError):
    """Raised when the store answered but refuses us for good: bad credentials, missing rights or table.

    Retrying cannot help, so the middleware answers 500 `store-misconfigured` (not 503) and logs
    the cause with its fix; at ASGI start-up it fails the start instead.
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
