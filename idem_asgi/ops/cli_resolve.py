"""`idem-asgi resolve`: end one stuck claim by its key, as an operator who checked the provider says.

    idem-asgi resolve pay-7f3a --scope tenant-42 --token 8812... --release
    idem-asgi resolve pay-7f3a --scope tenant-42 --token 8812... --status 201 \\
        --header 'content-type: application/json' --body-file charge.json
    idem-asgi resolve job-42 --namespace jobs:charge --token 8812... --result '{"id": "ch_1"}'

The write is `ops.resolving.resolve_key`, the admin app's too: through the one recovery algorithm,
fenced by the token the operator read with `inspect` or `stale`; a claim that is still live,
renewed, completed or taken over since is left alone, and said so. The key's history (where the
store keeps one) gets a step naming the operator (`user@host via idem-asgi resolve`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..claims.recovery import Outcome
from ..errors import ConfigurationError
from ..history import operator
from ..records import RecordKey, StoredResponse
from .cli_io import emit, open_store
from .cli_load import load_transform
from .cli_output import key_doc, label
from .resolving import resolve_key

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


async def run_resolve(args: argparse.Namespace, key: RecordKey) -> int:
    outcome = _outcome(args)
    transform = load_transform(args.transform)
    where = label(key.namespace, key.scope, key.key)
    async with open_store(args) as backend:
        done = await resolve_key(
            backend,
            key,
            args.token,
            outcome,
            by=operator("idem-asgi resolve"),
            older_than=args.older_than,
            lease=args.lease,
            ttl=args.ttl,
            transform=transform,
            dry_run=args.dry_run,
        )
    doc: dict[str, Any] = {**key_doc(key), "resolved": done.done}
    if done.dry_run:
        emit(args, {**doc, "dry_run": True, "would": done.would}, lambda: [f"{where}: {done.why}"])
        return 0
    if done.verdict in ("missing", "refused"):
        said = done.why if done.verdict == "missing" else f"{where}: {done.why}"
        emit(args, {**doc, "why": done.why}, lambda: [said])
        return NOT_DONE
    emit(args, {**doc, "verdict": done.verdict}, lambda: [f"{where}: {done.why}"])
    return 0 if done.done else NOT_DONE
