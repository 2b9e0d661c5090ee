"""Each key's history: a short, bounded trail of what happened to it, kept beside its record.

A store built with `history=N` (memory, Redis, Postgres) keeps the last N steps of each key: who
claimed it (host and process, the token's first digits), its lease renewals, the repeats it answered
and refused, how it ended (completed with a status, released, kept as outcome-unknown, expired,
recovered) and which operator resolved it. `idem-asgi inspect` and the admin app show it.

Requests never wait for it: steps are queued in the process and written in the background, one
round trip per batch of keys (`claims.trail.Trail`), and repeats of one kind are counted into one
step (`n`), so a storm of 10,000 replays adds one step, not 10,000. A step that cannot be written
(the store is down) is dropped and counted, never retried at a request's expense: the history is
for people, the record is what the library decides by.
"""

from __future__ import annotations

import getpass
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import msgspec

if TYPE_CHECKING:
    from .records import Record

KEEP: Final = 32
"""Steps kept per key when an operator writes one to a store built without `history`."""
COUNTED: Final = frozenset(
    {"renewed", "replayed", "conflict", "mismatch", "not_stored", "answer_expired", "outcome_unknown"}
)
"""Steps that happen again and again: one following a step of the same kind and token adds to its `n`
(in the queue and in the store), so a storm of repeats cannot push a key's claim out of its history."""


class Step(msgspec.Struct, omit_defaults=True, gc=False):
    """One step of a key's history. Times are seconds since the epoch on the writer's clock."""

    at: float
    what: str
    """claimed, renewed, replayed, conflict (a repeat while it ran), mismatch, completed, released,
    kept (outcome unknown: failed after its answer started or its effect), interrupted, expired,
    recovered, lease_lost, not_stored, outcome_unknown, resolved (by an operator)."""
    by: str = ""
    """`host:pid` of the process, or the operator (`user@host via idem-asgi resolve`, the admin app's user)."""
    token: str = ""
    """The claim's token, first 8 digits (as `inspect` and `stale` print it in full)."""
    status: int | None = None
    n: int = 1
    """How many times it happened in a row (repeats, renewals), counted into one step."""
    note: str = ""


_encode = msgspec.json.Encoder().encode
_decode_one = msgspec.json.Decoder(Step).decode
_decode_many = msgspec.json.Decoder(list[Step]).decode


def encode_step(step: Step) -> bytes:
    """One step as the stores keep it: compact JSON (readable in `redis-cli` and `psql`)."""
    return _encode(step)


def encode_steps(steps: Sequence[Step]) -> bytes:
    return _encode(steps)


def decode_step(data: bytes | str) -> Step:
    return _decode_one(data)


def decode_steps(data: bytes | str) -> list[Step]:
    return _decode_many(data)


def counted_into(last: Step, step: Step) -> bool:
    """Add `step` to `last` when it repeats it (see `COUNTED`); whether it did."""
    if step.what in COUNTED and last.what == step.what and last.token == step.token:
        last.n += step.n
        return True
    return False


def lost_claim(steps: Sequence[Step], record: Record | None) -> Step | None:
    """The `claimed` step of the record's running claim when the history lacks it (else None): a
    holder killed in the first milliseconds of its work dies before its step is written, and the
    record still knows its token and (from its expiry and TTL) when it claimed."""
    if record is None or record.state != "in_progress" or not record.token:
        return None
    prefix = token_prefix(record.token)
    if any(s.what == "claimed" and s.token == prefix for s in steps):
        return None
    at = record.expires_at - record.ttl if record.ttl else record.lease_until
    return Step(at, "claimed", token=prefix, note="read from the record: its holder stopped before writing this step")


def with_claim(steps: list[Step], record: Record | None) -> list[Step]:
    """`steps` in time order, with the running claim's lost step (`lost_claim`) at its place."""
    lost = lost_claim(steps, record)
    return sorted(steps if lost is None else [*steps, lost], key=lambda s: s.at)


def token_prefix(token: int) -> str:
    return str(token)[:8] if token else ""


def this_process() -> str:
    """`host:pid`: who a step written by this process is by (read each time: a forked worker differs)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def operator(via: str) -> str:
    """The operator running a tool on this machine, as a history step names them."""
    try:
        user = getpass.getuser()
    except Exception:  # no login name (a container without a passwd entry)
        user = str(os.getuid()) if hasattr(os, "getuid") else "?"
    return f"{user}@{socket.gethostname()} via {via}"
