"""Logging helpers: store failures as one line per outage, and start-up warnings once per process."""

from __future__ import annotations

import logging
import re
import time

from .errors import BackendError

logger = logging.getLogger("idem_asgi")
_warned: set[str] = set()


def store_failed(what: str, exc: Exception) -> None:
    """Log a store failure: one line for an outage (no stack trace flood), a traceback for anything else."""
    if isinstance(exc, BackendError):
        logger.warning("idem_asgi: %s: %s", what, exc)
    else:
        logger.error("idem_asgi: %s", what, exc_info=exc)


def once(level: int, message: str) -> None:
    """Log `message` the first time it is seen in this process (frameworks that build one middleware
    per route handler would repeat every start-up warning dozens of times)."""
    if message in _warned:
        return
    _warned.add(message)
    logger.log(level, message)


_last: dict[str, float] = {}


def throttled(level: int, message: str, every: float = 60.0) -> None:
    """Log `message` at most once per `every` seconds (a misconfigured store fails every request)."""
    now = time.monotonic()
    if now - _last.get(message, -every) < every:
        return
    _last[message] = now
    logger.log(level, message)


_SECRETISH = re.compile(r"[A-Za-z0-9_\-+/=.]{20,}")


def redact(text: str) -> str:
    """`text` with every run of 20+ token characters (keys, tokens, card numbers) replaced by `<redacted>`."""
    return _SECRETISH.sub("<redacted>", text)
