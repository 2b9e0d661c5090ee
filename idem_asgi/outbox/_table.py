"""The outbox table: messages written in the same transaction as the effect they announce.

A message added inside `PostgresBackend.transaction()` commits with the business writes and the
claim's "effect committed" mark, or rolls back with them: there is no moment where the effect
exists and its message does not. The relay (`relay.py`) reads the table afterwards.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from ..context import current_idempotency
from ..errors import ConfigurationError

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_json = msgspec.json.Encoder()
_headers = msgspec.json.Decoder(dict[str, str])


class OutboxMessage(NamedTuple):
    """One message as the relay publishes it. `id` is its message id on every broker (`message_id`
    on RabbitMQ, `Nats-Msg-Id` on NATS): the same on every publish of the row, so a consumer keyed by
    it applies a republished message once."""

    seq: int
    id: str
    key: str
    subject: str
    body: bytes
    headers: dict[str, str]
    attempts: int


class Backlog(NamedTuple):
    """What waits in the outbox (for a gauge or an alert)."""

    unsent: int
    oldest_seconds: float  # age of the oldest unsent message (0 when none)
    failing: int  # unsent messages whose last publish failed
    last_error: str | None


def _quoted(name: str) -> tuple[str, str]:
    """(quoted table name, bare last part) of `name` or `schema.name`."""
    parts = name.split(".")
    if len(parts) > 2 or not all(_IDENT.fullmatch(p) for p in parts):
        raise ConfigurationError(f"invalid outbox table name {name!r}")
    return ".".join(f'"{p}"' for p in parts), parts[-1]


def _claim_digest() -> str | None:
    """The record digest of the claim running in this context: orders its messages without writing
    its raw key (which may be a secret) into another table."""
    info = current_idempotency()
    claim = None if info is None else info._claim
    rkey = None if claim is None else getattr(claim, "rkey", None)
    return None if rkey is None else str(rkey.digest)


class Outbox:
    """The outbox of one PostgreSQL database: `add` inside a transaction, `setup`, `backlog`, `purge`.

    `backend` is the `PostgresBackend` whose `transaction()` the app uses (its pool serves `setup`,
    `backlog`, `purge` and the relay); `table` defaults to `<records table>_outbox`.
    """

    def __init__(self, backend: Any, *, table: str | None = None) -> None:
        records = getattr(backend, "table", None)
        if table is None:
            if not isinstance(records, str):
                raise ConfigurationError("Outbox needs a PostgresBackend (or table=...)")
            table = records.replace('"', "") + "_outbox"
        self.backend = backend
        self.table, bare = _quoted(table)
        schema = self.table.rsplit(".", 1)[0] + "." if "." in self.table else ""
        self.lock_name = self.table  # the relays' leader lock (one publishes at a time)
        t = self.table
        self.ddl = [
            f"""CREATE TABLE IF NOT EXISTS {t} (
    seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id uuid NOT NULL UNIQUE,
    key text NOT NULL,
    subject text NOT NULL,
    body bytea NOT NULL,
    headers jsonb NOT NULL DEFAULT '{{}}',
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz,
    attempts integer NOT NULL DEFAULT 0,
    next_try_at timestamptz NOT NULL DEFAULT now(),
    last_error text
)""",
            f'CREATE INDEX IF NOT EXISTS {schema}"{bare}_unsent_idx" ON {t} (key, seq) WHERE sent_at IS NULL',
            f'CREATE INDEX IF NOT EXISTS {schema}"{bare}_sent_idx" ON {t} (sent_at) WHERE sent_at IS NOT NULL',
        ]
        # One statement (one round trip) per message. One key's messages are added one transaction at a
        # time (a transaction-scoped advisory lock on the key, taken before the row's seq is drawn), so
        # seq order is commit order within a key. No NOTIFY: PostgreSQL serializes the commits of
        # transactions that notify, a cost every payment would pay; the relay polls instead.
        self._add = (
            f"WITH held AS (SELECT pg_advisory_xact_lock(hashtext($6), hashtext($2))) "
            f"INSERT INTO {t} (id, key, subject, body, headers) SELECT $1, $2, $3, $4, $5::jsonb FROM held"
        )
        # Due messages in seq order, except those behind an earlier unsent message of their key that
        # waits for its retry: a key's messages go out in the order they were added.
        self._due = f"""SELECT o.seq, o.id::text, o.key, o.subject, o.body, o.headers::text, o.attempts FROM {t} o
