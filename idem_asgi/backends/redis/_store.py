"""Redis store: one Lua script per operation, so a claim-or-read is one atomic round trip.

Layout: one hash per record at `{prefix}{<digest>}` (the digest is the hash tag, so a record
never spans Redis Cluster slots and client characters never reach the key); its fields are in
`_scripts`. `n`, `o`, `k` (namespace, scope, key) are read only by `stale()`; a record written by
an idem_asgi version without them is listed with "?" for each. The key's own expiry is the route
TTL, so an in-progress record whose holder died stays visible (and blocks) after its lease ends,
until recovery or the TTL resolves it.

Scripts are idempotent for their caller's token, so a retried command whose reply was lost
cannot turn our own claim into a conflict.

A claim whose reply never came back (timeout, reset, cancellation) may still have landed, or
may land later (a stopped server runs the bytes in its socket buffer when it resumes). Its
caller answered 503 and never ran the app, so the backend remembers such (key, token) pairs
and deletes them in the background, fenced by the token, once Redis answers again. Without
that, a client retrying after a 503 would meet its own ghost claim: 409 until the lease ends,
then `outcome-unknown` until the TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import BackendUnavailable, ConfigurationError, missing_extra
from ...history import Step
from ...records import (
    Claimed,
    ClaimResult,
    Existing,
    Record,
    RecordKey,
    StoredResponse,
    encode_response,
)
from ...sealed_keys import KeySeal
from .._base import ClosingMixin, new_token
from .._orphans import OrphanSweeper
from ._scripts import ABANDON, CLAIM, COMPLETE, EXTEND, FAIL, READ, RELEASE, TAKEOVER, WATCH

try:
    from redis import exceptions as redis_errors
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing_extra("RedisBackend needs redis-py", "redis") from exc

# After the check above: these need redis-py.
from ._connect import Implementation, lean_pool, open_url, refuse_decoding

if TYPE_CHECKING:
    from ._resp import RespPool
from . import _history
from ._durable import durable_ms, run_then_wait
from ._errors import CAUGHT, retried, wrapped
from ._notices import Notices
from ._replies import record
from ._startup import warn_on_eviction, warn_on_replication
from ._tools import CLOSED, Tools

logger = logging.getLogger("idem_asgi")


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


class RedisBackend(Tools, ClosingMixin):
    """Idempotency records in Redis (6.2+, Valkey, Redis Cluster) through redis-py's asyncio client.

    Args:
        client: A `redis.asyncio.Redis` or `RedisCluster` made with `decode_responses=False`.
            It stays yours: `aclose()` closes only a client built by `from_url`. Its own
            timeouts bound every call, so give it a `socket_timeout`. For a plain `Redis`
            (TCP or unix socket, RESP2, password or ACL user; no TLS, credential provider or
            client name) the per-request script calls go through the lean pool `from_url`
            uses, on connections of its own to the same server (at most 256, or the client
            pool's `max_connections` if lower); the client then serves only the ops tools.
        prefix: Prepended to every key, so several apps can share one Redis.
        max_concurrency: At most this many store calls in flight; more wait (up to
            `timeout`) instead of failing. `from_url` sets it for Redis Cluster, whose
            per-node pools raise when full instead of waiting.
        timeout: Longest wait for a `max_concurrency` slot, in seconds.
        durable_replicas: Count a claim, a takeover and a completion only once this many
            replicas have it (`WAIT`, pipelined behind the script on the same connection). A
            claim the replicas do not confirm within `durable_timeout` is withdrawn and the
            request refused with 503 before the app runs; an unconfirmed completion is written
            again in the background (the client has its answer). 0 (the default here, and
            `from_url`'s for `redis://`; 1 for `redis+sentinel://`): Redis' asynchronous
            replication, where a failover can lose acknowledged claims (`check()` logs it when
            the primary has replicas). On a cluster, N replicas of the record's shard.
        durable_timeout: Seconds to wait for the replicas; default half of `timeout`.
        store_keys: Keep the raw scope and key in the record (fields `o`, `k`), for the ops tools
            to display. By default (False) only the namespace is kept beside the digest the key is
            named by: no client key, tenant or user sits in Redis. With True, the backend records
            under `{prefix}store_keys` (before its first claim) that an app keeps them, and
            `idem-asgi migrate` then leaves them; without, it blanks them in records of earlier versions.
        key_secret: Keep the scope and key sealed with this secret in `k` (comma-separated,
            newest first; default `$IDEM_ASGI_KEY_SECRET`), so `stale()` lists claims by key for
            the ops tools holding it while a dump shows none (`idem_asgi.sealed_keys`).
        implementation: Which client serves the per-request script calls. `"auto"` (the default):
            the lean pool where the client allows it (above), redis-py otherwise; `"lean"`: the
            lean pool, and `ConfigurationError` for a client it cannot serve (or without
            hiredis); `"redis-py"`: the client itself, always.
        history: Keep the last `history` steps of each key's history (`idem_asgi.history`) in a
            list beside its record, written in the background (one pipelined round trip per
            batch of keys); 0 (the default): requests write none.
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "idem:",
        max_concurrency: int | None = None,
        timeout: float = 2.0,
        durable_replicas: int = 0,
        durable_timeout: float | None = None,
        store_keys: bool = False,
        key_secret: str | Sequence[str] | None = None,
        implementation: Implementation = "auto",
        history: int = 0,
        _owned: bool = False,
        _lean: RespPool | None = None,
    ) -> None:
        refuse_decoding(client)
        if max_concurrency is not None and max_concurrency < 1:
            raise ConfigurationError(f"max_concurrency must be at least 1, got {max_concurrency!r}")
        if history < 0:
            raise ConfigurationError(f"history must be 0 (none) or more steps, got {history!r}")
        self.client = client
        self.prefix = prefix
        self.timeout = timeout
        self.history = history
        self._owned = _owned
        self._durable_ms = durable_ms(durable_replicas, durable_timeout, timeout)
        self.durable_replicas = durable_replicas
        self.store_keys = store_keys
        self.key_seal = KeySeal.from_setting(key_secret)
        self._raw_recorded = False  # `store_keys=True` recorded under the prefix (once per backend)
        self._sentinel: Any = None  # from_url's Sentinel (redis+sentinel://), closed with the client
        # The lean connection pool (see _connect.py), where there is one, serves the hot script
        # calls; the redis-py client then only serves the tools (stale, SCAN) and connects when they run.
        self._lean = lean_pool(client, implementation, timeout=timeout) if _lean is None else _lean
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        # redis-py's RedisCluster builds its slot map on first use and then recycles every
        # connection; a burst arriving during that start-up sees "Connection closed by server".
        # So the first call initialises the client alone, and the others wait for it.
        self._cluster = hasattr(client, "nodes_manager")
        self._starting = self._cluster
        self._start_lock = asyncio.Lock()
        # Registered once: each call is one EVALSHA; after a SCRIPT FLUSH or on a new node,
        # redis-py (or the lean pool) reloads the script on NOSCRIPT and retries.
        lean = self._lean  # (the pool built here for a user's client too, not only from_url's)
        scripts: Any = lean if lean is not None else client
        register = scripts.script if lean is not None else scripts.register_script
        self._claim = register(CLAIM)
        self._takeover = register(TAKEOVER)
        self._complete = register(COMPLETE)
        self._release = register(RELEASE)
        self._abandon = register(ABANDON)
        self._extend = register(EXTEND)
        self._fail = register(FAIL)
        self._read = register(READ)
        self._watch = register(WATCH)
        self._history = register(_history.APPEND)
        # Where the end of a watched claim is published (not on a cluster: no notices there, repeats poll).
        self._channel: tuple[bytes, ...] = () if self._cluster else (f"{prefix}changed".encode(),)
        self._notices = Notices(client, self._channel[0]) if self._channel else None
        # (redis key, token) -> [give-up time (monotonic), seen absent once]
        self._orphans = OrphanSweeper(self._abandon_claim)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        prefix: str = "idem:",
        max_connections: int = 256,
        timeout: float = 2.0,
        cluster: bool = False,
        implementation: Implementation = "auto",
        **client_options: Any,
    ) -> RedisBackend:
        """Build a backend that owns its client (`redis://`, `rediss://`, `unix://` or
        `redis+sentinel://` URL).

        Args:
            url: Where Redis is; with `cluster=True`, any node of the cluster. For Sentinel,
                `redis+sentinel://[user:password@]host:26379[,host2:26379...]/<service>[/<db>]`:
                the primary of `<service>` is asked of the sentinels at each connect, so the
                backend follows a failover (calls during one answer 503).
            prefix: Prepended to every key.
            max_connections: Pool size. A burst larger than the pool waits for a free
                connection (up to `timeout`) instead of failing.
            timeout: Seconds. Bounds the connect, each command's reply, and the wait for a
                pooled connection. A stalled server fails a call after `timeout`, a down
                server at once (one immediate retry on a fresh connection covers stale
                pooled connections after a restart).
            cluster: Use `redis.asyncio.RedisCluster` (keys hash by their `{digest}` tag).
            implementation: `"auto"`, `"lean"` or `"redis-py"`: which client serves the script
                calls (see the class, and below).
            client_options: Passed to redis-py (`ssl_ca_certs`, `username`, `password`, ...),
                and `durable_replicas` / `durable_timeout` to the backend (see the class). With
                `redis+sentinel://`, `durable_replicas` defaults to 1 (a claim counts once a replica
                has it, so a failover cannot hand it to a retry); opt out with `durable_replicas=0`
                or `?durable_replicas=0` on the URL.

        The URL is parsed by redis-py alone (its rules for the db, credentials and query options).
        The script calls of a `redis://` or `unix://` URL without cluster go through the lean pool
        where `implementation` allows (docs/redis.md, "The lean path"). An option redis-py's
        connections do not take (a typo) raises `ConfigurationError` here, not at the first request.
        """
        opened = open_url(
            url,
            max_connections=max_connections,
            timeout=timeout,
            cluster=cluster,
            implementation=implementation,
            options=client_options,
        )
        backend = cls(
            opened.client,
            prefix=prefix,
            timeout=timeout,
            implementation=implementation,
            _owned=True,
            _lean=opened.lean,
            **opened.backend_options,
        )
        backend._sentinel = opened.sentinel
        return backend

    def _names(self, key: RecordKey) -> tuple[bytes, bytes, bytes]:
        """Namespace, scope and key as kept in the record: the scope and key only with `store_keys`."""
        if self.store_keys and not key.hidden:
            return _utf8(key.namespace), _utf8(key.scope), _utf8(key.key)
        if self.key_seal is not None and not key.hidden:
            return _utf8(key.namespace), b"", self.key_seal.seal(key).encode("ascii")
        return _utf8(key.namespace), b"", b""

    def _key(self, key: RecordKey) -> str:
        return f"{self.prefix}{{{key.digest}}}"

    def _keys(self, key: RecordKey) -> tuple[str, str]:
        """The record and its tombstone (`{prefix}t{<digest>}`: same slot, outside the record scan),
        which keeps a completed key refusing after its answer's own expiry (`replay_for`)."""
        return f"{self.prefix}{{{key.digest}}}", f"{self.prefix}t{{{key.digest}}}"

    async def _call(self, script: Any, name: str | tuple[str, ...], *args: Any) -> Any:
        keys = [name] if isinstance(name, str) else list(name)
        try:
            if self._closed:
                raise BackendUnavailable(CLOSED)
            if self._starting:
                await self._start()
            if self._lean is not None:
                try:
                    return await script(keys=keys, args=args)
                except redis_errors.ConnectionError as exc:
                    if not retried(exc):
                        raise
                    # A restarted server drops the connection. Every script is idempotent for its caller's token.
                    return await script(keys=keys, args=args)
            if self._slots is None:
                return await script(keys=keys, args=args)
            async with self._slot():
                return await script(keys=keys, args=args)
        except CAUGHT as exc:  # DRIVER_ERRORS inline: a `with` costs 0.3 us on every request's calls
            raise wrapped(exc) from exc

    async def write_history(self, batch: Sequence[tuple[RecordKey, float, Sequence[Step]]]) -> None:
        """Append each key's steps to its list (`_history`): one script call per batch of keys."""
        try:
            if self._closed:
                raise BackendUnavailable(CLOSED)
            if self._starting:
                await self._start()
            for keys, args in _history.calls(self.prefix, self.history, batch, per_key=self._cluster):
                async with self._slot():
                    await self._history(keys=keys, args=args)
        except CAUGHT as exc:
            raise wrapped(exc) from exc

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        if self.store_keys and not self._raw_recorded:
            await self.record_raw_keys()  # before the first record with names: `migrate` keeps them
        token = new_token()
        names = self._keys(key)
        name = names[0]
        args = (fingerprint, token, _ms(lease), _ms(ttl), *self._names(key))
        try:
            if self.durable_replicas:
                reply, acked = await self._call_durable(self._claim, names, *args)
            else:
                reply, acked = await self._call(self._claim, names, *args), 0
        except BaseException:
            # No answer, so the caller will not run the app; the claim may still land.
            self._orphans.add((name, token), ttl)
            raise
        if reply[0] == 1:
            if acked < self.durable_replicas:
                await self._withdraw(name, token, ttl, acked)
            return Claimed(token)
        whole = await self._whole(name, reply)
        if whole is None:  # the record changed while its big answer was read: claim again
            return await self.claim(key, fingerprint, lease=lease, ttl=ttl)
        return Existing(record(whole), reply[1] / 1000)

    async def _whole(self, name: str, reply: list[Any]) -> list[Any] | None:
        """`reply` with its answer, which a script leaves out above `APART` bytes (giving its size):
        read alone, on a connection of its own, so a 32 MiB answer never holds up the small replies
        of other requests on the shared one. None when the record changed meanwhile (another token)."""
        if not isinstance(reply[7], int):
            return reply
        async with self._tool_call():
            if self._lean is not None:
                token, blob = await self._lean.execute_alone("HMGET", name, "t", "r")
            else:
                token, blob = await self.client.hmget(name, ["t", "r"])
        if token != reply[4] or blob is None:
            return None
        return [*reply[:7], blob, reply[8]]

    async def _call_durable(self, script: Any, name: str | tuple[str, ...], *args: Any) -> tuple[Any, int]:
        """`_call`, and how many replicas confirmed the write (`WAIT` behind it, same connection)."""
        async with self._tool_call():  # the same mapping, closed check, start and slot as the tools
            wait = ("WAIT", self.durable_replicas, self._durable_ms)
            try:
                return await run_then_wait(self.client, self._lean, script, name, args, wait)
            except redis_errors.ConnectionError as exc:
                if self._lean is None or not retried(exc):
                    raise
                # Once, at once, on a fresh connection, as `_call` does (redis-py retries itself).
                return await run_then_wait(self.client, self._lean, script, name, args, wait)

    async def _withdraw(self, name: str, token: int, ttl: float, acked: int) -> None:
        """A claim the replicas did not confirm: take it back (or leave it to the orphan sweep),
        and refuse the request before the app runs."""
        try:
            await self._call(self._release, name, token, *self._channel)
        except BaseException:
            self._orphans.add((name, token), ttl)
            raise
        raise BackendUnavailable(
            f"redis: {acked} of {self.durable_replicas} replicas confirmed the claim within "
            f"{self._durable_ms} ms; withdrawn, not run"
        )

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        # A takeover whose reply is lost is *not* swept: it may carry a recovered answer
        # (recover hook), and deleting it would let a retry run the operation again. It
        # expires into outcome-unknown, and recovery is asked again.
        if self.store_keys and not self._raw_recorded:
            await self.record_raw_keys()
        token = new_token()
        name = self._key(key)
        args = (stale_token, fingerprint, token, _ms(lease), _ms(ttl), *self._names(key))
        if self.durable_replicas:
            reply, acked = await self._call_durable(self._takeover, name, *args)
        else:
            reply, acked = await self._call(self._takeover, name, *args), 0
        if reply[0] == 1:
            if acked < self.durable_replicas:
                # Not withdrawn: the record it replaced is gone, and a lost takeover expires into
                # outcome-unknown (see above). The app does not run.
                raise BackendUnavailable(
                    f"redis: {acked} of {self.durable_replicas} replicas confirmed the takeover within "
                    f"{self._durable_ms} ms; not run"
                )
            return Claimed(token)
        if reply[0] == 2:
            return None  # gone (released, completed and expired, or past its TTL): nothing to take over
        whole = await self._whole(name, reply)
        if whole is None:  # changed while its big answer was read: judge the new record
            return await self.takeover(key, stale_token, fingerprint, lease=lease, ttl=ttl)
        return Existing(record(whole), reply[1] / 1000)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        blob = encode_response(response)
        keep = response.replay_for
        if keep is not None and keep < ttl and response.replayable:  # the bytes go first; the tombstone refuses on
            shorter: tuple[Any, ...] = (encode_response(response.tombstoned()), _ms(keep))
        else:
            shorter = (b"", 0)
        args = (token, blob, _ms(ttl), *shorter, *self._channel)
        if not self.durable_replicas:
            return bool(await self._call(self._complete, self._keys(key), *args))
        stored, acked = await self._call_durable(self._complete, self._keys(key), *args)
        if stored and acked < self.durable_replicas:
            # Written on the primary only: raise, so the middleware writes it again in the
            # background until the replicas confirm it (the script rewrites a completed record
            # of the same token, so each WAIT covers it).
            raise BackendUnavailable(
                f"redis: {acked} of {self.durable_replicas} replicas confirmed the completion within "
                f"{self._durable_ms} ms"
            )
        return bool(stored)

    async def release(self, key: RecordKey, token: int) -> bool:
        return bool(await self._call(self._release, self._key(key), token, *self._channel))

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        return bool(await self._call(self._extend, self._key(key), token, _ms(lease)))

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        return bool(await self._call(self._fail, self._key(key), token, *self._channel))

    async def watch(self, key: RecordKey, token: int, on_change: Callable[[str | None], None]) -> bool | None:
        """Ask to be told (`on_change(digest)`) when the claim `token` on `key` ends in any process
        (`on_change(None)`: notices were interrupted, any claim may have ended unseen).

        True: still held, and its end will be told; False: it changed already (read it again);
        None: no notices from this store (a cluster, or the channel is refused): poll instead.
        A held repeat on a `wait=` route in another process than the holder uses this, so it makes
        three store calls however long the holder runs (claim, watch, the claim that replays).
        """
        if self._notices is None or not await self._notices.listen(on_change, self.timeout):
            return None
        return bool(await self._call(self._watch, self._key(key), token))

    async def check(self) -> None:
        """Claim and release a throwaway key: proves the credentials, the database and the script
        rights (and, with `durable_replicas`, that replicas confirm it). Then warn (once, in the
        log) when Redis may evict records before their TTL, and when a failover can cost claims
        (the primary has replicas, claims are not durable)."""
        probe = RecordKey.build("idem-asgi-check", None, f"check-{new_token()}")
        result = await self.claim(probe, b"check", lease=5.0, ttl=5.0)
        if isinstance(result, Claimed):
            await self.release(probe, result.token)
        await warn_on_eviction(self.client, self._cluster, self.timeout)
        if not self._cluster:
            await warn_on_replication(self.client, self.durable_replicas, self.timeout)

    async def get(self, key: RecordKey) -> Record | None:
        names = self._keys(key)
        name = names[0]
        reply = await self._call(self._read, names)
        if reply[0] != 1:
            return None
        whole = await self._whole(name, reply)
        return record(whole) if whole is not None else await self.get(key)

    # -- claims whose reply was lost -------------------------------------------------------

    @property
    def pending_orphans(self) -> int:
        """Claims whose reply was lost and that are not yet known to be gone from Redis."""
        return len(self._orphans)

    async def _abandon_claim(self, entry: tuple[str, int]) -> bool:
        name, token = entry
        reply = await self._call(self._abandon, name, token)
        if reply == 1:
            logger.info("idem_asgi: removed an unanswered claim on %s", name)
        return bool(reply != 0)  # 0: not there (yet?); 1 deleted; -1 someone else's now

    async def aclose(self) -> None:
        """Stop the background sweep and close the client if `from_url` made it. Every call after
        this fails with `BackendUnavailable` at once: nothing reconnects a closed backend (a late
        write still being retried would otherwise open connections nobody closes), once the writes
        still pending in this process have landed or given up (`on_close`)."""
        await self._before_close()
        await self._orphans.drain()  # claims whose reply was lost: never leave one behind for nothing
        self._closed = True
        await self._orphans.aclose()
        if self._notices is not None:
            await self._notices.aclose()
        if self._lean is not None:
            await self._lean.aclose()
        if self._owned:
            await self.client.aclose()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                await sentinel.aclose()
