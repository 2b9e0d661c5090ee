"""`idem-asgi relay`: publish a PostgreSQL outbox to RabbitMQ or NATS until SIGTERM.

    idem-asgi --backend postgresql://app@db/shop relay --to amqp://guest:guest@mq/ --setup
    idem-asgi relay --to nats://nats:4222 --once         # what is due now, then exit

Run one or more: one leads and publishes, the others stand by and take over when it stops. SIGTERM
or SIGINT ends the round in progress (its publishes are marked sent) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ConfigurationError
from .cli_io import emit, open_store, store_url

Common = Callable[..., None]


def add_parser(sub: Any, common: Common) -> None:
    p = sub.add_parser("relay", help="publish the Postgres outbox to RabbitMQ or NATS (until SIGTERM)")
    common(p, top=False)
    p.add_argument("--to", required=True, metavar="URL", help="the broker: amqp://, amqps://, nats:// or tls://")
    p.add_argument("--exchange", default="", help="RabbitMQ exchange (default: the default exchange)")
    p.add_argument("--outbox-table", default=None, help="the outbox table (default: <table>_outbox)")
    p.add_argument("--batch", type=int, default=100, help="messages per round (100)")
    p.add_argument("--keep-sent", type=float, default=86_400.0, metavar="SECONDS", help="delete sent rows after (1 d)")
    p.add_argument("--setup", action="store_true", help="create the outbox table if it is missing")
    p.add_argument("--once", action="store_true", help="publish what is due now, then exit")


async def run_relay(args: argparse.Namespace) -> int:
    from ..outbox import Backlog, Outbox, Relay, publisher_for

    if args.batch < 1:
        raise ConfigurationError("--batch must be at least 1")
    if "postgres" not in store_url(args).split("://", 1)[0]:
        raise ConfigurationError("relay reads a Postgres outbox: pass --backend postgresql://...")
    publisher = publisher_for(args.to, exchange=args.exchange)
    async with open_store(args) as backend:
        outbox = Outbox(backend, table=args.outbox_table)
        with _schema_errors(outbox):
            if args.setup:
                await outbox.setup()
            await outbox.backlog()  # the table is there and readable, or exit 2 now (not retry forever)
        relay = Relay(outbox, publisher, batch=args.batch, keep_sent=args.keep_sent)
        if args.once:
            try:
                with _schema_errors(outbox):
                    published = await relay.once()
            finally:
                await publisher.aclose()
            if published is None:
                emit(args, {"published": 0, "leader": False}, lambda: ["another relay leads: it publishes them"])
                return 0
        else:
            loop = asyncio.get_running_loop()
            signals = [signal.SIGTERM, signal.SIGINT]
            for sig in signals:
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, relay.stop)
            try:
                await relay.run()
            finally:
                for sig in signals:
                    with contextlib.suppress(NotImplementedError, RuntimeError):
                        loop.remove_signal_handler(sig)
                await publisher.aclose()
        try:
            backlog: Backlog | None = await outbox.backlog()
        except Exception:  # the store went away meanwhile: the counts in process still say what was done
            backlog = None
    stats = relay.stats
    unsent = None if backlog is None else backlog.unsent
    doc = {"published": stats.published, "failed": stats.failed, "unsent": unsent}
    emit(args, doc, lambda: [f"published {stats.published}, failed {stats.failed}, {unsent} unsent"])
    return 1 if args.once and stats.failed else 0


@contextlib.contextmanager
def _schema_errors(outbox: Any) -> Iterator[None]:
    """A missing outbox table or a missing right is the setup's fault: exit 2 with what to do."""
    import asyncpg

    try:
        yield
    except (asyncpg.UndefinedTableError, asyncpg.InsufficientPrivilegeError) as exc:
        raise ConfigurationError(
            f"outbox table {outbox.table}: {exc} (create it with `idem-asgi relay --setup` or Outbox.setup(), "
            "or grant this role SELECT, UPDATE and DELETE on it)"
        ) from None
