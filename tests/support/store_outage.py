"""A throwaway redis-server that loses nothing when it is killed (`appendfsync always`), and a
restart of it in the middle of a test: the store outage the consumer adapters must ride out."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tests.support.servers import RedisProcess, redis_process

FSYNC_ALWAYS = ("--appendonly", "yes", "--appendfsync", "always")


@contextlib.contextmanager
def fsynced_redis(workdir: Path) -> Iterator[RedisProcess]:
    """A started redis-server on a free port, every write fsynced before it is answered."""
    with redis_process(workdir, args=FSYNC_ALWAYS) as server:
        yield server


async def restart_when(
    server: RedisProcess, ready: Callable[[], Awaitable[bool]], *, down: float = 3.0, within: float = 30.0
) -> None:
    """Once `ready()` holds (polled every 20 ms), SIGKILL the server, keep it down `down` seconds
    and start it again on the same port from its append-only file."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await ready():
        assert loop.time() < deadline, "the stream never reached the point of the restart"
        await asyncio.sleep(0.02)
    server.kill()
    await asyncio.sleep(down)
    await asyncio.to_thread(server.start)


async def late_writes_landed(stores: Sequence[Any], within: float = 35.0) -> None:
    """Wait until no completion write the outage failed is still being retried in the background
    (`idem_asgi.claims.late_writes` retries them for up to 30 s): closed before, a store's client would reopen
    a connection for the retry and leak it."""
    from idem_asgi.claims import runtime

    def pending() -> int:
        return sum(shared.late.pending for s in stores if (shared := runtime._by_store.get(s)) is not None)

    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while pending():
        assert loop.time() < deadline, f"{pending()} completion writes still pending"
        await asyncio.sleep(0.05)
