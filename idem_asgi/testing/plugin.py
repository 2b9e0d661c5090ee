"""The pytest plugin: fixtures `idem_storm` and `idem_disabled` (entry point `pytest11`: `idem_asgi.testing`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from .report import StormReport
from .scenarios import DISABLE_ENV
from .storm import storm


@pytest.fixture
def idem_storm() -> Callable[..., Awaitable[StormReport]]:
    """`await idem_storm(app, path="/payments", json={...}, probe=lambda: charges)`: see `storm()`."""
    return storm


@pytest.fixture
def idem_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn idempotency off for one test: sets IDEM_ASGI_DISABLED=1.

    Read when each IdempotencyMiddleware is built, so build the app inside the test (Starlette
    and FastAPI build theirs at their first request, Litestar at `Litestar(...)`).
    """
    monkeypatch.setenv(DISABLE_ENV, "1")
