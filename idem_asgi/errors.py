"""Library exceptions, raised to developers (never sent to HTTP clients).

The tree::

    IdemError
    ├── ConfigurationError      bad policy, unknown URL scheme, missing extra
    └── BackendError            a store call failed; wraps the driver error as __cause__
        └── BackendUnavailable  the store could not be reached or did not answer in time

HTTP clients see RFC 9457 problems instead (`idem_asgi.problems`).
"""

from __future__ import annotations


class IdemError(Exception):
    """Base of every exception raised by idem_asgi."""


class ConfigurationError(IdemError):
    """Raised at construction when a policy, URL or option cannot work."""


class BackendError(IdemError):
    """Raised by a backend when a store operation failed; the middleware answers 503."""


class BackendUnavailable(BackendError):
    """Raised when the store is unreachable, timed out, or its connection pool stayed exhausted."""
