"""Storm-test *your* app: prove that your endpoint, with your handler and your store, runs once under retries.

`storm()` drives the app in-process through raw ASGI calls (no network, no server) and fires, each
scenario with its own key:

- **the storm**: `concurrency` identical requests at once, then `repeats` more after it finished,
  then (with `mismatch=True`) the same key with a changed body;
- **faults** (`faults=`): a client that disconnects while its body is still arriving
  (`disconnect_mid_body`), the first request's task cancelled mid-flight (`cancel_first`), the store
  failing between the claim and storing the answer (`store_fails_after_claim`), the connection lost
  after the app ran, so the client never gets the answer and retries (`response_lost`), retries
  landing while the first answer is being written (`retry_during_write`), and the handler failing
  before any effect, which must free the key for the retry (`app_fails_before_effect`).

A request that moved the probe (the effect happened) and then answered 5xx or raised is allowed
once; if the key then runs again, the report says to call `mark_effect()` after the effect.

It counts the handler's executions through your `probe` and returns a `StormReport`;
`report.assert_ok()` fails with a key-by-key explanation unless the contract held. As a pytest
plugin (entry point `pytest11`, or `-p idem_asgi.testing`) it provides the fixtures `idem_storm`
(this `storm` function) and `idem_disabled` (sets `IDEM_ASGI_DISABLED=1` for one test). See
docs/testing.md.

pytest is only needed for the fixtures: importing this package without pytest works.

The package: `report` (what a storm found), `driver` (the simulated client), `inject` (the faults
inside the store and the app), `scenarios` (one function per scenario), `storm` (the entry point),
`walk` (finding the middleware), `plugin` (the pytest fixtures).
"""

from __future__ import annotations

import contextlib

from .inject import InjectedAppFailure, InjectedStoreFailure
from .report import Answer, KeyReport, StormReport
from .scenarios import FAULTS
from .storm import storm
from .walk import find_middleware

with contextlib.suppress(ImportError):  # pytest is a dev dependency: storm() works without it
    from .plugin import idem_disabled as idem_disabled  # the fixtures, found by pytest in this module
    from .plugin import idem_storm as idem_storm

__all__ = [
    "FAULTS",
    "Answer",
    "InjectedAppFailure",
    "InjectedStoreFailure",
    "KeyReport",
    "StormReport",
    "find_middleware",
    "storm",
]
