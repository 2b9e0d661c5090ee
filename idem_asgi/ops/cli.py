"""`idem-asgi`: look at idempotency records, resolve stuck claims, purge, and apply the Postgres schema.

    idem-asgi --backend redis://localhost:6379/0 inspect pay-7f3a --scope tenant-42
    idem-asgi stale --older-than 300                        # backend from $IDEM_BACKEND_URL
    idem-asgi reconcile --hook shop.ops:resolve --transform shop.ops:sealing --dry-run
    idem-asgi purge --batch-size 5000
    idem-asgi --backend postgresql://app@db/shop migrate --print

Every command takes `--json` (one JSON document on stdout). Errors are one line on stderr.

Exit codes: 0 done; 1 `inspect` found no record, or `reconcile` counted errors; 2 usage or
configuration (bad URL scheme, hook not found, `migrate` on a store without a schema);
3 the store could not be reached; 4 the store answered with an error (a missing table, say).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import msgspec

from ..backends import Backend, KeyForms, Maintenance, backend_class
from ..errors import BackendError, BackendMisconfigured, BackendUnavailable, ConfigurationError, InvalidScope
from ..http.keys import ANONYMOUS_SCOPE, stored_scope
from ..records import RecordKey
from .cli_load import load_hook, load_transform
from .cli_output import (
    hidden_note,
    iso,
    key_doc,
    key_label,
    label,
    record_doc,
    report_doc,
    report_lines,
    stale_doc,
    text,
)
from .reconcile import ReconcilableBackend, reconcile

__all__ = ["main", "run"]

ENV_URL = "IDEM_BACKEND_URL"
PROG = "idem-asgi"


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect idempotency records, resolve stuck claims, purge expired records, apply the schema.",
        epilog="exit codes: 0 done, 1 not found / reconcile errors, 2 usage or configuration, "
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
    p.add_argument(
        "--older-than", type=float, default=0.0, metavar="SECONDS", help="lease ended this long ago (0: every one)"
    )
    p.add_argument("--limit", type=int, default=1000, help="at most this many (1000)")
    p.add_argument("--namespace", default=None, help="only this namespace (default: all)")

    p = sub.add_parser("reconcile", help="resolve stale claims with a hook that asks the source of truth")
    _common(p, top=False)
    p.add_argument("--hook", required=True, metavar="MODULE:FUNC", help="resolve(stale_record), sync or async")
    p.add_argument("--older-than", type=float, default=60.0, metavar="SECONDS", help="lease ended this long ago (60)")
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

    p = sub.add_parser("purge", help="delete expired records (Redis expires them by itself)")
    _common(p, top=False)
    p.add_argument("--batch-size", type=int, default=1000, help="records per statement (1000)")

    p = sub.add_parser("migrate", help="create the Postgres table and indexes, or print their DDL")
    _common(p, top=False)
    p.add_argument("--print", dest="print_ddl", action="store_true", help="print the DDL instead of applying it")
    return parser


# --- entry points ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    try:
        code = asyncio.run(run(argv))
    except KeyboardInterrupt:
        return 130
    if code == STDOUT_CLOSED:
        _quiet_stdout()
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
    except _StdoutClosed:
        return STDOUT_CLOSED
    except (ConfigurationError, BackendMisconfigured) as exc:  # credentials, rights, schema: fix the setup
        return _fail(str(exc), 2)
    except BackendUnavailable as exc:
        return _fail(f"store unreachable: {exc}", 3)
    except BackendError as exc:
        return _fail(f"store error: {exc}", 4)
    except (OSError, asyncio.TimeoutError) as exc:
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


# --- the store -------------------------------------------------------------------------------


def _url(args: argparse.Namespace) -> str:
    url: str | None = args.backend or os.environ.get(ENV_URL)
    if not url:
        raise ConfigurationError(f"no backend: pass --backend URL or set {ENV_URL}")
    return url


@contextlib.asynccontextmanager
async def _open(args: argparse.Namespace) -> AsyncIterator[Any]:
    """The store named by the URL, through the one scheme table (`backends.SCHEMES`), closed on the way out.

    A Postgres store gets a small pool and never creates its table as a side effect (only `migrate`
    does), so a missing table is reported as the configuration error it is.
    """
    url = _url(args)
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
        yield backend


def _maintained(backend: Backend) -> ReconcilableBackend:
    if not isinstance(backend, Maintenance):
        raise ConfigurationError(f"{type(backend).__name__} has no stale()/purge()")
    return backend


# --- output ----------------------------------------------------------------------------------


class _StdoutClosed(Exception):
    """Whoever read our output stopped (`| head`): not a store outage."""


def _emit(args: argparse.Namespace, doc: Any, lines: Callable[[], list[str]]) -> None:
    try:
        if args.json:
            print(json.dumps(doc, indent=2, ensure_ascii=False))
        else:
            for line in lines():
                print(line)
        sys.stdout.flush()
    except BrokenPipeError as exc:
        raise _StdoutClosed from exc


STDOUT_CLOSED: Final = 128 + 13
"""The exit status after a closed stdout, as a shell reports a process that SIGPIPE ended."""


def _quiet_stdout() -> None:
    """After a closed pipe, in the console script only (never under a caller's own `run()`): point
    stdout at /dev/null so the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


# --- commands --------------------------------------------------------------------------------


_DIGEST_SCOPE = re.compile(r"~h [0-9a-f]{64}")


def _stored_scope(scope: str | None) -> str | None:
    """The scope as records keep it: a stored form as listed by `stale` is taken as it is."""
    if scope is None or scope == ANONYMOUS_SCOPE or _DIGEST_SCOPE.fullmatch(scope):
        return scope
    try:
        return stored_scope(scope)
    except InvalidScope as exc:
        raise ConfigurationError(f"invalid --scope: {exc}") from None


def _utf8(value: str, what: str) -> str:
    """Refuse an argument that is not valid UTF-8 (undecodable bytes reach argv as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigurationError(f"{what} is not valid UTF-8") from None
    return value


def _not_negative(seconds: float, what: str) -> float:
    if not seconds >= 0:
        raise ConfigurationError(f"{what} must be 0 or more seconds, got {seconds:g}")
    return seconds


async def _inspect(args: argparse.Namespace) -> int:
    scope = None if args.scope is None else _utf8(args.scope, "--scope")
    key = RecordKey.build(_utf8(args.namespace, "--namespace"), _stored_scope(scope), _utf8(args.key, "the key"))
    async with _open(args) as backend:
        record = await backend.get(key)
        if record is None and args.store_keys is None and type(backend).__name__ == "PostgresBackend":
            # Not told which form the app writes: a row kept raw (`store_keys=True`, 0.1.0) too.
            record = await backend.get(msgspec.structs.replace(key, stored_raw=True))
    if record is None:
        missing = f"no record for {label(key.namespace, key.scope, key.key)}"
        _emit(args, {**key_doc(key), "found": False}, lambda: [missing])
        return 1

    def lines() -> list[str]:
        assert record is not None
        out = [
            f"record    {label(key.namespace, key.scope, key.key)}",
            f"digest    {key.digest}",
            f"state     {record.state}",
            f"token     {record.token}",
        ]
        if record.state == "in_progress":
            over = "over: the holder stopped, outcome unknown" if record.lease_until <= time.time() else "running"
            out.append(f"lease     until {iso(record.lease_until)} ({over}, by this machine's clock)")
        out.append(f"expires   {iso(record.expires_at)}")
        if record.checkpoint is not None:
            out.append(f"checkpoint {record.checkpoint}")
        if record.effect_committed:
            out.append("effect    committed (transaction()): never run again")
        if record.holder_failed:
            out.append("failed    after its answer started or its effect: outcome unknown")
        if record.response is not None:
            r = record.response
            note = "replayable" if r.replayable else "not replayable (too large to store)"
            note += ", sealed (the app's transform opens it)" if r.sealed else ""
            out.append(f"response  {r.status}, {len(r.headers)} headers, {len(r.body)} bytes, {note}")
            out.extend(f"  {text(n)}: {text(v)}" for n, v in r.headers)
        return out

    _emit(args, record_doc(key, record), lines)
    return 0


async def _stale(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ConfigurationError("--limit must be at least 1")
    _not_negative(args.older_than, "--older-than")
    async with _open(args) as backend:
        found = await _maintained(backend).stale(args.older_than, args.limit, namespace=args.namespace)

    def lines() -> list[str]:
        out = [
            f"{iso(s.record.lease_until)}  {key_label(s.key)}  token {s.record.token}"
            + ("  effect committed" if s.effect_committed else "")
            + ("  failed mid-answer" if s.record.holder_failed else "")
            + (f"  checkpoint {s.record.checkpoint!r}" if s.record.checkpoint is not None else "")
            for s in found
        ]
        out.append(f"{len(found)} stale claim(s) whose lease ended more than {args.older_than:g} s ago")
        return out + hidden_note(sum(s.key.hidden for s in found), getattr(backend, "key_seal", None))

    _emit(args, [stale_doc(s) for s in found], lines)
    return 0


async def _reconcile(args: argparse.Namespace) -> int:
    resolve = load_hook(args.hook)
    transform = load_transform(args.transform)
    if args.limit < 1 or args.concurrency < 1:
        raise ConfigurationError("--limit and --concurrency must be at least 1")
    _not_negative(args.older_than, "--older-than")
    if args.ttl is not None and not args.ttl > 0:
        raise ConfigurationError(f"--ttl must be more than 0 seconds, got {args.ttl:g}")
    async with _open(args) as backend:
        report = await reconcile(
            _maintained(backend),
            resolve,
            older_than=args.older_than,
            limit=args.limit,
            ttl=args.ttl,
            lease=args.lease,
            namespace=args.namespace,
            dry_run=args.dry_run,
            concurrency=args.concurrency,
            transform=transform,
        )
    _emit(args, report_doc(report), lambda: report_lines(report, getattr(backend, "key_seal", None)))
    return 1 if report.errors else 0


async def _purge(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigurationError("--batch-size must be at least 1")
    async with _open(args) as backend:
        deleted = await _maintained(backend).purge(args.batch_size)
    redis = backend_class(_url(args)).__name__ == "RedisBackend"
    note = " (Redis deletes expired records by itself)" if redis else ""
    _emit(args, {"deleted": deleted}, lambda: [f"purged {deleted} expired record(s){note}"])
    return 0


async def _migrate(args: argparse.Namespace) -> int:
    url: str | None = args.backend or os.environ.get(ENV_URL)
    if url is None and not args.print_ddl:
        raise ConfigurationError(f"no backend: pass --backend URL or set {ENV_URL}")
    kind = None if url is None else backend_class(url).__name__
    if kind == "RedisBackend":  # no schema: only records that hold raw keys to rewrite
        async with _open(args) as redis_store:
            doc, lines = await _key_form(args, redis_store, "records")
        _emit(args, doc, lambda: lines)
        return 0
    if kind is not None and kind != "PostgresBackend":
        raise ConfigurationError("migrate is for postgresql:// and Redis backends; the memory store keeps nothing")
    from ..backends.postgres import PostgresBackend  # MissingExtra (a ConfigurationError) without asyncpg

    if args.print_ddl:
        ddl = PostgresBackend(table=args.table).ddl
        _emit(args, {"table": args.table, "ddl": ddl}, lambda: [ddl.rstrip("\n")])
        return 0
    async with _open(args) as backend:
        await backend.setup()
        form, lines = await _key_form(args, backend, "rows")
        owner = await backend.may_alter()
    doc = {"table": args.table, "applied": True, **form, "may_alter": owner}
    head = f"schema ready: table {args.table}"
    if not owner:  # it was there already: this role could not have made it, nor can change it
        head += " (made by another role; this one may not alter it: run migrate as its owner after upgrades)"
    _emit(args, doc, lambda: [head, *lines])
    return 0


async def _key_form(args: argparse.Namespace, store: Backend, what: str) -> tuple[dict[str, Any], list[str]]:
    """Raw keys: kept while the store records an app with `store_keys=True` (or `--store-keys` says
    so, and is recorded); else rewritten to their digest (`--no-store-keys` first drops the record).
    So `migrate` at every deploy never changes how a live app finds its records."""
    if not isinstance(store, KeyForms):
        raise ConfigurationError(f"{type(store).__name__} cannot rewrite the keys it holds")
    if args.store_keys is False:
        await store.forget_raw_keys()
    elif args.store_keys:
        await store.record_raw_keys()
    since = None if args.store_keys is False else await store.raw_keys_recorded()
    if since is not None:
        note = f"raw keys kept: an app with store_keys=True uses this store (recorded {iso(since)})"
        return {"store_keys": True, "keys_hashed": 0, "keys_left": 0}, [note]
    rewritten, left = await store.hash_stored_keys()
    doc = {"store_keys": False, "keys_hashed": rewritten, "keys_left": left}
    if not (rewritten or left):
        return doc, []
    return doc, [f"raw keys replaced by their digest in {rewritten} {what}; {left} left (a newer record exists)"]


_COMMANDS: dict[str, Callable[[argparse.Namespace], Awaitable[int]]] = {
    "inspect": _inspect,
    "stale": _stale,
    "reconcile": _reconcile,
    "purge": _purge,
    "migrate": _migrate,
}
