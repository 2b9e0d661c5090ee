"""`idem-asgi`: look at idempotency records, resolve stuck claims, purge, and apply the Postgres schema.

    idem-asgi --backend redis://localhost:6379/0 inspect pay-7f3a --scope tenant-42
    idem-asgi stale --older-than 300                        # backend from $IDEM_BACKEND_URL
    idem-asgi reconcile --hook shop.ops:resolve --transform shop.ops:sealing --dry-run
    idem-asgi resolve pay-7f3a --scope tenant-42 --token 8812 --release   # one key, no hook
    idem-asgi purge --batch-size 5000
    idem-asgi --backend postgresql://app@db/shop migrate --print
    idem-asgi --backend postgresql://app@db/shop relay --to nats://nats:4222   # publish the outbox

Every command takes `--json` (one JSON document on stdout). Errors are one line on stderr.

Exit codes: 0 done; 1 `inspect` found no record, `resolve` wrote nothing, or `reconcile` counted errors; 2 usage or
configuration (bad URL scheme, hook not found, `migrate` on a store without a schema);
3 the store could not be reached; 4 the store answered with an error (a missing table, say).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import BackendError, BackendMisconfigured, BackendUnavailable, ConfigurationError
from .cli_commands import _COMMANDS
from .cli_io import ENV_URL, OLDER_THAN, PROG, STDOUT_CLOSED, StdoutClosed, quiet_stdout
from .cli_relay import add_parser as add_relay
from .cli_resolve import add_parser as add_resolve

__all__ = ["ENV_URL", "PROG", "main", "run"]


# --- arguments -------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Options accepted before and after the subcommand (`idem-asgi --json stale` = `idem-asgi stale --json`)."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--backend",
        metavar="URL",
        default=default(None),
        help=f"memory://, redis://, rediss://, redis+sentinel://, unix:// or postgresql:// (default: ${ENV_URL})",
    )
    parser.add_argument("--json", action="store_true", default=default(False), help="print one JSON document")
    parser.add_argument("--prefix", default=default("idem:"), help="Redis key prefix (default: idem:)")
    parser.add_argument("--table", default=default("idem_records"), help="Postgres table (default: idem_records)")
    parser.add_argument(
        "--store-keys",
        action=argparse.BooleanOptionalAction,
        default=default(None),
        help="the app keeps raw keys (store_keys=True), or not (--no-store-keys); "
        "default: as the store records it (see migrate)",
    )
    parser.add_argument("--cluster", action="store_true", default=default(False), help="the Redis URL is a cluster")
    parser.add_argument("--timeout", type=float, default=default(5.0), help="seconds per store call (default: 5)")
    parser.add_argument("-v", "--verbose", action="store_true", default=default(False), help="log every step")


def _age(parser: argparse.ArgumentParser, default: float = OLDER_THAN) -> None:
    """The age filter of `stale` (default 0: it only lists) and of `reconcile` and `resolve` (60)."""
    parser.add_argument(
        "--older-than",
        type=float,
        default=default,
        metavar="SECONDS",
        help=f"only claims whose lease ended this long ago ({default:g}; {OLDER_THAN:g} gives a live holder "
        "stalled past its lease time to renew; 0: every one)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect idempotency records, resolve stuck claims, purge expired records, apply the schema.",
        epilog="exit codes: 0 done, 1 not found / nothing resolved / reconcile errors, 2 usage or configuration, "
        "3 store unreachable, 4 store error, 141 output closed (| head)",
    )
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="print one record")
    _common(p, top=False)
    p.add_argument("key", help='the Idempotency-Key value (a derived key as listed: "POST /webhooks/stripe evt_123")')
    p.add_argument("--namespace", default="idem", help="the middleware's namespace (default: idem)")
    p.add_argument(
        "--scope", default=None, help="whose key it is (tenant, user, or its stored '~h ...' digest; default: unscoped)"
    )

    p = sub.add_parser("stale", help="list claims whose holder stopped (lease over, never completed)")
    _common(p, top=False)
    _age(p, 0.0)
    p.add_argument("--limit", type=int, default=1000, help="at most this many (1000)")
    p.add_argument("--namespace", default=None, help="only this namespace (default: all)")

    p = sub.add_parser("reconcile", help="resolve stale claims with a hook that asks the source of truth")
    _common(p, top=False)
    p.add_argument("--hook", required=True, metavar="MODULE:FUNC", help="resolve(stale_record), sync or async")
    _age(p)
    p.add_argument("--limit", type=int, default=1000, help="claims examined in this run (1000)")
    p.add_argument("--namespace", default=None, help="only this namespace (default: all)")
    p.add_argument(
        "--ttl",
        type=float,
        default=None,
        help="keep a resolved answer this long, seconds (default: the TTL each record was claimed with)",
    )
    p.add_argument("--lease", type=float, default=30.0, help="lease held while writing an outcome, seconds (30)")
    p.add_argument("--concurrency", type=int, default=1, help="claims resolved at once (1)")
    p.add_argument(
        "--transform",
        metavar="MODULE:NAME",
        default=None,
        help="the app's transform (EncryptBody, ...): resolved answers are sealed as the app seals them "
        "(default: stored in clear, marked so; they replay under any transform)",
    )
    p.add_argument("--dry-run", action="store_true", help="ask the hook, write nothing")

    add_resolve(sub, _common, _age)

    p = sub.add_parser("purge", help="delete expired records (Redis expires them by itself)")
    _common(p, top=False)
    p.add_argument("--batch-size", type=int, default=1000, help="records per statement (1000)")

    p = sub.add_parser("migrate", help="create the Postgres table and indexes, or print their DDL")
    _common(p, top=False)
    p.add_argument("--print", dest="print_ddl", action="store_true", help="print the DDL instead of applying it")

    add_relay(sub, _common)
    return parser


# --- entry points ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    try:
        code = asyncio.run(run(argv))
    except KeyboardInterrupt:
        return 130
    if code == STDOUT_CLOSED:
        quiet_stdout()
    return code


async def run(argv: Sequence[str] | None = None) -> int:
    """`main` for a caller already inside an event loop."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(verbose=args.verbose))
    handler.setLevel(logging.INFO if args.verbose else logging.WARNING)
    log = logging.getLogger("idem_asgi")
    level = log.level
    log.addHandler(handler)
    if args.verbose:
        log.setLevel(logging.INFO)
    try:
        return await _COMMANDS[args.command](args)
    except StdoutClosed:
        return STDOUT_CLOSED
    except (ConfigurationError, BackendMisconfigured) as exc:  # credentials, rights, schema: fix the setup
        return _fail(str(exc), 2)
    except BackendUnavailable as exc:
        return _fail(f"store unreachable: {exc}", 3)
    except BackendError as exc:
        return _fail(f"store error: {exc}", 4)
    except (TimeoutError, OSError) as exc:
        return _fail(f"store unreachable: {type(exc).__name__}: {exc}", 3)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _fail(message: str, code: int) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return code


class _OneLine(logging.Formatter):
    """`idem-asgi: message`; the traceback only with --verbose."""

    def __init__(self, *, verbose: bool) -> None:
        super().__init__(f"{PROG}: %(message)s")
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        if not self.verbose and record.exc_info:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)
