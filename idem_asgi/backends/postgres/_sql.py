"""The SQL of `PostgresBackend`: the table's DDL and every statement, built once per table name.

Every value is a bound parameter (`$1`, ...); only the table name (validated and quoted by the
backend) is written into the text.
"""

from __future__ import annotations

import hashlib
from typing import Final

DDL: Final = """\
CREATE TABLE IF NOT EXISTS {table} (
    namespace   text        NOT NULL,
    scope       text        NOT NULL,
    key         text        NOT NULL,
    state       "char"      NOT NULL,            -- 'p' in progress, 't' in progress inside a transaction() not
                                                 -- committed yet, 'e' in progress with its effect committed
                                                 -- (see PostgresBackend.transaction), 'u' in progress whose
                                                 -- holder failed mid-answer (mark_failed), 'f' both (its effect
                                                 -- committed, then its holder failed), 'c' completed
    fingerprint bytea       NOT NULL,
    token       bigint      NOT NULL,            -- fencing token of the current holder
    lease_until timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    status      integer,
    headers     bytea,                           -- msgpack list of [name, value] byte pairs, in order
    body        bytea,                           -- response body, verbatim
    replayable  boolean,
    checkpoint  text,                            -- the last step the handler recorded (checkpoint())
    trailers    bytea,                           -- msgpack list of HTTP trailer pairs, NULL when none
    ttl         float8,                          -- seconds the record was claimed for (reconcile keeps that)
    sealed      boolean,                         -- the answer went through the app's transform (NULL: in clear)
    watched     boolean,                         -- a repeat held in another process waits for this claim's end
                                                 -- (watch): the end is NOTIFYed on the table's channel
    sealed_key  text,                            -- scope and key sealed with IDEM_ASGI_KEY_SECRET (NULL: none set)
    kept_until  timestamptz,                     -- when the answer's bytes go (replay_ttl); purge() then keeps
    kept        bytea,                           -- its tombstone: these headers (its Location), no body
    PRIMARY KEY (namespace, scope, key)          -- (namespace '', key E'\\x1fstore_keys': the settings row of
);                                               -- an app with store_keys=True; migrate keeps raw keys then)
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS checkpoint text;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS trailers bytea;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS ttl float8;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS sealed boolean;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS watched boolean;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS sealed_key text;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS kept_until timestamptz;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS kept bytea;
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at);
CREATE INDEX IF NOT EXISTS {inflight_index} ON {table} (lease_until) WHERE state <> 'c';
CREATE INDEX IF NOT EXISTS {kept_index} ON {table} (kept_until) WHERE kept_until IS NOT NULL;
"""

_COLUMNS: Final = (
    "state, fingerprint, token, extract(epoch from lease_until)::float8 AS lease_until, "
    "extract(epoch from expires_at)::float8 AS expires_at, status, headers, body, replayable, "
    "extract(epoch from now())::float8 AS now, checkpoint, trailers, ttl, sealed"
)


_QUALIFIED: Final = (
    "r.state, r.fingerprint, r.token, extract(epoch from r.lease_until)::float8 AS lease_until, "
    "extract(epoch from r.expires_at)::float8 AS expires_at, r.status, r.headers, r.body, r.replayable, "
    "extract(epoch from now())::float8 AS now, r.checkpoint, r.trailers, r.ttl, r.sealed"
)


def _telling(change: str, at: int) -> str:
    """`change` (an UPDATE or DELETE of one claim), answering its row count and telling a watcher."""
    return (
        f"WITH u AS ({change.strip()}\nRETURNING watched)\n"
        f"SELECT count(*)::int, max(CASE WHEN watched THEN pg_notify(${at}, ${at + 1})::text END) FROM u"
    )


def index_name(table: str, suffix: str) -> str:
    """A quoted index name for `table` that stays distinct within Postgres's 63-byte limit."""
    name = f"{table}_{suffix}"
    if len(name) > 63:
        name = f"{table[:40]}_{hashlib.sha256(table.encode()).hexdigest()[:8]}_{suffix}"
    return f'"{name}"'


