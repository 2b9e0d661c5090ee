"""A stateful model of the idempotency contract, checked against the real middleware over real stores.

Issue #8, item 6. Hypothesis drives a `RuleBasedStateMachine` whose rules are things that happen
to a deployment: a request arrives (`send`), a client retries an earlier request (`retry`), n
identical requests arrive at once (`burst`), a held handler finishes with some outcome
(`finish`), the worker running a held handler dies or has its task cancelled (`crash`), the
store's clock jumps past the lease or the TTL (`advance_clock`), a held worker stalls past its
lease while its client retries and then wakes up (`stall`), and the store client is replaced
(`restart_store`). Each request runs through a real `IdempotencyMiddleware` over a real store
(memory, Redis, Postgres). The model predicts every answer from the contract alone, and the
machine checks each answer as it arrives, invariants after every step, and at the end of each
example (every held handler finished, then every key probed in both scopes):

- at most one execution per (scope, key, epoch): the handler counts its executions in a ledger
  outside the middleware, and the ledger must equal the number of epochs the model opened. A new
  epoch opens only where the contract allows a re-execution: a new key, the TTL over, `reclaim`
  after the lease, the claim released after a 5xx or an exception, a memory store restarted;
- every replay is byte-identical (status, headers in order, body) to the first stored answer,
  plus `Idempotent-Replayed: true`; a first answer never carries that header and is exactly what
  the handler sent (a raise after the first chunk: that chunk, then the exception);
- the same key with another operation (route or body) is 422 while the first is stored or in
  flight; a repeat of a live operation is 409 `request-in-progress` with Retry-After; an expired
  lease under `block` is 409 `outcome-unknown` until the TTL; every refusal is `no-store`;
- a stale owner (its lease expired and another request took the key over) gets its own answer
  to its own client, and neither its answer nor its release reaches the store;
- no answer carries bytes from another scope: both scopes send identical requests (same key,
  same body), and every answer is tagged with the scope, key, route and payload it was made for.

How the faults are made:
- *Workers.* A request told to hold gets its own middleware instance (its worker) over a
  `WorkerStore` proxy in front of the shared backend instance, so that worker can die alone;
  the other requests share one worker.
- *crash(op), kill.* The op's handler is held after its effect (the ledger already counts it),
  before its answer started or after the first body chunk went out. Its proxy goes dead (every
  later store call raises, and is counted: there must be none) and its task is cancelled, so no
  code of that worker reaches the store again, as after a SIGKILL: the claim stays in progress
  until its lease ends. *cancel*: the task is cancelled with the store still reachable (a server
  shutting down); the middleware must keep the claim all the same, since the effect may have run.
- *advance_clock.* Leases and TTLs are judged by the store's clock. Memory gets an injected fake
  clock. Redis and Postgres take their time from the server (`TIME`, `now()`) and offer no way to
  set it, so the test moves every record of the example back in time instead (lease deadline,
  expiry and, on Redis, the key's own PTTL), which is exactly what a jump of the server clock
  does to them. Lease and TTL are long (1,000 s and 10,000 s) and the jumps (1,370 s, 11,000 s)
  keep every deadline hundreds of seconds away from the model's clock, so real elapsed time
  never matters, and the middleware's renewal timer (every lease/3 = 333 s) never fires: a held
  handler whose lease the clock jumped past is a stalled owner, not a renewed one.
- *restart_store.* A new backend instance over the same data (Redis, Postgres: records survive;
  old workers finish through the instance they started with) or a new, empty `MemoryBackend`
  (memory: records are lost by definition, so the model forgets every key and opens new epochs).

One difference between stores is modelled, not hidden: a handler still running when its
in-progress record passes its TTL has its completion refused on memory and Redis (the record is
gone) but accepted on Postgres (the row stays, free for the next claim, under the holder's token
until someone claims it). Both keep at-most-once; see `_finished`.

Settings: `IDEM_MODEL_EXAMPLES` (default 100) and `IDEM_MODEL_STEPS` (default 25) per backend;
examples are derandomized (reproducible in CI) unless `IDEM_MODEL_RANDOM=1`. Each run prints one
`MODEL` line per backend with what was exercised. `test_model_has_teeth` runs the same machine
over deliberately broken stores and configurations and requires each to be caught.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.claims import leases, runtime
from idem_asgi.errors import BackendUnavailable
from idem_asgi.http.keys import scope_from_header
from idem_asgi.http.problems import slug_of
from idem_asgi.records import IN_PROGRESS, Claimed, ClaimResult, RecordKey, StoredResponse
from tests.support.asgi import Result, drive, http_scope, read_body
from tests.support.scorecard import report
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require
from tests.support.stores import BACKENDS, Delegating

T = TypeVar("T")

LEASE: Final = 1_000.0
TTL: Final = 10_000.0
JUMPS: Final = {"past_lease": 1_370.0, "past_ttl": 11_000.0}
EPOCH0: Final = 1_700_000_000.0  # the memory store's fake clock at T = 0
SCOPES: Final = ("alpha", "beta")
# (key, route): "blk" is only ever sent to the `block` route, "rcl" to the `reclaim` one, and "mix"
# to both (the same key for another operation: 422).
TARGETS: Final = (("blk", "/block"), ("rcl", "/reclaim"), ("mix", "/block"), ("mix", "/reclaim"))
PAYLOADS: Final = ("p1", "p1", "p2")  # p1 twice: repeats of one operation are likelier than a new body
MODES: Final = ("ok", "bad", "fail", "raise", "raise_mid")
STORED: Final = frozenset({"ok", "bad"})  # outcomes whose answer is stored (201, 402); the rest release
STATUS: Final = {"ok": 201, "bad": 402, "fail": 500, "raise_mid": 201}
REPLAYED: Final = (b"idempotent-replayed", b"true")
SETTLE_TIMEOUT: Final = 10.0

EXAMPLES = int(os.environ.get("IDEM_MODEL_EXAMPLES", "100"))
STEPS = int(os.environ.get("IDEM_MODEL_STEPS", "25"))
DERANDOMIZE = os.environ.get("IDEM_MODEL_RANDOM", "") not in ("1", "true", "yes")

SUMMARY: dict[str, Counter[str]] = {}
"""What each backend's run exercised (steps per rule, answers per kind), printed after the run."""


