"""`idem-asgi resolve`: end one stuck claim by its key, as an operator who checked the provider says.

    idem-asgi resolve pay-7f3a --scope tenant-42 --token 8812... --release
    idem-asgi resolve pay-7f3a --scope tenant-42 --token 8812... --status 201 \\
        --header 'content-type: application/json' --body-file charge.json
    idem-asgi resolve job-42 --namespace jobs:charge --token 8812... --result '{"id": "ch_1"}'

The write goes through the one recovery algorithm (`claims.recovery.resolve`), fenced by the token
the operator read with `inspect` or `stale`: a claim that is still live (its lease not over by the
store's clock), renewed, completed or taken over since is left alone, and said so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from ..claims.recovery import Outcome, resolve
from ..claims.surfaces import check_answer, surface_of
from ..errors import ConfigurationError, WrongAnswer
from ..records import IN_PROGRESS, Record, RecordKey, StoredResponse
from ..transform import seal
from .cli_io import emit, open_store
from .cli_load import load_transform
from .cli_output import iso, key_doc, label

NOT_DONE = 1
"""Exit status when nothing was written: no record, not stuck, or changed since it was read."""


def add_parser(sub: Any, common: Any, age: Any) -> None:
    p = sub.add_parser("resolve", help="end one stuck claim by its key: store its answer or release it")
    common(p, top=False)
    age(p)
    p.add_argument("key", help="the Idempotency-Key value (a derived or job key as `stale` lists it)")
    p.add_argument("--namespace", default="idem", help="the middleware's or job's namespace (default: idem)")
    p.add_argument("--scope", default=None, help="whose key it is, as for inspect (default: unscoped)")
    p.add_argument("--token", type=int, required=True, help="the claim's token, as inspect or stale printed it")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--release", action="store_true", help="nothing happened at the provider: the next retry runs")
    what.add_argument("--status", type=int, help="store this HTTP answer (with --header, --body-file)")
    what.add_argument("--result", metavar="JSON", help="store this result for a job's or consumer's record")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'", help="a header of the answer")
    p.add_argument("--body-file", type=Path, default=None, help="the answer's body, read as bytes")
    p.add_argument("--ttl", type=float, default=None, help="keep the answer this long, s (default: as claimed)")
    p.add_argument("--lease", type=float, default=30.0, help="lease held while writing, seconds (30)")
    p.add_argument("--transform", metavar="MODULE:NAME", default=None, help="seal the answer as the app does")
    p.add_argument("--dry-run", action="store_true", help="check and say what would be done; write nothing")


def _outcome(args: argparse.Namespace) -> Outcome:
    if args.release:
        if args.header or args.body_file is not None:
            raise ConfigurationError("--release takes no --header or --body-file")
        return "release"
    if args.result is not None:
        from ..jobs.decorator import stored_result

        try:
            value = json.loads(args.result)
        except ValueError as exc:
            raise ConfigurationError(f"--result is not JSON: {exc}") from None
        return stored_result(value)
    if not 100 <= args.status <= 599:
        raise ConfigurationError(f"--status must be an HTTP status (100-599), got {args.status}")
    headers = []
    for raw in args.header:
        name, sep, value = raw.partition(":")
        if not sep or not name.strip():
            raise ConfigurationError(f"--header {raw!r}: expected 'name: value'")
        headers.append((name.strip().lower().encode("latin-1"), value.strip().encode("latin-1")))
    body = b"" if args.body_file is None else args.body_file.read_bytes()
    return StoredResponse(args.status, headers, body)


def _why_not(record: Record | None, token: int, now: float, older_than: float) -> str | None:
    """Why this record is not the stuck claim the operator means (None: it is)."""
    if record is None:
        return None
    if record.state != IN_PROGRESS:
        return "it is completed already: there is nothing to resolve (inspect shows its answer)"
    if record.token != token:
        return f"its token is {record.token} now, not {token}: it changed since you read it (inspect it again)"
    if record.lease_until > now:
        return f"its lease runs until {iso(record.lease_until)}: its holder is live; wait for the lease, then retry"
    if record.lease_until > now - older_than:
        return (
            f"its lease ended {now - record.lease_until:.0f} s ago, less than --older-than {older_than:g}: "
            "a live holder stalled past its lease may still renew; wait, or pass --older-than 0"
        )
    return None


async def run_resolve(args: argparse.Namespace, key: RecordKey) -> int:
    outcome = _outcome(args)
    transform = load_transform(args.transform)
    where = label(key.namespace, key.scope, key.key)
    async with open_store(args) as backend:
        record = await backend.get(key)
        if record is None:
            scope = "" if key.scope else " (a scoped key needs --scope)"
            why = f"no record for {where}{scope}: expired, released, or never claimed"
            emit(args, {**key_doc(key), "resolved": False, "why": why}, lambda: [why])
            return NOT_DONE
        refused = _why_not(record, args.token, time.time(), args.older_than)
        if refused is not None:
            emit(args, {**key_doc(key), "resolved": False, "why": refused}, lambda: [f"{where}: {refused}"])
            return NOT_DONE
        doing = f"store a {outcome.status} answer" if isinstance(outcome, StoredResponse) else "release it"
        if isinstance(outcome, StoredResponse):
            outcome = seal(transform, outcome)  # marked, so the app opens it with its own transform
            try:
                check_answer(key, record, outcome)
            except WrongAnswer as exc:
                raise ConfigurationError(str(exc)) from None
        if args.dry_run:
            said = f"{where}: {surface_of(record.fingerprint)} claim, token {record.token}: would {doing} (dry run)"
            emit(args, {**key_doc(key), "resolved": False, "dry_run": True, "would": doing}, lambda: [said])
            return 0
        ttl = args.ttl if args.ttl is not None else (record.ttl or args.lease)
        verdict, _ = await resolve(backend, key, record, outcome, lease=args.lease, ttl=ttl)
    done = verdict in ("completed", "released")
    said = {
        "completed": f"stored the {getattr(outcome, 'status', '')} answer: retries replay it",
        "released": "released: the next retry runs it",
        "gone": "gone since it was read (released, completed or expired)",
        "changed": "changed since it was read (renewed, completed or taken over): nothing written",
        "refused": "taken over, but the write was refused: inspect it again",
        "committed": "its effect committed (transaction()): it is never released; store its answer instead",
    }.get(verdict, verdict)
    doc: dict[str, Any] = {**key_doc(key), "resolved": done, "verdict": verdict}
    emit(args, doc, lambda: [f"{where}: {said}"])
    return 0 if done else NOT_DONE
