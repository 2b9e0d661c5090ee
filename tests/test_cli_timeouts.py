"""`--timeout` bounds every `idem-asgi` command, discovery included, measured by the clock.

The stores that do not answer are real sockets: ports where nothing listens (refused at once), and
listeners that accept a connection and never say a word (a host that hangs), standing in for
sentinels, cluster nodes and a Postgres server.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from tests.support.servers import free_port
from tests.test_cli import cli

TIMEOUT = 1.0
SLACK = 0.8  # the interpreter's own work around the wait (imports, the client's set-up)


@pytest.fixture
async def silent() -> AsyncIterator[Callable[[], Awaitable[int]]]:
    """Listeners that accept and never answer; each call opens one and gives its port."""
    servers: list[asyncio.Server] = []
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # kept open, never written to

    async def open_one() -> int:
        server = await asyncio.start_server(hold, "127.0.0.1", 0, family=socket.AF_INET)
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield open_one
    for writer in held:
        writer.transport.abort()
    for server in servers:
        server.close()


async def timed(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, float]:
    started = time.monotonic()
    code, _, err = await cli(capsys, "--timeout", str(TIMEOUT), *argv)
    return code, err, time.monotonic() - started


@pytest.mark.parametrize("command", [["stale"], ["inspect", "k"], ["resolve", "k", "--token", "1", "--release"]])
async def test_two_sentinels_that_refuse_fail_at_once(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """redis-py's default retries (three, backing off) took 15 s here on a 2 s timeout."""
    url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/mymaster"
    code, err, took = await timed(capsys, "--backend", url, *command)
    assert code == 3 and "No master found" in err, err
    assert took < TIMEOUT + SLACK, took


async def test_two_sentinels_that_hang_fail_within_the_timeout(
    silent: Callable[[], Awaitable[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis+sentinel://127.0.0.1:{await silent()},127.0.0.1:{await silent()}/mymaster"
    code, err, took = await timed(capsys, "--backend", url, "stale")
    assert code == 3 and err.startswith("idem-asgi: error: store unreachable"), err
    assert TIMEOUT * 0.9 < took < TIMEOUT + SLACK, took


async def test_a_cluster_node_that_hangs_fails_within_the_timeout(
    silent: Callable[[], Awaitable[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err, took = await timed(capsys, "--backend", f"redis://127.0.0.1:{await silent()}/0", "--cluster", "stale")
    assert code == 3 and err.startswith("idem-asgi: error: store unreachable"), err
    assert took < TIMEOUT + SLACK, took


async def test_a_redis_that_hangs_fails_within_the_timeout(
    silent: Callable[[], Awaitable[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    code, err, took = await timed(capsys, "--backend", f"redis://127.0.0.1:{await silent()}/0", "inspect", "k")
    assert code == 3 and err.startswith("idem-asgi: error: store unreachable"), err
    assert took < TIMEOUT + SLACK, took


async def test_a_postgres_that_hangs_fails_within_the_timeout(
    silent: Callable[[], Awaitable[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"postgresql://postgres@127.0.0.1:{await silent()}/test"
    code, err, took = await timed(capsys, "--backend", url, "stale")
    assert code == 3 and err.startswith("idem-asgi: error: store unreachable"), err
    assert took < TIMEOUT + SLACK, took