class ModelViolation(AssertionError):
    """The real system did something the contract (as modelled here) does not allow."""


def check(condition: object, message: str) -> None:
    if not condition:
        raise ModelViolation(message)


class Boom(Exception):
    """What a handler raises when told to."""


# --- the store proxy: one worker's view of the shared store -----------------------------------


class WorkerStore(Delegating):
    """One worker's store: the shared backend, until the worker dies (then every call raises).

    `mutant` breaks it on purpose, for `test_model_has_teeth`.
    """

    def __init__(self, inner: Backend, counters: Counter[str], mutant: str | None = None) -> None:
        super().__init__(inner)
        self.dead = False
        self.counters = counters
        self.mutant = mutant

    def before(self, op: str, key: RecordKey) -> RecordKey:
        if self.dead:
            self.counters["calls_from_dead_workers"] += 1
            raise BackendUnavailable("this worker crashed")
        if self.mutant == "unscoped":
            return RecordKey.build(key.namespace, None, key.key)
        return key

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        result = await super().claim(key, fingerprint, lease=lease, ttl=ttl)
        if self.mutant == "claim_always_wins" and not isinstance(result, Claimed):
            return Claimed(random.getrandbits(62) + 1)
        return result

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        key = self.before("complete", key)
        if self.mutant == "drop_complete":
            return True
        if self.mutant == "complete_unfenced":
            token = await self._holder(key, token)
        return await self.inner.complete(key, token, response, ttl=ttl)

    async def release(self, key: RecordKey, token: int) -> bool:
        key = self.before("release", key)
        if self.mutant == "release_noop":
            return True
        if self.mutant == "release_unfenced":
            token = await self._holder(key, token)
        return await self.inner.release(key, token)

    async def _holder(self, key: RecordKey, token: int) -> int:
        """The token of whoever holds the key now (a store that does not fence writes by token)."""
        record = await self.inner.get(key)
        return record.token if record is not None and record.state == IN_PROGRESS else token

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        if self.dead:
            # A cancelled request whose answer had started ends its lease at once: the one call a
            # cancellation makes. A killed worker runs no code, so its store never sees it.
            raise BackendUnavailable("this worker crashed")
        return await super().mark_failed(key, token)

    async def aclose(self) -> None:
        """The shared backend is closed by the harness, not by a worker."""


# --- what the model knows ----------------------------------------------------------------------

Answer = tuple[int, tuple[tuple[bytes, bytes], ...], bytes]
RKey = tuple[str, str]  # (scope, key)
Fingerprint = tuple[str, str]  # (route, payload): what makes two requests the same operation here


@dataclass(eq=False)
class Op:
    """One request, from arrival to answer (or to its worker's death)."""

    id: int
    scope: str
    key: str
    path: str
    payload: str
    mode: str  # ok | bad | fail | raise | raise_mid | hold | hold_mid
    gen: int
    store: WorkerStore
    result: Result = field(default_factory=Result)
    task: asyncio.Task[None] | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: str = "ok"
    execution: int = 0  # this op's number in its key's ledger; 0 while its handler never ran
    state: str = "running"  # running | held | done | crashed
    boom: bool = False

    @property
    def rkey(self) -> RKey:
        return (self.scope, self.key)

    @property
    def fp(self) -> Fingerprint:
        return (self.path, self.payload)

    @property
    def body(self) -> bytes:
        # Identical for both scopes: a store that ignored the scope would replay the other
        # scope's answer instead of answering 422, the worst leak there is.
        return f'{{"op":"charge","payload":"{self.payload}"}}'.encode()

    def __repr__(self) -> str:
        return f"Op#{self.id}({self.scope}/{self.key} {self.path} {self.payload} {self.mode} {self.state})"


@dataclass(eq=False)
class Rec:
    """The model's record for one (scope, key) of the current store generation."""

    fp: Fingerprint
    owner: Op | None  # the op holding the claim while in progress
    answer: Answer | None  # the stored answer once completed
    lease_until: float
    expires_at: float
    failed: bool = False  # its holder failed mid-answer: outcome-unknown at once, never reclaimed


