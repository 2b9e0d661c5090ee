"""What the `idem-asgi` commands share: the store a URL names, and printing their output."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, Final

from ..backends import Backend, Maintenance, backend_class
from ..errors import BackendUnavailable, ConfigurationError
from .reconcile import ReconcilableBackend
from .resolving import OLDER_THAN as OLDER_THAN

ENV_URL = "IDEM_BACKEND_URL"
PROG = "idem-asgi"


# --- the store -------------------------------------------------------------------------------


def store_url(args: argparse.Namespace) -> str:
    url: str | None = args.backend or os.environ.get(ENV_URL)
    if not url:
        raise ConfigurationError(f"no backend: pass --backend URL or set {ENV_URL}")
    return url


@contextlib.asynccontextmanager
async def open_store(args: argparse.Namespace) -> AsyncIterator[Any]:
    """The store named by the URL, through the one scheme table (`backends.SCHEMES`), closed on the way out.

    A Postgres store gets a small pool and never creates its table as a side effect (only `migrate`
    does), so a missing table is reported as the configuration error it is.
    """
    url = store_url(args)
    cls = backend_class(url)
    options: dict[str, Any] = {}
    if cls.__name__ == "RedisBackend":
        options = {"prefix": args.prefix, "timeout": args.timeout, "cluster": args.cluster, "max_connections": 8}
        options["store_keys"] = bool(args.store_keys)
    elif cls.__name__ == "PostgresBackend":
        options = {
            "table": args.table,
            "timeout": args.timeout,
            "create_table": False,
            "store_keys": bool(args.store_keys),
            "min_size": 1,
            "max_size": 2,
            "server_settings": {"application_name": PROG},
        }
    try:
        backend = cls.from_url(url, **options)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"invalid backend URL: {exc}") from None
    async with backend:
        if cls.__name__ == "RedisBackend":
            # One PING within --timeout in all: it finds the primary (Sentinel) or the slots (Cluster)
            # the command then uses, so an unreachable one fails within --timeout, not after the
            # client's tries per sentinel and node.
            try:
                async with asyncio.timeout(args.timeout):
                    await backend.ping()
            except TimeoutError:
                raise BackendUnavailable(f"no answer within --timeout {args.timeout:g} s") from None
        yield backend


def maintained(backend: Backend) -> ReconcilableBackend:
    if not isinstance(backend, Maintenance):
        raise ConfigurationError(f"{type(backend).__name__} has no stale()/purge()")
    return backend


# --- output ----------------------------------------------------------------------------------


class StdoutClosed(Exception):
    """Whoever read our output stopped (`| head`): not a store outage."""


def emit(args: argparse.Namespace, doc: Any, lines: Callable[[], list[str]]) -> None:
    try:
        if args.json:
            print(json.dumps(doc, indent=2, ensure_ascii=False))
        else:
            for line in lines():
                print(line)
        sys.stdout.flush()
    except BrokenPipeError as exc:
        raise StdoutClosed from exc


STDOUT_CLOSED: Final = 128 + 13
"""The exit status after a closed stdout, as a shell reports a process that SIGPIPE ended."""


def quiet_stdout() -> None:
    """After a closed pipe, in the console script only (never under a caller's own `run()`): point
    stdout at /dev/null so the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
