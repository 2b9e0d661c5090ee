"""PostgreSQL store on asyncpg: one statement to claim-or-read, fenced UPDATE/DELETE after it.

The claim is one statement: a snapshot read of the row, an `INSERT ... ON CONFLICT DO NOTHING`
when there is none, and a re-checked `UPDATE` when it is free (TTL over, or an expired lease
being taken over), so a new key and a replay each cost one round trip, a replay writes nothing,
and an expired row is taken over atomically, never by delete-then-insert. Times are the
server's `now()`. The body is kept verbatim as `bytea`.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from typing import Any, Final, Literal

import anyio
import msgspec

from ...errors import BackendError, ClaimLost, ConfigurationError, missing_extra
from ...history import Step
from ...records import Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from ...records import StaleRecord as StaleRecord  # re-exported: it was defined here before records.py
from ...sealed_keys import KeySeal
from .._base import ClosingMixin, new_token
from .._orphans import OrphanSweeper
from ._sql import Statements, index_name

try:
    import asyncpg  # noqa: F401  # the check that the extra is installed
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("PostgresBackend needs asyncpg", "postgres") from exc

# After the check above: these need asyncpg.
from ._effects import effect_transaction, live_claim
from ._group import Args, Group
from ._history import HistorySql, steps_of, write_args
from ._keys import HASHED
from ._lean import POOL_ONLY
from ._notices import Notices, Watching, channel_of
from ._pool import Runner
from ._rows import as_claimed, record_of, row_key

logger = logging.getLogger("idem_asgi")


_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_headers_encode = msgspec.msgpack.Encoder().encode


class PostgresBackend(Watching, ClosingMixin):
    """Idempotency records in a PostgreSQL table through an asyncpg pool.

    Args:
        pool: An `asyncpg.Pool`; it stays yours (`aclose()` closes only a pool built by `from_dsn`).
        table: Table name, optionally `schema.table`.
        timeout: Bound in seconds on each store call, waiting for a pooled connection included;
            a call that runs out answers `BackendUnavailable` (the middleware's 503).
        store_keys: Keep the raw scope and key in their columns, for the ops tools to display.
            By default (False) a row holds only the namespace and the key's SHA-256 digest
            (`scope` empty, `key` = `\x1f<digest>`): nothing a client sent as its key, nor the
            tenant or user it is scoped by, sits in the table. With True, the backend records in
            the table (one settings row, before its first write) that an app looks rows up by raw
            keys, and `idem-asgi migrate` then keeps them raw; without, `migrate` rewrites rows
            of earlier versions.
        key_secret: Keep the scope and key sealed with this secret in `sealed_key` (comma-separated,
            newest first; default `$IDEM_ASGI_KEY_SECRET`), so `stale()` lists claims by key for
            the ops tools holding it while a dump shows none (`idem_asgi.sealed_keys`).
        history: Keep the last `history` steps of each key's history (`idem_asgi.history`) in
            `<table>_history`, written in the background (one statement per batch of keys) and
            purged with the records; 0 (the default): requests write none.
    """

    def __init__(
        self,
        pool: Any = None,
        *,
        table: str = "idem_records",
        timeout: float = 5.0,
        store_keys: bool = False,
        key_secret: str | Sequence[str] | None = None,
        history: int = 0,
    ) -> None:
        if history < 0:
            raise ConfigurationError(f"history must be 0 (none) or more steps, got {history!r}")
        parts = table.split(".")
        if len(parts) > 2 or not all(_IDENT.fullmatch(p) for p in parts):
            raise ConfigurationError(f"invalid table name {table!r}")
        self.table = ".".join(f'"{p}"' for p in parts)
        self._indexes = {
            "expires_index": index_name(parts[-1], "expires_idx"),
            "inflight_index": index_name(parts[-1], "inflight_idx"),
            "kept_index": index_name(parts[-1], "kept_idx"),
            "history_index": index_name(parts[-1], "history_idx"),
        }
        schema = f'"{parts[0]}".' if len(parts) == 2 else ""
        self.history_table = schema + index_name(parts[-1], "history")
        names = {k: schema + v for k, v in self._indexes.items()}
        self._relations = [self.table, names["expires_index"], names["inflight_index"], names["kept_index"]]
        # (what `history` needs besides: asked for only when it is on, so an app without it never
        # needs the right to create a table its role may not, on an upgrade)
        self._history_relations = [self.history_table, names["history_index"]]
        self._timeout = timeout
        self.store_keys = store_keys
        self.key_seal = KeySeal.from_setting(key_secret)
        self._raw_recorded = False  # `store_keys=True` recorded in the table (once per backend)
        self._pool = pool
        self._dsn: str | None = None
        self._pool_options: dict[str, Any] = {}
        self._create_table = True
        self._lean = True  # from_dsn's `implementation`: the lean pool, or asyncpg's
        self._owned = False
        self._lock = anyio.Lock()
        self._orphans = OrphanSweeper(self._abandon_claim)
        self._runner = Runner(timeout, self.table)
        self.sql = Statements(self.table)
        self.history = history
        self._history_sql = HistorySql(self.history_table)
        self._claims: Group[Any] = Group(self._claim_one, self._claim_many, token_at=4)
        self._completions: Group[bool] = Group(self._complete_one, self._complete_many, token_at=3)
        self._channel = channel_of(self.table)
        self._notices: Notices | None = None  # opened by the first watch (from_dsn, no pooler)
        self._pooled = False  # a transaction-mode pooler in front: LISTEN cannot work

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """`postgresql://...`: the same as `from_dsn(url, **options)`."""
        return cls.from_dsn(url, **options)

    @classmethod
    def from_dsn(
        cls,
        dsn: str,
        *,
        table: str = "idem_records",
        timeout: float = 5.0,
        create_table: bool = True,
        store_keys: bool = False,
        key_secret: str | Sequence[str] | None = None,
        implementation: Literal["lean", "asyncpg"] = "lean",
        history: int = 0,
        **pool_options: Any,
    ) -> PostgresBackend:
        """A backend that creates (and owns) its pool on first use, and its table if missing.

        With `create_table=False` the table is never created as a side effect (only `setup()`
        creates it): a missing table is then a `BackendMisconfigured` naming `idem-asgi migrate`.

        The pool holds `min_size=2` to `max_size=20` connections (`pool_options`). Before it is
        built, one connection is asked two things (`_pooler.py`): whether it goes through
        a pooler such as PgBouncer (then the pool's connections make no named prepared statements,
        `statement_cache_size=0`, unless you set it), and the sessions' default isolation (not
        READ COMMITTED, which the claim relies on: then each statement runs in a READ COMMITTED
        transaction). No startup parameter is sent, so a stock PgBouncer in transaction mode
        serves the plain URL.

        `implementation` picks the pool. `"lean"` (the default): a pool of raw asyncpg connections
        (`_lean.py`: half the client CPU per statement of asyncpg's pool, callers served in order);
        every other option goes to `asyncpg.connect` (`ssl`, `server_settings`,
        `statement_cache_size`, ...), and an option only asyncpg's pool has (`init`, `setup`,
        `connect`, `reset`, `max_queries`, `max_inactive_connection_lifetime`) is a
        `ConfigurationError` naming `implementation="asyncpg"`. `"asyncpg"`: `asyncpg.create_pool`
        with all the options, and a reset hook that sends nothing unless you pass `reset` (the
        backend leaves no session state behind, and asyncpg's reset query would double the round trips).
        """
        pool_only = sorted((POOL_ONLY | {"reset"}) & pool_options.keys())
        if implementation not in ("lean", "asyncpg"):
            raise ConfigurationError(f"implementation must be 'lean' or 'asyncpg', got {implementation!r}")
        if implementation == "lean" and pool_only:
            raise ConfigurationError(
                f"{', '.join(pool_only)}: an option of asyncpg's pool; pass implementation='asyncpg' to use it"
            )
        backend = cls(table=table, timeout=timeout, store_keys=store_keys, key_secret=key_secret, history=history)
        backend._lean = implementation == "lean"
        backend._dsn = dsn
        backend._create_table = create_table
        backend._pool_options = {"min_size": 2, "max_size": 20, **pool_options}
        backend._owned = True
        return backend

    def _id(self, key: RecordKey) -> tuple[str, str, str]:
        """The row's (namespace, scope, key) columns: the raw values, or the digest alone."""
        if key.stored_raw or (self.store_keys and not key.hidden):
            return key.namespace, key.scope, key.key
        return key.namespace, "", HASHED + key.digest

    def _sealed(self, key: RecordKey) -> str | None:
        """The sealed scope and key of a digest row (None without a secret, or a key known by digest)."""
        if self.key_seal is None or key.hidden or key.stored_raw or self.store_keys:
            return None
        return self.key_seal.seal(key)

    @property
    def batch_sizes(self) -> dict[str, dict[int, int]]:
        """Group commit so far: for claims and completions, how many statements carried how many rows."""
        return {"claim": dict(self._claims.sizes), "complete": dict(self._completions.sizes)}

    @property
    def batches_split(self) -> int:
        """Batches Postgres refused (a row it cannot store, a deadlock) and that were sent again row by row."""
        return self._claims.split + self._completions.split

    async def _claim_one(self, args: Args) -> tuple[Any, bool]:
        pool = await self._get_pool()
        result: tuple[Any, bool] = await self._runner.run_again(pool, "fetchrow", self.sql.claim, *args)
        return result

    async def _claim_many(self, batch: Sequence[Args]) -> tuple[dict[int, Any], bool]:
        """One statement for every claim of `batch` (sorted by key): each row by its claim's token."""
        pool = await self._get_pool()
        columns = [list(c) for c in zip(*batch, strict=True)]
        rows, retried = await self._runner.run_again(pool, "fetch", self.sql.claim_many, *columns)
        return {row[15]: row for row in rows}, retried

    async def _complete_one(self, args: Args) -> tuple[bool, bool]:
        pool = await self._get_pool()
        changed, retried = await self._runner.run_again(
            pool, "fetchval", self.sql.complete, *args[:13], self._channel, args[13]
        )
        return changed == 1, retried

    async def _complete_many(self, batch: Sequence[Args]) -> tuple[dict[int, bool], bool]:
        """One statement for every completion of `batch`: True for each token it completed."""
        pool = await self._get_pool()
        columns = [list(c) for c in zip(*batch, strict=True)]
        rows, retried = await self._runner.run_again(pool, "fetch", self.sql.complete_many, *columns, self._channel)
        done = {row[0]: True for row in rows}
        return {args[3]: done.get(args[3], False) for args in batch}, retried

    async def _claim(self, key: RecordKey, fingerprint: bytes, lease: float, ttl: float, token: int) -> ClaimResult:
        args = (*self._id(key), fingerprint, token, float(lease), float(ttl), self._sealed(key))
        rerun = False
        for _ in range(5):
            row, retried = await self._claims.run(args)
            rerun = rerun or retried
            if row is None:
                continue  # lost a race our snapshot cannot see (see _sql_claim): read again
            if row[0]:
                return Claimed(token)
            record = record_of(row)
            if rerun and as_claimed(record, token, fingerprint):
                # Our own claim: the statement run again after the connection broke had committed.
                return Claimed(token)
            return Existing(record, row[10])
        raise BackendError("claim found neither a free key nor a record after 5 attempts")

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        if self.store_keys and not self._raw_recorded:
            await self.record_raw_keys()  # before the first raw row: `migrate` must never rewrite it
        token = new_token()
        try:
            return await self._claim(key, fingerprint, lease, ttl, token)
        except BaseException:
            # No answer, so the caller answers 503 and never runs the app, yet the INSERT may have
            # committed: without a sweep that ghost claim would block the key (409, then
            # outcome-unknown) for a whole TTL though nothing ran.
            self._orphans.add((key, token), ttl)
            raise

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        # A takeover whose reply is lost is not swept: it may carry an answer the recover hook supplied.
        if self.store_keys and not self._raw_recorded:
            await self.record_raw_keys()
        pool = await self._get_pool()
        token = new_token()
        args = (*self._id(key), fingerprint, token, lease, ttl, stale_token, self._sealed(key))
        rerun = False
        for _ in range(5):
            row, retried = await self._runner.run_again(pool, "fetchrow", self.sql.takeover, *args)
            rerun = rerun or retried
            if row is None:
                continue  # the row changed between our snapshot and the update: read again
            if row[0] == "taken":
                return Claimed(token)
            if row[0] == "gone":
                return None
            record = record_of(row)
            if rerun and as_claimed(record, token, fingerprint):
                return Claimed(token)  # our own takeover, committed before its answer was lost
            return Existing(record, row[10])
        raise BackendError("takeover found neither the claim nor a record after 5 attempts")

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        args = (*self._id(key), token)
        trailers = None if response.trailers is None else _headers_encode(response.trailers)
        payload = (
            response.status,
            _headers_encode(response.headers),
            response.body,
            response.replayable,
            float(ttl),
            trailers,
            response.sealed or None,
            *_kept(response, ttl),
            key.digest,
        )
        changed, retried = await self._completions.run((*args, *payload))
        if changed:
            return True
        if retried:
            pool = await self._get_pool()
            # The first attempt may have committed before the connection broke: a record completed
            # under our token can only be our own completion.
            return bool(await self._runner.run(pool, "fetchval", self.sql.completed_by, *args))
        return False

    async def release(self, key: RecordKey, token: int) -> bool:
        pool = await self._get_pool()
        # Safe to run twice: a second DELETE under the same token finds nothing (False, harmlessly).
        args = (*self._id(key), token, self._channel, key.digest)
        changed, _ = await self._runner.run_again(pool, "fetchval", self.sql.release, *args)
        return bool(changed == 1)

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        pool = await self._get_pool()
        status = await self._runner.run(pool, "execute", self.sql.extend, *self._id(key), token, lease)
        return bool(status == "UPDATE 1")

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        pool = await self._get_pool()
        args = (*self._id(key), token, self._channel, key.digest)
        changed, _ = await self._runner.run_again(pool, "fetchval", self.sql.fail, *args)
        return bool(changed == 1)

    async def checkpoint(self, step: str, *, key: RecordKey | None = None, token: int | None = None) -> None:
        """Record how far the running handler got (e.g. `"charged ch_123"`) on its claim's row.

        A recover hook or `reconcile` then sees it as `record.checkpoint` if the worker dies, and
        knows what to ask the provider. Without `key`/`token`, the claim of the request running in
        this task is used (the middleware claims in the task that runs the handler). Fenced by
        the token: raises `ClaimLost` when the claim was taken over.
        """
        if key is None or token is None:
            claim = live_claim(self)
            if claim is None:
                raise ClaimLost("checkpoint() outside a request holding a claim of this backend")
            key, token = claim.rkey, claim.token
            assert key is not None
        pool = await self._get_pool()
        status = await self._runner.run(pool, "execute", self.sql.checkpoint, *self._id(key), token, step)
        if status != "UPDATE 1":
            raise ClaimLost(f"the claim on key {key.key!r} is no longer held; checkpoint not recorded")

    async def write_history(self, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
        """Append each key's steps to its row of `<table>_history`: one statement for the batch."""
        pool = await self._get_pool()
        await self._runner.run(pool, "execute", self._history_sql.write, *write_args(batch, self._id, self.history))

    async def read_history(self, key: RecordKey) -> list[Step]:
        """The key's steps, oldest first (none when `<table>_history` was never made: no app had `history`)."""
        pool = await self._get_pool()
        if not await self._has_history(pool):
            return []
        return steps_of(await self._runner.run(pool, "fetchval", self._history_sql.read, *self._id(key)))

    async def _has_history(self, pool: Any) -> bool:
        found: bool = await self._runner.run(pool, "fetchval", "SELECT to_regclass($1) IS NOT NULL", self.history_table)
        return found

    async def get(self, key: RecordKey) -> Record | None:
        pool = await self._get_pool()
        row = await self._runner.run(pool, "fetchrow", self.sql.get, *self._id(key))
        return None if row is None else record_of(row)

    async def purge(self, batch_size: int = 1000, *, max_batches: int | None = None) -> int:
        """Delete expired records, `batch_size` rows per statement; returns how many were deleted.

        Each batch is its own short autocommit statement that skips rows locked by live traffic,
        so it is safe to run while serving (from cron or a periodic task). Stops when a batch
        comes back short, or after `max_batches`.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        pool = await self._get_pool()
        total = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            status = await self._runner.run(pool, "execute", self.sql.purge, batch_size)
            deleted = int(status.rpartition(" ")[2])
            total += deleted
            batches += 1
            if deleted < batch_size:
                break
        batches = 0  # and the answers past their replay_ttl, to their tombstones (not counted: not deleted)
        while max_batches is None or batches < max_batches:
            status = await self._runner.run(pool, "execute", self.sql.shrink, batch_size)
            batches += 1
            if int(status.rpartition(" ")[2]) < batch_size:
                break
        batches = 0  # and the histories past their expiry, by the same rule (not counted: not records)
        while (max_batches is None or batches < max_batches) and await self._has_history(pool):
            status = await self._runner.run(pool, "execute", self._history_sql.purge, batch_size)
            batches += 1
            if int(status.rpartition(" ")[2]) < batch_size:
                break
        return total

    async def stale(
        self, older_than: float = 0.0, limit: int = 1000, *, namespace: str | None = None
    ) -> list[StaleRecord]:
        """In-progress records whose lease ended more than `older_than` seconds ago (store clock).

        Their holder stopped between claim and completion, so their outcome is unknown: the list
        is for a reconcile job that asks the source of truth, then completes or releases them.
        Oldest first, at most `limit`; records past their TTL are not listed; `namespace` keeps
        only that namespace's records.
        """
        pool = await self._get_pool()
        rows = await self._runner.run(pool, "fetch", self.sql.stale, float(older_than), limit, namespace)
        return [
            StaleRecord(
                row_key(row[15], row[16], row[17], self.store_keys, self.key_seal, row[18]),
                record_of(row),
                row[1] in (b"e", b"f"),
            )
            for row in rows
        ]

    def transaction(self, connection: Any = None) -> contextlib.AbstractAsyncContextManager[Any]:
        """A transaction whose commit also records that this request's effect happened.

        Use it in a handler behind `IdempotencyMiddleware` with this backend, for every write the
        request makes to this database::

            async with backend.transaction() as conn:
                await conn.execute("INSERT INTO ledger ...", ...)

        Just before COMMIT it marks the claim `effect committed`, fenced by the claim's token, in
        the same transaction. So the business writes and that mark commit or roll back together:
        a worker killed before COMMIT leaves nothing behind but an in-progress claim, which
        `recover_uncommitted` (as the route's `recover` hook) lets the next retry run again; a
        worker killed after COMMIT leaves a claim that is never run again. A holder whose claim
        was taken over meanwhile gets `ClaimLost` and its writes are rolled back.

        Yields an asyncpg connection from the backend's pool, or `connection` (yours, e.g. one in
        your own unit of work; the block then becomes a savepoint inside your transaction, and the
        mark commits with your COMMIT). A request that carries no key has no claim: the block is
        then a plain transaction.

        Used more than once in one request, each block commits on its own and each marks the claim
        (the claim counts as effect-committed from the first COMMIT: a failure between two blocks
        is never run again, so put what must be all-or-nothing in one block). A block nested in
        another joins it: it is a savepoint on the same connection, and only the outer block's
        COMMIT marks the claim. Nested blocks must run in the task of the outer one.
        """
        return effect_transaction(self, connection)

    async def recover_uncommitted(self, key: RecordKey, record: Record) -> Literal["run"] | None:
        """A `RoutePolicy(recover=...)` hook for handlers whose every effect goes through `transaction()`.

        A claim whose holder died is re-run when its transaction never committed (nothing
        happened), and left to `outcome-unknown` when it did (the effect happened; only the answer
        was lost). The re-run takes the claim over by its old token, so it cannot race the old
        holder: if that one commits after all, the takeover fails, and the other way round.
        """
        pool = await self._get_pool()
        state = await self._runner.run(pool, "fetchval", self.sql.holder, *self._id(key), record.token)
        return "run" if state in (b"p", b"t") else None

    # -- claims whose reply was lost -------------------------------------------------------

    @property
    def pending_orphans(self) -> int:
        """Claims whose reply was lost and that are not yet known to be gone from the table."""
        return len(self._orphans)

    async def _abandon_claim(self, entry: tuple[RecordKey, int]) -> bool:
        key, token = entry
        pool = await self._get_pool()
        args = (*self._id(key), token, self._channel, key.digest)
        if await self._runner.run(pool, "fetchval", self.sql.release, *args) == 1:
            logger.info("idem_asgi: removed an unanswered claim on key %r", key.key)
            return True
        return False

    async def aclose(self) -> None:
        """Stop the sweep and close the pool if `from_dsn` made it (after connections still being handed
        back, and the writes still pending in this process: `on_close`)."""
        await self._before_close()
        await self._claims.aclose()  # batches on the wire: their callers are owed an answer
        await self._completions.aclose()
        await self._orphans.drain()  # claims whose reply was lost: never leave one behind for nothing
        self._closed = self._owned  # a pool of the app's own stays usable; one we made is gone
        await self._orphans.aclose()
        if self._notices is not None:
            await self._notices.aclose()
        await self._runner.drain()
        if self._owned and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()


def _kept(response: StoredResponse, ttl: float) -> tuple[float | None, bytes | None]:
    """(seconds the answer's bytes stay, its tombstone's headers) when they go before the key does
    (`replay_for` under `ttl`), else (None, None): kept as long as the record."""
    keep = response.replay_for
    if keep is None or keep >= ttl or not response.replayable:
        return None, None
    return float(keep), _headers_encode(response.tombstoned().headers)
