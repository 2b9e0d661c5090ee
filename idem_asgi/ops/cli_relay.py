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
from collections.abc import Callable
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
    from ..outbox import Outbox, Relay, publisher_for

    if args.batch < 1:
        raise ConfigurationError("--batch must be at least 1")
    if "postgres" not in store_url(args).split("://", 1)[0]:
        raise ConfigurationError("relay reads a Postgres outbox: pass --backend postgresql://...")
    publisher = publisher_for(args.to, exchange=args.exchange)
    async with open_store(args) as backend:
        outbox = Outbox(backend, table=args.outbox_table)
        if args.setup:
            await outbox.setup()
        relay = Relay(outbox, publisher, batch=args.batch, keep_sent=args.keep_sent)
        if args.once:
            pool = await backend._get_pool()
            async with pool.acquire() as conn:
                while await relay.round(conn) == args.batch:
                    pass
            await publisher.aclose()
        else:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, relay.stop)
            try:
                await relay.run()
            finally:
                await publisher.aclose()
        backlog = await outbox.backlog()
    stats = relay.stats
    doc = {"published": stats.published, "failed": stats.failed, "unsent": backlog.unsent}
    emit(args, doc, lambda: [f"published {stats.published}, failed {stats.failed}, {backlog.unsent} unsent"])
    return 0 if backlog.failing == 0 or not args.once else 1
