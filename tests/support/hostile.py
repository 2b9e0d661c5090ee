"""Shared harness of test_bad_input.py and test_isolation_bounds.py.

- `open_store(name)`: one long-lived backend per store kind, driven from one event loop. Hypothesis
  calls its test function synchronously once per example, so each example's async work goes
  through `Store.run` on one event loop that lives as long as the store: the Redis and
  Postgres pools are opened once and reused by every example.
- `Recorder`: a proxy over a backend that logs every call, proving a refusal cost no store call.
- `contract_key`: the contract's key rule written out again, independently of `idem_asgi.http.keys`.
- `Charge`: a raw ASGI app that counts executions and echoes what it received.
- `status_of`: an answer's status, or None when the client left before any.

Requests go through `tests.support.asgi` (`http_scope(raw_headers=...)`, `drive(messages=...)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.records import RecordKey
from tests.support.asgi import Result, read_body
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require
from tests.support.stores import TEST_TABLE, Delegating, make_backend

T = TypeVar("T")


# --- one store per backend, one event loop ---------------------------------------------------


class Loop:
    """One event loop to run many coroutines on, one after the other (`asyncio.Runner` is 3.11+)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        # the current loop too, as asyncio.Runner does: code that asks for it outside a coroutine
        # must get this one (another test's asyncio.run() leaves None behind)
        asyncio.set_event_loop(self.loop)
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()

            async def drain() -> None:
                await asyncio.gather(*pending, return_exceptions=True)
                await self.loop.shutdown_asyncgens()

            self.loop.run_until_complete(drain())
            self.loop.close()
        finally:
            asyncio.set_event_loop(None)


@dataclass
class Store:
    """A backend, the loop it lives on, and a way to count the records of one namespace."""

    name: str
    runner: Loop
    backend: Backend
    prefix: str = ""
    pg: Any = None  # an asyncpg connection of our own, for counting rows
    namespaces: list[str] = field(default_factory=list)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(coro)

    def namespace(self) -> str:
        """A namespace nobody else uses (other sessions share the servers); purged at the end."""
        ns = f"hostile-{uuid.uuid4().hex}"
        self.namespaces.append(ns)
        return ns

    async def count(self, namespace: str) -> int:
        """How many records the store holds in `namespace`, read from the store itself."""
        if self.name == "memory":
            assert isinstance(self.backend, MemoryBackend)
            return sum(1 for k in self.backend._keys.values() if k.namespace == namespace)
        if self.name == "postgres":
            return int(await self.pg.fetchval(f"SELECT count(*) FROM {TEST_TABLE} WHERE namespace = $1", namespace))
        client = self.backend.client  # type: ignore[attr-defined]
        total = 0
        shape = re.compile(re.escape(self.prefix.encode()) + rb"\{[0-9a-f]{64}\}")
        async for k in client.scan_iter(match=self.prefix + "*", count=1000):
            # whatever the client sent (`*`, `{tag}`, `:`), the Redis key is the prefix and a digest
            assert shape.fullmatch(k), k
            total += await client.hget(k, "n") == namespace.encode()
        return total

    async def _purge(self) -> None:
        if self.name == "postgres" and self.namespaces:
            await self.pg.execute(f"DELETE FROM {TEST_TABLE} WHERE namespace = ANY($1::text[])", self.namespaces)
        elif self.name == "redis":
            client = self.backend.client  # type: ignore[attr-defined]
            keys = [k async for k in client.scan_iter(match=self.prefix + "*", count=1000)]
            for i in range(0, len(keys), 500):
                await client.delete(*keys[i : i + 500])


@contextlib.contextmanager
def open_store(name: str) -> Iterator[Store]:
    """A store of the named kind on its own loop; its records are deleted when the block ends."""
    if name == "redis":
        require("redis", REDIS_URL)
    elif name == "postgres":
        require("postgres", POSTGRES_DSN)
    runner = Loop()
    try:
        store = runner.run(_make(name, runner))
        try:
            yield store
        finally:
            runner.run(store._purge())
            if store.pg is not None:
                runner.run(store.pg.close())
            runner.run(store.backend.aclose())
    finally:
        runner.close()


async def _make(name: str, runner: Loop) -> Store:
    if name == "memory":
        return Store(name, runner, await make_backend("memory"))
    if name == "redis":
        prefix = f"idem-hostile:{uuid.uuid4().hex}:"
        return Store(name, runner, await make_backend("redis", prefix=prefix), prefix=prefix)
    import asyncpg

    backend = await make_backend("postgres", pool=10)
    return Store(name, runner, backend, pg=await asyncpg.connect(POSTGRES_DSN))


# --- a backend proxy that logs every call ----------------------------------------------------


class Recorder(Delegating):
    """Delegates to `inner` and logs each call's name: `calls == []` proves no store round trip."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.calls: list[str] = []

    def before(self, op: str, key: RecordKey) -> RecordKey:
        self.calls.append(op)
        return key

    async def aclose(self) -> None:
        """The inner backend belongs to the store, not to this proxy."""


# --- the contract's key rule, written out again ----------------------------------------------


def contract_key(raw: bytes) -> str | None:
    """The key a header value carries per the contract, or None if it is malformed.

    Surrounding spaces/tabs are not part of the value (HTTP OWS). A value starting with `"` is an
    RFC 8941 sf-string: printable ASCII 0x20-0x7E between the quotes, `"` and `\\` only as the
    escapes `\\"` and `\\\\`. After unquoting: 1 to 255 characters, each 0x21-0x7E.
    """
    v = raw.strip(b" \t")
    if v[:1] == b'"':
        out = bytearray()
        i, closed = 1, False
        while i < len(v):
            c = v[i]
            if c == 0x5C:  # backslash
                if i + 1 >= len(v) or v[i + 1] not in (0x22, 0x5C):
                    return None
                out.append(v[i + 1])
                i += 2
                continue
            if c == 0x22:
                closed = i == len(v) - 1
                if not closed:
                    return None
                break
            if not 0x20 <= c <= 0x7E:
                return None
            out.append(c)
            i += 1
        if not closed:
            return None
        v = bytes(out)
    if not 1 <= len(v) <= 255 or any(not 0x21 <= c <= 0x7E for c in v):
        return None
    return v.decode("ascii")


# --- an app that counts executions -----------------------------------------------------------


class Charge:
    """Counts executions; answers 201 naming the execution, the tenant and the body it got.

    Each execution says `run=<n>`, so a replay (the same n) is told apart from a second run.
    """

    def __init__(self, *, delay: float = 0.0) -> None:
        self.calls = 0
        self.bodies: list[bytes] = []
        self.delay = delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        self.calls += 1
        self.bodies.append(body)
        if self.delay:
            await asyncio.sleep(self.delay)  # long enough for duplicates to arrive while it runs
        tenant = dict(scope["headers"]).get(b"x-tenant", b"-")
        payload = b"run=%d;tenant=%s;sha=%s;body=%s" % (
            self.calls,
            tenant,
            hashlib.sha256(body).hexdigest().encode(),
            body,
        )
        headers = [(b"content-type", b"application/octet-stream"), (b"content-length", b"%d" % len(payload))]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


# --- answers ---------------------------------------------------------------------------------


def status_of(result: Result) -> int | None:
    """The answer's status, or None when nothing was sent (a client that left before the end)."""
    starts = [m for m in result.messages if m["type"] == "http.response.start"]
    assert len(starts) <= 1, result.messages
    return int(starts[0]["status"]) if starts else None
