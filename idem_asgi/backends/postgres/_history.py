"""Each key's history on Postgres: one row per key in `<table>_history`, its steps a JSON array.

One statement per batch of keys (arrays unnested): a new key's row is inserted, an existing one
gets the steps appended (a repeat counted into the last step when it repeats it:
`history.COUNTED`), the last N kept; the row lives as long as the claim's TTL from its last write
(a record's expiry is its TTL from its claim or completion, which the history's writes follow), and
`purge()` deletes it with the expired records. Never on a request's path: `claims.trail` writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ...history import COUNTED, KEEP, Step, decode_steps, encode_steps

if TYPE_CHECKING:
    from ...records import RecordKey

DDL: Final = """\
CREATE TABLE IF NOT EXISTS {history} (
    namespace   text        NOT NULL,            -- the record's (namespace, scope, key), as its row has them
    scope       text        NOT NULL,
    key         text        NOT NULL,
    steps       jsonb       NOT NULL,            -- the key's last steps, oldest first (idem_asgi.history)
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (namespace, scope, key)
);
CREATE INDEX IF NOT EXISTS {history_index} ON {history} (expires_at);
"""


class HistorySql:
    """The statements for one history table."""

    __slots__ = ("purge", "read", "write")

    def __init__(self, h: str) -> None:
        # `m.x`: the steps the row will hold before trimming: the new ones alone for a row past its
        # expiry; else the old ones, with the last counted into when the first new step repeats it.
        merged = """
    CASE WHEN h.expires_at <= now() THEN EXCLUDED.steps
         WHEN (EXCLUDED.steps->0->>'what') = ANY($7::text[])
              AND (h.steps->-1->>'what') = (EXCLUDED.steps->0->>'what')
              AND coalesce(h.steps->-1->>'token', '') = coalesce(EXCLUDED.steps->0->>'token', '')
         THEN (h.steps - (-1))
              || jsonb_build_array(jsonb_set(h.steps->-1, '{n}', to_jsonb(
                   coalesce((h.steps->-1->>'n')::int, 1) + coalesce((EXCLUDED.steps->0->>'n')::int, 1))))
              || (EXCLUDED.steps - 0)
         ELSE h.steps || EXCLUDED.steps END"""
        self.write = f"""
INSERT INTO {h} AS h (namespace, scope, key, steps, expires_at)
SELECT u.n, u.s, u.k, u.st::jsonb, now() + u.t * interval '1 second'
FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::float8[]) AS u(n, s, k, st, t)
ON CONFLICT (namespace, scope, key) DO UPDATE SET
  steps = (SELECT coalesce(jsonb_agg(e ORDER BY i), '[]'::jsonb)
           FROM (SELECT {merged} AS x) m, jsonb_array_elements(m.x) WITH ORDINALITY AS t(e, i)
           WHERE i > jsonb_array_length(m.x) - $6::int),
  expires_at = CASE WHEN h.expires_at <= now() THEN EXCLUDED.expires_at
                    ELSE greatest(h.expires_at, EXCLUDED.expires_at) END"""
        self.read = f"""
SELECT steps::text FROM {h} WHERE namespace = $1 AND scope = $2 AND key = $3 AND expires_at > now()"""
        self.purge = f"""
DELETE FROM {h} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {h} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED
)) AND expires_at <= now()"""


def write_args(batch: Sequence[tuple[RecordKey, float, Sequence[Step]]], row_of: Any, keep: int) -> tuple[Any, ...]:
    """The write's parameters for `batch` (sorted by row, one row per key: a batch never locks
    two rows in an order another batch reverses)."""
    rows: dict[tuple[str, str, str], tuple[float, list[Step]]] = {}
    for key, ttl, steps in batch:
        if steps:
            row = row_of(key)
            found = rows.get(row)
            if found is None:
                rows[row] = (ttl, list(steps))
            else:
                rows[row] = (max(found[0], ttl), [*found[1], *steps])
    ordered = sorted(rows.items())
    return (
        [r[0] for r, _ in ordered],
        [r[1] for r, _ in ordered],
        [r[2] for r, _ in ordered],
        [encode_steps(steps).decode() for _, (_, steps) in ordered],
        [ttl for _, (ttl, _) in ordered],
        keep or KEEP,
        sorted(COUNTED),
    )


def steps_of(text: str | None) -> list[Step]:
    return [] if text is None else decode_steps(text)
