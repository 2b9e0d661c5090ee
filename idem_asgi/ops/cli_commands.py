"""The `idem-asgi` commands: inspect, stale, reconcile, purge, migrate (parsed by `cli`)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from ..backends import Backend, Histories, KeyForms, backend_class
from ..errors import ConfigurationError
from ..history import with_claim
from ..records import RecordKey
from .cli_io import ENV_URL, emit, maintained, open_store, store_url
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
    step_doc,
    step_line,
    text,
)
from .cli_relay import run_relay
from .cli_resolve import run_resolve
from .reconcile import reconcile
from .resolving import record_key

# --- commands --------------------------------------------------------------------------------


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


def _record_key(args: argparse.Namespace) -> RecordKey:
    """The record `--namespace`, `--scope` and the key name (`inspect`, `resolve`)."""
    scope = None if args.scope is None else _utf8(args.scope, "--scope")
    return record_key(_utf8(args.namespace, "--namespace"), scope, _utf8(args.key, "the key"), scope_is="--scope")


async def _resolve(args: argparse.Namespace) -> int:
    return await run_resolve(args, _record_key(args))


async def _inspect(args: argparse.Namespace) -> int:
    key = _record_key(args)
    async with open_store(args) as backend:
        record = await backend.get(key)
        if record is None and args.store_keys is None and type(backend).__name__ == "PostgresBackend":
            # Not told which form the app writes: a row kept raw (`store_keys=True`, 0.1.0) too.
            raw = msgspec.structs.replace(key, stored_raw=True)
            record = await backend.get(raw)
            key = raw if record is not None else key
        steps = with_claim(await backend.read_history(key), record) if isinstance(backend, Histories) else []
    history = [step_line(step) for step in steps]
    if history:
        history.insert(0, f"history   {len(steps)} step(s), oldest first")
    if record is None:
        missing = f"no record for {label(key.namespace, key.scope, key.key)}" + (
            "" if key.scope else " (a scoped key is found only with its --scope)"
        )
        doc = {**key_doc(key), "found": False, "history": [step_doc(s) for s in steps]}
        emit(args, doc, lambda: [missing, *history])
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
            note = (
                "replayable"
                if r.replayable
                else "a tombstone (its answer's replay_ttl passed: status and Location kept)"
                if r.tombstone
                else "not replayable (too large to store)"
            )
            note += ", sealed (the app's transform opens it)" if r.sealed else ""
            out.append(f"response  {r.status}, {len(r.headers)} headers, {len(r.body)} bytes, {note}")
            out.extend(f"  {text(n)}: {text(v)}" for n, v in r.headers)
        return out + history

    emit(args, {**record_doc(key, record), "history": [step_doc(s) for s in steps]}, lines)
    return 0


async def _stale(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ConfigurationError("--limit must be at least 1")
    _not_negative(args.older_than, "--older-than")
    async with open_store(args) as backend:
        found = await maintained(backend).stale(args.older_than, args.limit, namespace=args.namespace)

    def lines() -> list[str]:
        out = [
            f"{iso(s.record.lease_until)}  {key_label(s.key)}  token {s.record.token}"
            + ("  effect committed" if s.effect_committed else "")
            + ("  failed mid-answer" if s.record.holder_failed else "")
            + (f"  checkpoint {s.record.checkpoint!r}" if s.record.checkpoint is not None else "")
            for s in found
        ]
        out.append(f"{len(found)} stale claim(s) whose lease ended more than {args.older_than:g} s ago")
        if not found and args.older_than > 0:
            out.append(
                f"(the default --older-than {args.older_than:g} leaves out leases that ended since: 0 lists every one)"
            )
        return out + hidden_note(sum(s.key.hidden for s in found), getattr(backend, "key_seal", None))

    emit(args, [stale_doc(s) for s in found], lines)
    return 0


async def _reconcile(args: argparse.Namespace) -> int:
    resolve = load_hook(args.hook)
    transform = load_transform(args.transform)
    if args.limit < 1 or args.concurrency < 1:
        raise ConfigurationError("--limit and --concurrency must be at least 1")
    _not_negative(args.older_than, "--older-than")
    if args.ttl is not None and not args.ttl > 0:
        raise ConfigurationError(f"--ttl must be more than 0 seconds, got {args.ttl:g}")
    async with open_store(args) as backend:
        report = await reconcile(
            maintained(backend),
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

    def lines() -> list[str]:
        out = report_lines(report, getattr(backend, "key_seal", None))
        if not report.examined:
            out.append(
                f"(no claim whose lease ended more than {args.older_than:g} s ago: --older-than 0 takes every one)"
            )
        return out

    emit(args, report_doc(report), lines)
    return 1 if report.errors else 0


async def _purge(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise ConfigurationError("--batch-size must be at least 1")
    async with open_store(args) as backend:
        deleted = await maintained(backend).purge(args.batch_size)
    redis = backend_class(store_url(args)).__name__ == "RedisBackend"
    note = " (Redis deletes expired records by itself)" if redis else ""
    emit(args, {"deleted": deleted}, lambda: [f"purged {deleted} expired record(s){note}"])
    return 0


async def _migrate(args: argparse.Namespace) -> int:
    url: str | None = args.backend or os.environ.get(ENV_URL)
    if url is None and not args.print_ddl:
        raise ConfigurationError(f"no backend: pass --backend URL or set {ENV_URL}")
    kind = None if url is None else backend_class(url).__name__
    if kind == "RedisBackend":  # no schema: only records that hold raw keys to rewrite
        async with open_store(args) as redis_store:
            doc, lines = await _key_form(args, redis_store, "records")
        emit(args, doc, lambda: lines)
        return 0
    if kind is not None and kind != "PostgresBackend":
        raise ConfigurationError("migrate is for postgresql:// and Redis backends; the memory store keeps nothing")
    from ..backends.postgres import PostgresBackend  # MissingExtra (a ConfigurationError) without asyncpg

    if args.print_ddl:
        ddl = PostgresBackend(table=args.table).ddl
        emit(args, {"table": args.table, "ddl": ddl}, lambda: [ddl.rstrip("\n")])
        return 0
    async with open_store(args) as backend:
        await backend.setup()
        form, lines = await _key_form(args, backend, "rows")
        owner = await backend.may_alter()
    doc = {"table": args.table, "applied": True, **form, "may_alter": owner}
    head = f"schema ready: table {args.table}"
    if not owner:  # it was there already: this role could not have made it, nor can change it
        head += " (made by another role; this one may not alter it: run migrate as its owner after upgrades)"
    emit(args, doc, lambda: [head, *lines])
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
    "resolve": _resolve,
    "stale": _stale,
    "reconcile": _reconcile,
    "purge": _purge,
    "migrate": _migrate,
    "relay": run_relay,
}