def app_answer(op: Op, execution: int, outcome: str) -> tuple[int, list[tuple[bytes, bytes]], list[bytes]]:
    """What the handler sends for `op` in its `execution`-th run with `outcome`: status, headers, chunks."""
    status = STATUS.get(outcome, 201)
    body = (
        f"scope={op.scope};key={op.key};route={op.path};payload={op.payload};"
        f"exec={execution};op={op.id};status={status}"
    ).encode()
    headers = [
        (b"content-type", b"text/plain"),
        (b"x-scope", op.scope.encode()),
        (b"x-exec", str(execution).encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    return status, headers, [body[:20], body[20:]]


def answer_of(result: Result) -> Answer | None:
    if not any(m["type"] == "http.response.start" for m in result.messages):
        return None
    return result.status, tuple(result.headers), result.body


# --- the per-backend harness -------------------------------------------------------------------


class Harness:
    """What lives for one test function: the event loop, and the servers' shared clients."""

    TABLE: Final = "idem_model_records"

    def __init__(self, kind: str, mutant: str | None = None) -> None:
        self.kind = kind
        self.mutant = mutant
        self.loop = asyncio.new_event_loop()
        self.pool: Any = None  # asyncpg pool (postgres)
        self.redis: Any = None  # redis-py client for clock jumps and cleanup (redis)
        self.counters: Counter[str] = Counter()

    async def start(self) -> None:
        if self.kind == "redis":
            import redis.asyncio as aioredis

            self.redis = aioredis.Redis.from_url(REDIS_URL, decode_responses=False)
            await self.redis.ping()
        elif self.kind == "postgres":
            import asyncpg

            from idem_asgi.backends.postgres import PostgresBackend

            self.pool = await asyncpg.create_pool(
                POSTGRES_DSN,
                min_size=1,
                max_size=10,
                server_settings={"default_transaction_isolation": "read committed"},
            )
            await PostgresBackend(self.pool, table=self.TABLE).setup()

    async def stop(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
        if self.pool is not None:
            await self.pool.close()

    def new_backend(self, prefix: str, clock: list[float]) -> Backend:
        if self.kind == "memory":
            return MemoryBackend(clock=lambda: clock[0])
        if self.kind == "redis":
            from idem_asgi.backends.redis import RedisBackend

            return RedisBackend.from_url(REDIS_URL, prefix=prefix)
        from idem_asgi.backends.postgres import PostgresBackend

        return PostgresBackend(self.pool, table=self.TABLE)

    async def jump(self, prefix: str, namespace: str, seconds: float) -> None:
        """Move the store's clock `seconds` forward for this example's records (Redis, Postgres)."""
        if self.kind == "redis":
            names = [n async for n in self.redis.scan_iter(match=prefix + "*", count=500)]
            if names:
                await self.redis.eval(_REDIS_JUMP, len(names), *names, round(seconds * 1000))
        elif self.kind == "postgres":
            await self.pool.execute(
                f"UPDATE {self.TABLE} SET lease_until = lease_until - $2::float8 * interval '1 second', "
                "expires_at = expires_at - $2::float8 * interval '1 second' WHERE namespace = $1",
                namespace,
                seconds,
            )

    async def wipe(self, prefix: str, namespace: str) -> None:
        if self.kind == "redis":
            names = [n async for n in self.redis.scan_iter(match=prefix + "*", count=500)]
            if names:
                await self.redis.delete(*names)
        elif self.kind == "postgres":
            await self.pool.execute(f"DELETE FROM {self.TABLE} WHERE namespace = $1", namespace)


# Every record of the example, as seen after the Redis clock moved ARGV[1] ms forward: deadlines
# (`l` lease, `e` expiry) earlier by that much, and the key's own expiry (the record's TTL) too.
_REDIS_JUMP: Final = """
local d = tonumber(ARGV[1])
for _, name in ipairs(KEYS) do
  local pttl = redis.call('PTTL', name)
  if pttl > 0 and pttl <= d then
    redis.call('DEL', name)
  elseif pttl > 0 then
    local l, e = unpack(redis.call('HMGET', name, 'l', 'e'))
    if l then redis.call('HSET', name, 'l', tonumber(l) - d) end
    if e then redis.call('HSET', name, 'e', tonumber(e) - d) end
    redis.call('PEXPIRE', name, pttl - d)
  end
end
return 1
"""


# --- the machine -------------------------------------------------------------------------------


class IdempotencyModel(RuleBasedStateMachine):
    """The contract as a state machine, checked step by step against the real middleware."""

    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.h = harness
        self.kind = harness.kind
        self.loop = harness.loop
        self.c = harness.counters
        self.c["examples"] += 1
        self.broken = False
        self.namespace = f"model-{uuid.uuid4().hex}"
        self.prefix = f"idem-model:{uuid.uuid4().hex}:"
        self.now = 0.0  # the model's clock (seconds since the example began, store time)
        self.clock = [EPOCH0]  # the memory store's clock
        self.gen = 0  # store generation: a memory restart loses every record
        self.backend = harness.new_backend(self.prefix, self.clock)
        self.backends: list[Backend] = [self.backend]
        self.records: dict[RKey, Rec] = {}
        self.epochs: Counter[RKey] = Counter()  # executions the contract allowed so far
        self.ledger: Counter[RKey] = Counter()  # executions that happened (counted by the handler)
        self.ops: dict[int, Op] = {}
        self.next_id = 1
        self.restarts = 0
        block: Literal["block", "reclaim"] = "reclaim" if harness.mutant == "block_reclaims" else "block"
        self.routes = [
            RoutePolicy("/block", methods=["POST"], ttl=TTL, lease=LEASE, on_expired=block),
            RoutePolicy("/reclaim", methods=["POST"], ttl=TTL, lease=LEASE, on_expired="reclaim"),
        ]
        self.policy = {"/block": "block", "/reclaim": "reclaim"}
        store = WorkerStore(self.backend, self.c, harness.mutant)
        self.shared = (store, self.worker(store))  # the worker of every request that will not hold

    # -- plumbing --

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self.loop.run_until_complete(asyncio.wait_for(coro, 60))
        except BaseException:
            self.broken = True
            raise

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The protected handler: counts its execution (the effect), then answers as its op says."""
        body = await read_body(receive)
        headers = dict(scope["headers"])
        op = self.ops[int(headers[b"x-op"])]
        tenant, key = headers[b"x-tenant"].decode(), headers[b"idempotency-key"].decode()
        info = current_idempotency()
        check(
            info is not None and info.key == key and info.scope == tenant,
            f"{op}: handler told key/scope {info!r}",
        )
        check(body == op.body, f"{op}: handler got body {body!r}")
        self.ledger[(tenant, key)] += 1
        op.execution = self.ledger[(tenant, key)]
        self.c["executions"] += 1
        outcome = op.mode
        if outcome == "hold":
            op.entered.set()
            await op.release.wait()
            outcome = op.outcome
        status, head, chunks = app_answer(op, op.execution, outcome)
        if outcome == "raise":
            raise Boom
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": chunks[0], "more_body": True})
        if outcome == "hold_mid":
            op.entered.set()
            await op.release.wait()
            outcome = op.outcome  # ok | raise_mid: its 201 and first chunk are out
        if outcome == "raise_mid":
            raise Boom
        await send({"type": "http.response.body", "body": chunks[1], "more_body": False})

    def worker(self, store: WorkerStore) -> IdempotencyMiddleware:
        return IdempotencyMiddleware(
            self.app, backend=store, routes=self.routes, scope=scope_from_header("x-tenant"), namespace=self.namespace
        )

    async def serve(self, op: Op) -> None:
        headers = [("x-tenant", op.scope), ("x-op", str(op.id))]
        scope = http_scope("POST", op.path, key=op.key, headers=headers)
        # A request told to hold may be crashed later: it gets a worker of its own. The others share one.
        mw = self.shared[1] if op.store is self.shared[0] else self.worker(op.store)
        try:
            await drive(mw, scope, [op.body[:7], op.body[7:]], result=op.result)
        except Boom:
            op.boom = True

    def new_op(self, scope: str, key: str, path: str, payload: str, mode: str) -> Op:
        held = mode in ("hold", "hold_mid")
        store = WorkerStore(self.backend, self.c, self.h.mutant) if held else self.shared[0]
        op = Op(self.next_id, scope, key, path, payload, mode, self.gen, store)
        self.ops[op.id] = op
        self.next_id += 1
        self.c["requests"] += 1
        return op

    async def settle(self, ops: list[Op], *, answered: bool = False) -> None:
        """Wait until each op has its answer, or (unless `answered`) its handler is held."""
        for op in ops:
            assert op.task is not None
            entered = asyncio.ensure_future(asyncio.Event().wait() if answered else op.entered.wait())
            try:
                await asyncio.wait({op.task, entered}, timeout=SETTLE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            finally:
                entered.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await entered
            if op.task.done():
                op.task.result()  # anything but Boom escaping the middleware is a failure
                op.state = "done"
            else:
                check(op.entered.is_set(), f"{op}: neither answered nor held after {SETTLE_TIMEOUT}s")
                op.state = "held"

    def held(self) -> list[Op]:
        return [op for op in self.ops.values() if op.state == "held"]

    # -- the oracle --

    def expect(self, rkey: RKey, fp: Fingerprint) -> str:
        """What the contract says a request gets: run | replay | mismatch | busy | unknown."""
        rec = self.records.get(rkey)
        if rec is None or rec.expires_at <= self.now:
            return "run"
        if rec.fp != fp:
            return "mismatch"
        if rec.answer is not None:
            return "replay"
        if rec.failed:
            return "unknown"  # the answer had started: the operation may have happened, never run again
        if self.now < rec.lease_until:
            return "busy"
        return "run" if self.policy[fp[0]] == "reclaim" else "unknown"

    def check_common(self, op: Op) -> None:
        """Every answer: no other scope's bytes, and an app answer is about this very request."""
        answer = answer_of(op.result)
        if answer is None:
            return
        _status, headers, body = answer
        for other in SCOPES:
            if other != op.scope:
                check(f"scope={other}".encode() not in body, f"{op}: answer carries scope {other}'s bytes: {body!r}")
                check((b"x-scope", other.encode()) not in headers, f"{op}: answer carries scope {other}'s header")
        if dict(headers).get(b"content-type") == b"text/plain":
            tag = f"scope={op.scope};key={op.key};route={op.path};payload={op.payload};".encode()
            check(body.startswith(tag[: len(body)]), f"{op}: answer is about another request: {body!r}")

    def check_first(self, op: Op, outcome: str) -> None:
        """The client of an execution got exactly what its handler sent, unmarked."""
        check(op.execution > 0, f"{op}: expected its handler to run")
        status, headers, chunks = app_answer(op, op.execution, outcome)
        types = [m["type"] for m in op.result.messages]
        if outcome == "raise":
            check(op.boom and not types, f"{op}: a handler that raised at once: got {types}")
            self.c["raised"] += 1
            return
        answer = answer_of(op.result)
        check(answer is not None, f"{op}: no answer")
        assert answer is not None
        if outcome == "raise_mid":
            check(op.boom, f"{op}: the handler's exception did not reach the server")
            check(answer == (status, tuple(headers), chunks[0]), f"{op}: partial answer {answer!r}")
            self.c["raised"] += 1
            return
        check(not op.boom, f"{op}: unexpected exception")
        check(REPLAYED not in answer[1], f"{op}: a first answer marked as a replay")
        check(answer == (status, tuple(headers), b"".join(chunks)), f"{op}: first answer {answer!r}")
        self.c["app_5xx" if status >= 500 else f"first_{status}"] += 1

    def check_refused(self, op: Op, expected: str) -> None:
        check(op.execution == 0, f"{op}: expected {expected}, but the handler ran (execution {op.execution})")
        answer = answer_of(op.result)
        check(answer is not None and not op.boom, f"{op}: expected {expected}, got no answer")
        assert answer is not None
        status, headers, body = answer
        h = dict(headers)
        slug, code = {
            "mismatch": ("fingerprint-mismatch", 422),
            "busy": ("request-in-progress", 409),
            "unknown": ("outcome-unknown", 409),
        }[expected]
        kind = ""
        if h.get(b"content-type") == b"application/problem+json":
            kind = slug_of(str(json.loads(body).get("type", ""))) or ""
        check((status, kind) == (code, slug), f"{op}: expected {code} {slug}, got {status} {kind or body[:80]!r}")
        check(h.get(b"cache-control") == b"no-store", f"{op}: a refusal without Cache-Control: no-store")
        if expected == "busy":
            check(b"retry-after" in h, f"{op}: 409 in progress without Retry-After")
        self.c[{"mismatch": "422", "busy": "409_in_progress", "unknown": "409_outcome_unknown"}[expected]] += 1

    def check_replay(self, op: Op, stored: Answer) -> None:
        check(op.execution == 0, f"{op}: expected a replay, but the handler ran (execution {op.execution})")
        answer = answer_of(op.result)
        check(answer is not None and not op.boom, f"{op}: expected a replay, got no answer")
        assert answer is not None
        status, headers, body = stored
        check(
            answer == (status, (*headers, REPLAYED), body),
            f"{op}: replay differs from the first stored answer:\n  got  {answer!r}\n  want {stored!r}",
        )
        self.c["replays"] += 1

    def stored_answer(self, op: Op, outcome: str) -> Answer:
        status, headers, chunks = app_answer(op, op.execution, outcome)
        return status, tuple(headers), b"".join(chunks)

    def ran(self, op: Op, fp: Fingerprint) -> None:
        """`op` was allowed a new execution and took it: open the epoch and record what it left."""
        rkey = op.rkey
        self.epochs[rkey] += 1
        check(
            op.execution == self.epochs[rkey], f"{op}: execution {op.execution}, the model allowed {self.epochs[rkey]}"
        )
        if op.state == "held":
            check(op.mode in ("hold", "hold_mid"), f"{op}: held though not told to")
            self.records[rkey] = Rec(fp, op, None, self.now + LEASE, self.now + TTL)
            self.c["held"] += 1
            return
        check(op.mode not in ("hold", "hold_mid"), f"{op}: was to hold but answered")
        self.check_first(op, op.mode)
        if op.mode in STORED:
            self.records[rkey] = Rec(fp, None, self.stored_answer(op, op.mode), self.now, self.now + TTL)
        elif op.mode == "raise_mid":
            self.records[rkey] = Rec(fp, None, None, self.now, self.now + TTL, failed=True)
        else:
            self.records.pop(rkey, None)

    def refused(self, op: Op, expected: str) -> None:
        check(op.state == "done", f"{op}: expected {expected} at once")
        if expected == "replay":
            rec = self.records[op.rkey]
            assert rec.answer is not None
            self.check_replay(op, rec.answer)
        else:
            self.check_refused(op, expected)

    # -- rules --

    @rule(
        scope=st.sampled_from(SCOPES),
        where=st.sampled_from(TARGETS),
        payload=st.sampled_from(PAYLOADS),
        mode=st.sampled_from((*MODES, "hold", "hold", "hold_mid")),
    )
    def send(self, scope: str, where: tuple[str, str], payload: str, mode: str) -> None:
        self.c["rule_send"] += 1
        self.run(self._send(scope, where[0], where[1], payload, mode))

    async def _send(self, scope: str, key: str, path: str, payload: str, mode: str) -> Op:
        fp = (path, payload)
        expected = self.expect((scope, key), fp)
        previous = self.records.get((scope, key))
        op = self.new_op(scope, key, path, payload, mode)
        op.task = self.loop.create_task(self.serve(op))
        await self.settle([op])
        self.check_common(op)
        if expected == "run":
            if previous is not None and previous.expires_at > self.now:
                self.c["reclaims"] += 1  # the contract's reclaim: an expired lease on a `reclaim` route
            self.ran(op, fp)
        else:
            self.refused(op, expected)
        return op

    @precondition(lambda self: bool(self.ops))
    @rule(pick=st.integers(0, 15), mode=st.sampled_from((*MODES, "hold", "hold_mid")))
    def retry(self, pick: int, mode: str) -> None:
        """A client retries one of the requests sent so far, preferably one whose worker is held or dead."""
        self.c["rule_retry"] += 1
        ops = [op for op in self.ops.values() if op.state in ("held", "crashed")] or list(self.ops.values())
        op = ops[pick % len(ops)]
        self.run(self._send(op.scope, op.key, op.path, op.payload, mode))

    @precondition(lambda self: any(op.state == "held" for op in self.ops.values()))
    @rule(
        pick=st.integers(0, 7),
        mode=st.sampled_from(("ok", "hold", "hold", "fail")),
        wake=st.sampled_from((None, "ok", "bad", "fail", "raise", "raise_mid")),
    )
    def stall(self, pick: int, mode: str, wake: str | None) -> None:
        """A held worker stalls past its lease (the store's clock jumps), its client retries, and
        (`wake`) the stalled worker then resumes and finishes.

        Steps the other rules can also make, made together so that stale owners, takeovers,
        fenced late answers and outcome-unknown answers are frequent rather than rare.
        """
        self.c["rule_stall"] += 1
        held = self.held()
        op = held[pick % len(held)]
        self.run(self._advance(JUMPS["past_lease"]))
        self.run(self._send(op.scope, op.key, op.path, op.payload, mode))
        if wake is not None:
            self.run(self._finish(op, wake))

    @rule(
        scope=st.sampled_from(SCOPES),
        where=st.sampled_from(TARGETS),
        payload=st.sampled_from(PAYLOADS),
        mode=st.sampled_from(("ok", "hold", "fail")),
        n=st.integers(2, 5),
    )
    def burst(self, scope: str, where: tuple[str, str], payload: str, mode: str, n: int) -> None:
        self.c["rule_burst"] += 1
        self.run(self._burst(scope, where[0], where[1], payload, mode, n))

    async def _burst(self, scope: str, key: str, path: str, payload: str, mode: str, n: int) -> None:
        rkey, fp = (scope, key), (path, payload)
        expected = self.expect(rkey, fp)
        previous = self.records.get(rkey)
        ops = [self.new_op(scope, key, path, payload, mode) for _ in range(n)]
        for op in ops:
            op.task = self.loop.create_task(self.serve(op))
        await self.settle(ops)
        for op in ops:
            self.check_common(op)
        if expected != "run":
            for op in ops:
                self.refused(op, expected)
            return
        if previous is not None and previous.expires_at > self.now:
            self.c["reclaims"] += 1
        ran = sorted((op for op in ops if op.execution), key=lambda op: op.execution)
        others = [op for op in ops if not op.execution]
        check(ran, f"burst {ops}: nobody ran a free key")
        if mode == "fail":
            # Each execution answered 500 and released the claim before the next one could run:
            # every one of them opened its own epoch, and no 500 is ever replayed.
            for op in ran:
                self.ran(op, fp)
            for op in others:
                self.check_refused(op, "busy")
            return
        check(len(ran) == 1, f"burst {ops}: {len(ran)} executions of one operation")
        winner = ran[0]
        self.ran(winner, fp)
        for op in others:
            check(op.state == "done", f"{op}: a loser of the burst did not answer")
            answer = answer_of(op.result)
            if mode == "ok" and answer is not None and REPLAYED in answer[1]:
                self.check_replay(op, self.stored_answer(winner, "ok"))
            else:
                self.check_refused(op, "busy")

    @precondition(lambda self: any(op.state == "held" for op in self.ops.values()))
    @rule(pick=st.integers(0, 7), outcome=st.sampled_from(MODES))
    def finish(self, pick: int, outcome: str) -> None:
        self.c["rule_finish"] += 1
        held = self.held()
        self.run(self._finish(held[pick % len(held)], outcome))

    async def _finish(self, op: Op, outcome: str) -> None:
        if op.mode == "hold_mid":  # its 201 and first chunk are out: it can only end well or raise
            outcome = "raise_mid" if outcome in ("raise", "raise_mid") else "ok"
        op.outcome = outcome
        op.release.set()
        await self.settle([op], answered=True)
        check(op.state == "done", f"{op}: released but did not answer")
        self.check_common(op)
        self.check_first(op, outcome)
        self._finished(op, outcome)

    def _finished(self, op: Op, outcome: str) -> None:
        """Apply a held op's end to the model: its token still holds the record, or it was fenced off."""
        rec = self.records.get(op.rkey) if op.gen == self.gen else None
        if rec is None or rec.owner is not op:
            # taken over (reclaim), TTL over and claimed again, or a memory store restarted under it:
            # the client has its answer, the store must not.
            self.c["stale_owner_fenced"] += 1
            if rec is not None and op.gen == self.gen:
                late = "answer" if outcome in STORED else "release"
                self.c[
                    f"stale_{late}_fenced_" + ("by_live_holder" if rec.owner is not None else "by_stored_answer")
                ] += 1
            return
        if rec.expires_at <= self.now and self.kind != "postgres":
            # Memory and Redis drop the record at its TTL, so the late completion or release finds
            # nothing. Postgres keeps the row (free for the next claim) under the holder's token, so
            # the holder's completion is still accepted: no second execution either way.
            del self.records[op.rkey]
            self.c["completion_after_ttl_refused"] += 1
            return
        if rec.expires_at <= self.now:
            self.c["completion_after_ttl_accepted"] += 1
        if outcome in STORED:
            self.records[op.rkey] = Rec(rec.fp, None, self.stored_answer(op, outcome), self.now, self.now + TTL)
        elif outcome == "raise_mid":
            self.records[op.rkey] = Rec(rec.fp, None, None, self.now, rec.expires_at, failed=True)
        else:
            del self.records[op.rkey]

    @precondition(lambda self: any(op.state == "held" for op in self.ops.values()))
    @rule(pick=st.integers(0, 7), how=st.sampled_from(("kill", "kill", "cancel")))
    def crash(self, pick: int, how: str) -> None:
        """A held handler's worker dies (`kill`), or the server cancels the request's task (`cancel`)."""
        self.c[f"rule_crash_{how}"] += 1
        held = self.held()
        self.run(self._crash(held[pick % len(held)], kill=how == "kill"))

    async def _crash(self, op: Op, *, kill: bool) -> None:
        assert op.task is not None
        # kill: from now on this worker cannot reach the store (a SIGKILL runs no more code);
        # cancel: the store stays reachable, and the middleware still must not free the claim,
        # since the effect may have happened.
        op.store.dead = kill
        op.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await op.task
        op.state = "crashed"
        types = [m["type"] for m in op.result.messages]
        sent = [] if op.mode == "hold" else ["http.response.start", "http.response.body"]
        check(types == sent, f"{op}: a crashed worker's client got {types}")
        # The record stays in progress under the dead worker's token until its lease ends; a cancelled
        # worker whose answer had started (and that still reaches the store) ends the lease at once.
        rec = self.records.get(op.rkey) if op.gen == self.gen else None
        if not kill and op.mode == "hold_mid" and rec is not None and rec.owner is op and rec.expires_at > self.now:
            self.records[op.rkey] = Rec(rec.fp, None, None, self.now, rec.expires_at, failed=True)

    @rule(jump=st.sampled_from(("past_lease", "past_lease", "past_lease", "past_ttl")))
    def advance_clock(self, jump: str) -> None:
        self.c[f"rule_advance_{jump}"] += 1
        self.run(self._advance(JUMPS[jump]))

    async def _advance(self, seconds: float) -> None:
        self.now += seconds
        self.clock[0] += seconds
        await self.h.jump(self.prefix, self.namespace, seconds)

    @precondition(lambda self: self.restarts < 2)
    @rule()
    def restart_store(self) -> None:
        self.c["rule_restart_store"] += 1
        self.restarts += 1
        self.backend = self.h.new_backend(self.prefix, self.clock)
        self.backends.append(self.backend)
        store = WorkerStore(self.backend, self.c, self.h.mutant)
        self.shared = (store, self.worker(store))
        if self.kind == "memory":
            # A new process, a new empty dict: every key is forgotten, so each may run once more.
            self.gen += 1
            self.records.clear()

    @invariant()
    def ledger_matches_epochs(self) -> None:
        if self.broken:
            return
        self.broken = True  # until the checks pass: a failed invariant skips the teardown's checks
        check(
            +self.ledger == +self.epochs,
            f"executions per (scope, key) {dict(self.ledger)} != allowed {dict(self.epochs)}",
        )
        for op in self.held():
            assert op.task is not None
            check(not op.task.done(), f"{op}: a held handler ended by itself")
        self.broken = False

    # -- the end of an example --

    def teardown(self) -> None:
        try:
            if not self.broken:
                self.run(self._final())
        finally:
            self.loop.run_until_complete(self._cleanup())

    async def _final(self) -> None:
        """Let every held handler finish, then probe every key in both scopes."""
        for op in self.held():
            await self._finish(op, "ok")
        check(+self.ledger == +self.epochs, f"after all returned: {dict(self.ledger)} != {dict(self.epochs)}")
        keys = {k for (_, k) in self.records}
        for key in sorted(keys):
            for scope in SCOPES:
                rec = self.records.get((scope, key)) or next(r for (_, k), r in self.records.items() if k == key)
                self.c["final_probes"] += 1
                op = await self._send(scope, key, rec.fp[0], rec.fp[1], "ok")
                check(op.state == "done", f"{op}: a final probe held")
        check(+self.ledger == +self.epochs, f"after the probes: {dict(self.ledger)} != {dict(self.epochs)}")

    async def _cleanup(self) -> None:
        pending: list[asyncio.Future[Any]] = [
            op.task for op in self.ops.values() if op.task is not None and not op.task.done()
        ]
        for op in self.ops.values():
            op.store.dead = True
        for task in pending:
            task.cancel()
        # The workers' writes still being retried die with them (as with their process), before the
        # store is closed (which would wait for them).
        for store in {op.store for op in self.ops.values()}:
            machinery = runtime._by_store.get(store)
            if machinery is not None:
                pending.extend(machinery.late._tasks)
                for task in machinery.late._tasks:
                    task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for backend in self.backends:
            await backend.aclose()
        await self.h.wipe(self.prefix, self.namespace)


# --- the tests ---------------------------------------------------------------------------------


def model_settings(examples: int, steps: int, *, derandomize: bool = True) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


def run_model(harness: Harness, config: settings) -> None:
    harness.loop.run_until_complete(harness.start())
    try:
        run_state_machine_as_test(lambda: IdempotencyModel(harness), settings=config)  # type: ignore[arg-type]
    finally:
        try:
            harness.loop.run_until_complete(harness.stop())
        finally:
            harness.loop.close()


@pytest.fixture(autouse=True)
def _no_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runs with no grace on expired leases (the first sighting counts as over). Its
    clock jumps are far longer than any grace, and on Redis and Postgres it moves records back in
    time, which a real lease would never see; the lease rule itself (in progress until seen
    unchanged for its grace) has its own tests: tests/test_lease_edges.py, tests/test_store_stall.py."""
    monkeypatch.setattr(leases, "grace", lambda lease: 0.0)


@pytest.mark.parametrize("kind", BACKENDS)
def test_model(kind: str) -> None:
    """The contract holds on every store, over sequences of sends, bursts, finishes, crashes, clock jumps, restarts."""
    if kind == "redis":
        require("redis", REDIS_URL)
    elif kind == "postgres":
        require("postgres", POSTGRES_DSN)
    harness = Harness(kind)
    started = time.monotonic()
    run_model(harness, model_settings(EXAMPLES, STEPS, derandomize=DERANDOMIZE))
    c = harness.counters
    c["wall_ms"] = round((time.monotonic() - started) * 1000)
    SUMMARY[kind] = c
    line = {
        "test": "model",
        "backend": kind,
        "examples": c["examples"],
        "max_steps": STEPS,
        "derandomized": DERANDOMIZE,
        "steps": {k.removeprefix("rule_"): v for k, v in sorted(c.items()) if k.startswith("rule_")},
        "seen": {k: v for k, v in sorted(c.items()) if not k.startswith("rule_") and k not in ("examples", "wall_ms")},
        # Reached only when every check held: any of these would have failed the test first.
        "double_executions": 0,
        "replay_mismatches": 0,
        "cross_scope_leaks": 0,
        "wall_s": c["wall_ms"] / 1000,
    }
    report(line, "MODEL")
    check(c["calls_from_dead_workers"] == 0, "a crashed worker's code still reached the store")
    # The run exercised what it is for (a guard against a model that quietly stopped reaching states).
    if EXAMPLES < 100:
        return
    for what in ("executions", "replays", "422", "409_in_progress", "409_outcome_unknown", "reclaims", "raised"):
        check(c[what] > 0, f"the model never produced {what}: {dict(c)}")
    check(c["stale_owner_fenced"] > 0 and c["rule_crash_kill"] > 0, f"no crash or stale owner: {dict(c)}")


MUTANTS = [
    "drop_complete",
    "release_noop",
    "unscoped",
    "claim_always_wins",
    "complete_unfenced",
    "release_unfenced",
    "block_reclaims",
]


@pytest.mark.memory
@pytest.mark.parametrize("mutant", MUTANTS)
def test_model_has_teeth(mutant: str) -> None:
    """Each deliberately broken store or configuration is caught by the model.

    drop_complete: completions acknowledged but never written (replays become 409s);
    release_noop: a 5xx does not free the key (its retry gets 409 instead of running);
    unscoped: the store ignores the scope (one tenant gets the other's answer);
    claim_always_wins: the claim never sees an existing record (double executions);
    complete_unfenced / release_unfenced: writes are not fenced by the claim's token (a stale
    owner's late answer or release lands on the claim that took over);
    block_reclaims: the `block` route re-runs an expired claim (execution without an epoch).

    No shrinking (it is slow and the point is only that the model fails).
    """
    config = settings(model_settings(300, STEPS), phases=[Phase.explicit, Phase.generate])
    with pytest.raises(ModelViolation):
        run_model(Harness("memory", mutant), config)
