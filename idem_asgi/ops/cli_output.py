"""What the `idem-asgi` CLI prints: one JSON document per command (`--json`), or lines of text."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ..history import Step
from ..records import Record, RecordKey, StaleRecord, StoredResponse
from ..sealed_keys import ENV_SECRET
from .reconcile import ReconcileItem, ReconcileReport


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def text(raw: bytes) -> str:
    return raw.decode("latin-1")


def response_doc(response: StoredResponse) -> dict[str, Any]:
    return {
        "status": response.status,
        "headers": [[text(n), text(v)] for n, v in response.headers],
        "body_size": len(response.body),
        "replayable": response.replayable,
        "sealed": response.sealed,
        "tombstone": response.tombstone,
    }


def key_doc(key: RecordKey) -> dict[str, Any]:
    return {"namespace": key.namespace, "scope": key.scope, "key": key.key, "digest": key.digest}


def record_doc(key: RecordKey, record: Record) -> dict[str, Any]:
    return {
        **key_doc(key),
        "found": True,
        "state": record.state,
        "token": record.token,
        "fingerprint": record.fingerprint.hex(),
        "lease_until": iso(record.lease_until),
        "expires_at": iso(record.expires_at),
        "response": None if record.response is None else response_doc(record.response),
        "checkpoint": record.checkpoint,
        "effect_committed": record.effect_committed,
        "holder_failed": record.holder_failed,
        "ttl": record.ttl,
    }


def step_doc(step: Step) -> dict[str, Any]:
    return {
        "at": iso(step.at),
        "what": step.what,
        "by": step.by,
        "token": step.token,
        "status": step.status,
        "n": step.n,
        "note": step.note,
    }


def step_line(step: Step) -> str:
    """One step as `inspect` prints it: when, what (and how often), status, token, by whom."""
    what = step.what + (f" x{step.n}" if step.n > 1 else "")
    more = [f"status {step.status}"] if step.status is not None else []
    more += [f"token {step.token}..."] if step.token else []
    more += [step.note] if step.note and step.note != step.what else []
    return f"  {iso(step.at)}  {what:<16} {', '.join(more):<36} {step.by}".rstrip()


def stale_doc(s: StaleRecord) -> dict[str, Any]:
    return {
        **key_doc(s.key),
        "token": s.record.token,
        "fingerprint": s.record.fingerprint.hex(),
        "lease_until": iso(s.record.lease_until),
        "expires_at": iso(s.record.expires_at),
        "effect_committed": s.effect_committed,
        "holder_failed": s.record.holder_failed,
        "checkpoint": s.record.checkpoint,
        "ttl": s.record.ttl,
    }


def label(namespace: str, scope: str, key: str) -> str:
    return f"{namespace} / {scope or '-'} / {key}"


def key_label(key: RecordKey) -> str:
    """`label`, or the digest for a record whose store keeps no raw key (`store_keys=False`)."""
    if key.hidden:
        return f"{key.namespace} / sha256:{key.digest[:16]}"
    return label(key.namespace, key.scope, key.key)


def hidden_note(hidden: int, seal: object) -> list[str]:
    """Why `hidden` listed claims read as a digest, and what lists them by key (none: no line)."""
    if not hidden:
        return []
    if seal is None:
        why = f"keys are kept as digests and no {ENV_SECRET} is set here"
    else:
        why = f"their key was not sealed with a secret of {ENV_SECRET} (written without one, or another)"
    return [
        f"{hidden} claim(s) shown by digest: {why}; give the app and this tool the same {ENV_SECRET} "
        "to list claims by key, or match known keys with idem_asgi.ops.reconcile.key_among"
    ]


def report_doc(report: ReconcileReport) -> dict[str, Any]:
    return {
        "examined": report.examined,
        "completed": report.completed,
        "released": report.released,
        "unresolved": report.unresolved,
        "skipped": report.skipped,
        "errors": report.errors,
        "dry_run": report.dry_run,
        "items": [
            {
                "namespace": i.namespace,
                "scope": i.scope,
                "key": i.key,
                "digest": i.digest,
                "token": i.token,
                "lease_until": iso(i.lease_until),
                "action": i.action,
                "detail": i.detail,
            }
            for i in report.items
        ],
    }


def item_label(i: ReconcileItem) -> str:
    """As `stale` prints the same claim: the digest when the store keeps no raw key."""
    if i.digest and i.scope == i.key == "?":
        return f"{i.namespace} / sha256:{i.digest[:16]}"
    return label(i.namespace, i.scope, i.key)


def report_lines(report: ReconcileReport, seal: object = None) -> list[str]:
    out = [f"{i.action:<10}  {item_label(i)}  {i.detail}" for i in report.items]
    out += hidden_note(sum(i.scope == i.key == "?" for i in report.items), seal)
    r = report
    out.append(
        f"examined {r.examined}: completed {r.completed}, released {r.released}, unresolved {r.unresolved}, "
        f"skipped {r.skipped}, errors {r.errors}" + (" (dry run: nothing written)" if r.dry_run else "")
    )
    return out
