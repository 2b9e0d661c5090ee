"""`RedisBackend.stale()`: a SCAN over the backend's keys (every primary of a cluster), read in
pipelined batches, for the ops tools; never on a request's path."""

from __future__ import annotations

import re
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, Protocol

from ...records import IN_PROGRESS, Record, RecordKey, StaleRecord
from ...sealed_keys import KeySeal, is_sealed, opened


class Scanned(Protocol):
    """What the ops tools read of a `RedisBackend`: passed in by the store, so they never import it."""

    client: Any
    prefix: str
    _cluster: bool
    key_seal: KeySeal | None

    def _tool_call(self) -> AbstractAsyncContextManager[None]: ...


_STALE_FIELDS: Final = ("s", "f", "t", "l", "e", "n", "o", "k", "x")
_DIGEST: Final = re.compile(rb"[0-9a-f]{64}")


def _text(raw: bytes | None) -> str:
    return "?" if raw is None else raw.decode("utf-8", "surrogateescape")


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def scan_stale(
    store: Scanned, older_than: float, limit: int, namespace: str | None, scan_count: int
) -> list[StaleRecord]:
    """See `RedisBackend.stale`."""
    client = store.client
    pattern = glob_escape(store.prefix) + "{*}"
    skip = len(store.prefix.encode("utf-8", "surrogateescape")) + 1
    found: list[StaleRecord] = []
    async with store._tool_call():
        nodes: list[Any] = list(client.get_primaries()) if store._cluster else [None]
        for node in nodes:
            cursor: Any = 0
            while len(found) < limit:
                if node is None:
                    cursor, names = await client.scan(cursor, match=pattern, count=scan_count, _type="hash")
                else:
                    cursor, names = await client.scan(
                        cursor, match=pattern, count=scan_count, _type="hash", target_nodes=node
                    )
                    if isinstance(cursor, dict):
                        cursor = cursor[node.name]
                names = [n for n in names if _DIGEST.fullmatch(n, skip, len(n) - 1)]
                if names:
                    found += _stale(
                        names, await _read(client, node, names), skip, older_than, namespace, store.key_seal
                    )
                if int(cursor) == 0:
                    break
    found.sort(key=lambda s: s.record.lease_until)
    return found[:limit]


async def _read(client: Any, node: Any, names: list[bytes]) -> list[Any]:
    """`TIME` and one `HMGET` per key, in one pipelined round trip (to `node` on a cluster)."""
    pipe = client.pipeline(transaction=False) if node is None else client.pipeline()
    async with pipe:
        if node is None:
            pipe.time()
        else:
            pipe.execute_command("TIME", target_nodes=node)
        for name in names:
            pipe.hmget(name, *_STALE_FIELDS)
        return list(await pipe.execute())


def _stale(
    names: list[bytes],
    replies: list[Any],
    skip: int,
    older_than: float,
    namespace: str | None,
    seal: KeySeal | None,
) -> list[StaleRecord]:
    """The in-progress records among `replies` whose lease ended `older_than` seconds before Redis's `TIME`."""
    seconds, micros = replies[0]
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    cutoff_ms = now_ms - older_than * 1000
    found = []
    for name, (state, fingerprint, token, lease_until, expires_at, ns, scope, key, ttl) in zip(
        names, replies[1:], strict=True
    ):
        if state not in (b"p", b"u") or token is None or lease_until is None or expires_at is None:
            continue
        if int(lease_until) > cutoff_ms or int(expires_at) <= now_ms:
            continue
        if namespace is not None and (ns is None or _text(ns) != namespace):
            continue
        digest = name[skip:-1].decode("ascii")
        record = Record(
            IN_PROGRESS,
            fingerprint,
            int(token),
            int(lease_until) / 1000,
            int(expires_at) / 1000,
            holder_failed=state == b"u",
            ttl=None if ttl is None else int(ttl) / 1000,
        )
        # An empty key: the record keeps only its digest (no raw key is ever empty); or it is sealed.
        if key == b"" or is_sealed(key):
            rkey = opened(seal, _text(ns), digest, _text(key))
        else:
            rkey = RecordKey(_text(ns), _text(scope), _text(key), digest)
        found.append(StaleRecord(rkey, record))
    return found
