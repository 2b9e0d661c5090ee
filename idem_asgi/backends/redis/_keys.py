"""Whether a `RedisBackend` prefix's apps keep raw keys in their records, and `idem-asgi migrate`'s rewrite.

Records are named by the key's digest whatever the setting; an app with `store_keys=True` also
keeps the raw scope and key (fields `o`, `k`) so the ops tools can name a stuck claim and a
reconcile resolver can ask the provider by key. Such an app records so under `{prefix}store_keys`
before its first claim, and `migrate` follows that record: it never blanks the names an app
keeps. A key sealed with the deployment's secret (`idem_asgi.sealed_keys`) is not raw: it stays.
A batch re-reads the record after reading its records, so an app that starts while
`migrate` runs stops the rewrite before its names are touched.
"""

from __future__ import annotations

import time
from typing import Any

from ...sealed_keys import is_sealed
from ._scripts import BLANK_NAMES
from ._stale import Scanned, glob_escape


def mark(store: Scanned) -> str:
    """The settings key: outside `{prefix}{<digest>}`, so no scan of records ever meets it."""
    return f"{store.prefix}store_keys"


async def record_raw_keys(store: Scanned) -> None:
    async with store._tool_call():
        await store.client.set(mark(store), repr(time.time()))


async def raw_keys_recorded(store: Scanned) -> float | None:
    async with store._tool_call():
        value = await store.client.get(mark(store))
    return None if value is None else float(value)


async def forget_raw_keys(store: Scanned) -> None:
    async with store._tool_call():
        await store.client.delete(mark(store))


async def hash_stored_keys(store: Scanned, scan_count: int) -> tuple[int, int]:
    """See `RedisBackend.hash_stored_keys`."""
    rewritten = 0
    async with store._tool_call():
        client = store.client
        nodes: list[Any] = list(client.get_primaries()) if store._cluster else [None]
        for node in nodes:
            options: dict[str, Any] = {} if node is None else {"target_nodes": node}
            cursor: Any = 0
            while True:
                cursor, names = await client.scan(
                    cursor, match=glob_escape(store.prefix) + "{*}", count=scan_count, **options
                )
                if isinstance(cursor, dict):
                    cursor = cursor[node.name]
                if names:
                    pipe = client.pipeline(transaction=False) if node is None else client.pipeline()
                    for name in names:
                        pipe.hmget(name, "o", "k")
                    fields = await pipe.execute()
                    raw = [n for n, (o, k) in zip(names, fields, strict=True) if o or (k and not is_sealed(k))]
                    if raw and await client.exists(mark(store)):
                        return rewritten, 0  # an app keeping raw keys started meanwhile: stop
                    if raw:
                        pipe = client.pipeline(transaction=False) if node is None else client.pipeline()
                        for name in raw:
                            # Only where the record still exists: never recreate an expired key.
                            pipe.eval(BLANK_NAMES, 1, name)
                        rewritten += sum(int(r) for r in await pipe.execute())
                if int(cursor) == 0:
                    break
    return rewritten, 0
