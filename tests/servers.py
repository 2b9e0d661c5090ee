"""Where the test servers are, and how a test gets them (or skips, or fails under CI)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

import pytest

REDIS_URL = os.environ.get("IDEM_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_DSN = os.environ.get("IDEM_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def reachable(url: str) -> bool:
    """True when a TCP connection to the URL's host and port succeeds."""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 0), timeout=1):
            return True
    except OSError:
        return False


def require(name: str, url: str) -> None:
    """Skip (on a laptop) or fail (under CI=true) when the server is not reachable."""
    if reachable(url):
        return
    variable = "IDEM_POSTGRES_DSN" if name == "postgres" else f"IDEM_{name.upper()}_URL"
    message = f"{name} not reachable at {url}; start it with `bash backends/start-services.sh` or set {variable}"
    if IN_CI:
        pytest.fail(message + " (CI=true: a missing server fails the run)")
    pytest.skip(message)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