WHERE o.sent_at IS NULL AND o.next_try_at <= now() AND NOT EXISTS (
    SELECT 1 FROM {t} e WHERE e.sent_at IS NULL AND e.key = o.key AND e.seq < o.seq AND e.next_try_at > now())
ORDER BY o.seq LIMIT $1"""
        self._sent = (
            f"UPDATE {t} SET sent_at = now(), last_error = NULL WHERE seq = ANY($1::bigint[]) AND sent_at IS NULL"
        )
        self._failed = f"""UPDATE {t} SET attempts = attempts + 1, last_error = $2,
    next_try_at = now() + make_interval(secs => least($3::float8, $4::float8 * 2 ^ least(attempts, 16)))
WHERE seq = $1 AND sent_at IS NULL"""
        self._backlog = f"""SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8,
    count(*) FILTER (WHERE attempts > 0),
    (SELECT last_error FROM {t} WHERE sent_at IS NULL AND last_error IS NOT NULL ORDER BY seq LIMIT 1)
FROM {t} WHERE sent_at IS NULL"""
        self._purge = f"""DELETE FROM {t} WHERE seq IN (
    SELECT seq FROM {t} WHERE sent_at IS NOT NULL AND sent_at < now() - make_interval(secs => $1::float8) LIMIT $2)"""

    async def _pool(self) -> Any:
        return await self.backend._get_pool()

    async def setup(self) -> None:
        """Create the table and its indexes if they do not exist (`ddl` lists the statements)."""
        pool = await self._pool()
        async with pool.acquire() as conn:
            for statement in self.ddl:
                await conn.execute(statement)

    async def add(
        self,
        conn: Any,
        subject: str,
        body: bytes | str,
        *,
        headers: Mapping[str, str] | None = None,
        key: str | None = None,
    ) -> str:
        """Add a message in the transaction open on `conn` (the connection `backend.transaction()`
        yields); it commits or rolls back with the effect. Returns its id, the message id every
        publish of it carries.

        `subject` is the NATS subject or the RabbitMQ routing key. `key` orders messages: one key's
        go out in the order they were added (default: the idempotency key of the request or job
        running in this context, by its record digest; else the subject)."""
        if not conn.is_in_transaction():
            raise ConfigurationError(
                "outbox.add() runs inside a transaction (async with backend.transaction() as conn): "
                "outside one, the message would commit without the effect it announces"
            )
        if key is None:
            key = _claim_digest() or subject
        if headers and not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
            raise ConfigurationError(f"outbox headers are strings (name: value), got {dict(headers)!r}")
        data = body.encode() if isinstance(body, str) else bytes(body)
        message_id = uuid.uuid4()
        fields = _json.encode(dict(headers or {})).decode()
        await conn.execute(self._add, message_id, key, subject, data, fields, self.lock_name)
        return str(message_id)

    async def due(self, conn: Any, limit: int) -> list[OutboxMessage]:
        """The next messages to publish, in seq order, each key's in its order."""
        rows = await conn.fetch(self._due, limit)
        return [OutboxMessage(r[0], r[1], r[2], r[3], bytes(r[4]), _headers.decode(r[5]), r[6]) for r in rows]

    async def mark_sent(self, conn: Any, seqs: list[int]) -> None:
        if seqs:
            await conn.execute(self._sent, seqs)

    async def mark_failed(self, conn: Any, seq: int, error: str, *, first: float, most: float) -> None:
        await conn.execute(self._failed, seq, error[:500], most, first)

    async def backlog(self) -> Backlog:
        """How many messages wait, how old the oldest is, how many failed to publish and why."""
        pool = await self._pool()
        async with pool.acquire() as conn:
            row = await conn.fetchrow(self._backlog)
        return Backlog(int(row[0]), float(row[1]), int(row[2]), row[3])

    async def purge(self, older_than: float = 86_400.0, *, batch: int = 5_000) -> int:
        """Delete messages sent more than `older_than` seconds ago, `batch` rows per statement; how many."""
        pool = await self._pool()
        total = 0
        while True:
            async with pool.acquire() as conn:
                status = await conn.execute(self._purge, float(older_than), batch)
            done = int(status.split()[-1])
            total += done
            if done < batch:
                return total
