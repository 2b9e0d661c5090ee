"""Where a test kills or restarts a broker or a store under a third-party client (aio-pika's robust
reconnects to a booting RabbitMQ node, nats-py's reconnects, redis-py's Sentinel pool across a
failover), the client can leave connection attempts unclosed. Garbage-collected later, they would
fail whichever test runs then (`filterwarnings = error`), far from their cause. Modules of such
tests collect them at each test's end and ignore those warnings there, and only there."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

IGNORE_CLIENT_LEFTOVERS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def collect_client_leftovers() -> Iterator[None]:
    yield
    gc.collect()
    gc.collect()