class Statements:
    """Every statement of the backend for one (quoted) table name."""

    __slots__ = (
        "checkpoint",
        "claim",
        "claim_many",
        "closing",
        "complete",
        "complete_many",
        "completed_by",
        "effect",
        "extend",
        "fail",
        "get",
        "holder",
        "opening",
        "purge",
        "release",
        "shrink",
        "stale",
        "takeover",
        "watch",
    )

    def __init__(self, table: str) -> None:
        t = table
        # Claim-or-read in one statement that takes no lock and writes nothing unless it claims:
        # `cur` reads the row in the statement's snapshot; a live row is returned as is (a replay
        # or a 409 is a plain read: no row lock, no transaction id, no WAL flush at commit). With
        # no row, `ins` inserts; with a free row (TTL over, or the lease of `$8` ended), `upd`
        # takes it over, its WHERE re-checked on the newest row version. Both arms are exclusive.
        # The statement returns no row when it lost a race it cannot see: a concurrent insert
        # that committed after our snapshot (ON CONFLICT DO NOTHING waits for it, then does
        # nothing, and the row is invisible to `cur`), or a free row another claimer or purge
        # changed first. The caller then runs it again with a fresh snapshot.
        free = "(r.expires_at <= now())"  # a claim takes over only a row past its TTL
        reset = """
        sealed_key = ${sealed_key}, state = 'p', fingerprint = $4, token = $5, created_at = now(), ttl = $7::float8,
        lease_until = now() + $6::float8 * interval '1 second', expires_at = now() + $7::float8 * interval '1 second',
        status = NULL, headers = NULL, body = NULL, replayable = NULL, checkpoint = NULL, trailers = NULL,
        sealed = NULL, watched = NULL, kept_until = NULL, kept = NULL"""
        self.claim = f"""
WITH cur AS (
    SELECT {_COLUMNS}, {free} AS free FROM {t} AS r WHERE namespace = $1 AND scope = $2 AND key = $3
), ins AS (
    INSERT INTO {t} (namespace, scope, key, state, fingerprint, token, lease_until, expires_at, ttl, sealed_key)
    SELECT $1, $2, $3, 'p', $4, $5, now() + $6::float8 * interval '1 second', now() + $7::float8 * interval '1 second',
           $7::float8, $8::text
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (namespace, scope, key) DO NOTHING
    RETURNING true
), upd AS (
    UPDATE {t} AS r SET {reset.format(sealed_key=8)}
    WHERE namespace = $1 AND scope = $2 AND key = $3 AND EXISTS (SELECT 1 FROM cur WHERE free) AND {free}
    RETURNING true
)
SELECT true, NULL::"char", NULL::bytea, NULL::bigint, NULL::float8, NULL::float8, NULL::integer, NULL::bytea,
       NULL::bytea, NULL::boolean, NULL::float8, NULL::text, NULL::bytea, NULL::float8, NULL::boolean
FROM ins
UNION ALL
SELECT true, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM upd
UNION ALL
SELECT false, state, fingerprint, token, lease_until, expires_at, status, headers, body, replayable, now, checkpoint,
       trailers, ttl, sealed
FROM cur WHERE NOT free
"""
        # The same claim for many keys at once (group commit), over arrays sorted by key; each result
        # row carries its claim's token last. A key given twice is claimed once: the other calls get
        # the claim just made (`won`, from what the insert or takeover returned), as a later
        # statement would show it, not a lost race (their tries are not spent on each other).
        self.claim_many = f"""
WITH q AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::int8[], $6::float8[], $7::float8[],
                         $8::text[]) AS q(namespace, scope, key, fingerprint, token, lease, ttl, sealed_key)
), cur AS (
    SELECT q.token AS asked, {_QUALIFIED}, r.expires_at <= now() AS free
    FROM q JOIN {t} AS r ON r.namespace = q.namespace AND r.scope = q.scope AND r.key = q.key
), ins AS (
    INSERT INTO {t} (namespace, scope, key, state, fingerprint, token, lease_until, expires_at, ttl, sealed_key)
    SELECT q.namespace, q.scope, q.key, 'p', q.fingerprint, q.token, now() + q.lease * interval '1 second',
           now() + q.ttl * interval '1 second', q.ttl, q.sealed_key
    FROM q WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.asked = q.token)
    ORDER BY q.namespace, q.scope, q.key
    ON CONFLICT (namespace, scope, key) DO NOTHING
    RETURNING namespace, scope, key, fingerprint, token, lease_until, expires_at, ttl
), upd AS (
    UPDATE {t} AS r SET sealed_key = q.sealed_key, state = 'p', fingerprint = q.fingerprint, token = q.token,
        created_at = now(), ttl = q.ttl, lease_until = now() + q.lease * interval '1 second',
        expires_at = now() + q.ttl * interval '1 second', status = NULL, headers = NULL, body = NULL,
        replayable = NULL, checkpoint = NULL, trailers = NULL, sealed = NULL, watched = NULL, kept_until = NULL,
        kept = NULL
    FROM q
    WHERE r.namespace = q.namespace AND r.scope = q.scope AND r.key = q.key
      AND EXISTS (SELECT 1 FROM cur WHERE cur.asked = q.token AND free) AND {free}
    RETURNING r.namespace, r.scope, r.key, r.fingerprint, r.token, r.lease_until, r.expires_at, r.ttl
), won AS (
    SELECT * FROM ins UNION ALL SELECT * FROM upd
)
SELECT true, NULL::"char", NULL::bytea, NULL::bigint, NULL::float8, NULL::float8, NULL::integer, NULL::bytea,
       NULL::bytea, NULL::boolean, NULL::float8, NULL::text, NULL::bytea, NULL::float8, NULL::boolean, token
FROM won
UNION ALL
SELECT false, 'p', w.fingerprint, w.token, extract(epoch from w.lease_until)::float8,
       extract(epoch from w.expires_at)::float8, NULL, NULL, NULL, NULL, extract(epoch from now())::float8, NULL,
       NULL, w.ttl, NULL, q.token
FROM q JOIN won AS w ON w.namespace = q.namespace AND w.scope = q.scope AND w.key = q.key AND w.token <> q.token
UNION ALL
SELECT false, state, fingerprint, token, lease_until, expires_at, status, headers, body, replayable, now, checkpoint,
       trailers, ttl, sealed, asked
FROM cur WHERE NOT free
"""
        # A takeover: the same update, of a held record whose lease of `$8` ended, never an insert. 'gone'
        # when no live record exists (released, or past its TTL): recovery must not resurrect it.
        held_free = "(r.state IN ('p', 't', 'u') AND r.token = $8 AND r.lease_until <= now() AND r.expires_at > now())"
        self.takeover = f"""
WITH cur AS (
    SELECT {_COLUMNS}, {held_free} AS free, r.expires_at > now() AS live
    FROM {t} AS r WHERE namespace = $1 AND scope = $2 AND key = $3
), upd AS (
    UPDATE {t} AS r SET {reset.format(sealed_key=9)}
    WHERE namespace = $1 AND scope = $2 AND key = $3 AND EXISTS (SELECT 1 FROM cur WHERE free) AND {held_free}
    RETURNING true
)
SELECT 'taken'::text, NULL::"char", NULL::bytea, NULL::bigint, NULL::float8, NULL::float8, NULL::integer,
       NULL::bytea, NULL::bytea, NULL::boolean, NULL::float8, NULL::text, NULL::bytea, NULL::float8, NULL::boolean
FROM upd
UNION ALL
SELECT 'held', state, fingerprint, token, lease_until, expires_at, status, headers, body, replayable, now, checkpoint,
       trailers, ttl, sealed
FROM cur WHERE live AND NOT free
UNION ALL
SELECT 'gone', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM cur WHERE live)
"""
        held = "namespace = $1 AND scope = $2 AND key = $3 AND token = $4"
        where = f"{held} AND state IN ('p', 't', 'e', 'f')"
        # The statements that end a claim answer how many rows they changed, and NOTIFY the record's
        # digest (their last two parameters: channel, digest) when a repeat elsewhere watches it;
        # only then, as a NOTIFY serialises commits.
        self.complete = _telling(
            f"""
UPDATE {t} SET state = 'c', status = $5, headers = $6, body = $7, replayable = $8, trailers = $10,
    sealed = $11, lease_until = now(), expires_at = now() + $9::float8 * interval '1 second',
    kept_until = now() + $12::float8 * interval '1 second', kept = $13
WHERE {where}""",
            14,
        )
        # The same completion for many claims at once (group commit), fenced by each one's token;
        # answers the tokens it completed, and tells each watched one's watcher.
        self.complete_many = f"""
WITH q AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int4[], $6::bytea[], $7::bytea[],
                         $8::bool[], $9::float8[], $10::bytea[], $11::bool[], $12::float8[], $13::bytea[], $14::text[])
        AS q(namespace, scope, key, token, status, headers, body, replayable, ttl, trailers, sealed, keep, kept, digest)
), u AS (
    UPDATE {t} AS r SET state = 'c', status = q.status, headers = q.headers, body = q.body, replayable = q.replayable,
        trailers = q.trailers, sealed = q.sealed, lease_until = now(), expires_at = now() + q.ttl * interval '1 second',
        kept_until = now() + q.keep * interval '1 second', kept = q.kept
    FROM q
    WHERE r.namespace = q.namespace AND r.scope = q.scope AND r.key = q.key AND r.token = q.token
      AND r.state IN ('p', 't', 'e', 'f')
    RETURNING q.token, r.watched, q.digest
)
SELECT token, CASE WHEN watched THEN pg_notify($15, digest)::text END FROM u
"""
        # Never release a record whose effect committed ('e'): a retry must not run it again.
        self.release = _telling(f"DELETE FROM {t} WHERE {held} AND state IN ('p', 't')", 5)
        # A repeat held in another process asks to be told when the claim `$4` ends: true (told),
        # false (it ended already: read it again), NULL (its row is locked by a statement of the
        # holder, e.g. an open transaction(): poll this time, never wait on the lock).
        self.watch = f"""
WITH w AS (
    UPDATE {t} SET watched = true
    WHERE ctid = (SELECT ctid FROM {t} WHERE {where} FOR UPDATE SKIP LOCKED) AND {where}
    RETURNING true
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM w) THEN true
            WHEN EXISTS (SELECT 1 FROM {t} WHERE {where}) THEN NULL ELSE false END"""
        # Idempotent: a second transaction() block of the same request marks it again, harmlessly.
        self.effect = f"UPDATE {t} SET state = 'e' WHERE {held} AND state IN ('p', 't', 'e')"
        # A transaction() opens with no effect before it ('t': if its holder dies before COMMIT, nothing
        # happened), and closes without committing ('p' again: what follows is outside it).
        self.opening = f"UPDATE {t} SET state = 't' WHERE {held} AND state = 'p'"
        self.closing = f"UPDATE {t} SET state = 'p' WHERE {held} AND state = 't'"
        self.holder = f"SELECT state FROM {t} WHERE {held}"
        self.checkpoint = f"UPDATE {t} SET checkpoint = $5 WHERE {where}"
        self.completed_by = f"""
SELECT true FROM {t} WHERE namespace = $1 AND scope = $2 AND key = $3 AND token = $4 AND state = 'c'"""
        # The record outlives its TTL while its holder still runs (renewal), so nobody claims a live key.
        self.extend = f"""
UPDATE {t} SET lease_until = greatest(lease_until, now() + $5::float8 * interval '1 second'),
    expires_at = greatest(expires_at, now() + $5::float8 * interval '1 second') WHERE {where}"""
        # The holder failed mid-answer: lease over now; 'u' (never released), or 'f' after an effect committed.
        self.fail = _telling(
            f"""
UPDATE {t} SET lease_until = least(lease_until, now()), state = CASE WHEN state IN ('e', 'f') THEN 'f' ELSE 'u' END
WHERE {where}""",
            5,
        )
        self.get = f"""
SELECT false, {_COLUMNS} FROM {t} WHERE namespace = $1 AND scope = $2 AND key = $3 AND expires_at > now()"""
        # Row locks are taken by the inner SELECT and skipped when held (a claim re-using an
        # expired row), so a purge never waits on, nor blocks, live traffic for long. TIDs in an
        # array make a TID scan, where `ctid IN (subquery)` would scan the whole table per batch.
        self.purge = f"""
DELETE FROM {t} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED
)) AND expires_at <= now()"""
        # The answers past their first horizon (replay_ttl) shrink to their tombstone: status and the
        # kept headers, no body. The key still refuses until expires_at; a read tells a tombstone by
        # its NULL body. Batched and lock-skipping as purge is, through the kept_until index.
        self.shrink = f"""
UPDATE {t} SET headers = kept, body = NULL, trailers = NULL, replayable = false, kept = NULL, kept_until = NULL
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {t} WHERE kept_until <= now() AND state = 'c' LIMIT $1 FOR UPDATE SKIP LOCKED
)) AND kept_until <= now() AND state = 'c'"""
        self.stale = f"""
SELECT false, {_COLUMNS}, namespace, scope, key, sealed_key FROM {t}
WHERE state <> 'c' AND lease_until <= now() - $1::float8 * interval '1 second' AND expires_at > now()
  AND ($3::text IS NULL OR namespace = $3)
ORDER BY lease_until LIMIT $2"""
