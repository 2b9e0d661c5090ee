"""Isolation and bounds (issue #8, item 7).

1. Two scopes with one key never see each other's records or bytes: a Hypothesis property over
   scope and key pairs (separator- and hash-tag-shaped included), and concurrent duplicate bursts
   of both scopes at once, on memory, Redis and Postgres.
2. A flood of 100,000 distinct keys cannot grow the memory backend past `max_entries`: only
   completed answers are evicted (oldest first), running claims never are, and a store full of
   running claims answers 503; traced memory stops growing once the store is full.
3. A 100 MiB body is refused with 413 before any store call, with bounded memory: in a fresh
   subprocess (so its peak RSS is this scenario's alone), streamed in 64 KiB chunks with an
   honest Content-Length (refused before reading), with none (refused once the limit is crossed)
   and with one that lies low. A control run with a limit above 100 MiB shows the measurement
   does see a buffered body.
4. Unprotected requests are never buffered: the app reads each chunk before the client has sent
   the next one, gets the client's very `receive` and message objects, and no store call is made.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Message, Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.http import problems
from idem_asgi.http.keys import scope_from_header
from idem_asgi.records import COMPLETED, IN_PROGRESS, RecordKey
from tests.support.asgi import Result, drive, http_scope, messages_of, read_body
from tests.support.hostile import Charge, Recorder, Store, open_store
from tests.support.problems import assert_problem
from tests.support.scorecard import report
from tests.support.stores import BACKENDS

ROOT = Path(__file__).resolve().parent.parent
ISOLATION_EXAMPLES = {"memory": 1000, "redis": 300, "postgres": 300}
MiB = 1 << 20


@pytest.fixture(scope="module", params=BACKENDS)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    with open_store(request.param) as s:
        yield s


def tenant_middleware(app: Any, backend: Any, namespace: str, **policy: Any) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        scope=scope_from_header("x-tenant"),
        routes=[RoutePolicy("/payments", methods=["POST"], ttl=600, **policy)],
    )


def request_of(tenant: bytes, key: bytes) -> dict[str, Any]:
    return http_scope(raw_headers=[(b"idempotency-key", key), (b"x-tenant", tenant)], state={})


# --- 1. scopes never meet --------------------------------------------------------------------

# Scope values as a proxy would pass them (latin-1 header bytes), shaped to collide if the store
# key were a naive join: separators, glob and hash-tag characters, prefixes of one another.
TENANT_ALPHABET = st.sampled_from(list(b":{}*?[]\\/ |'\"%;-_.aAb1\xe9\xff\t"))
tenants = st.one_of(
    st.sampled_from([b"a", b"a:b", b"a:", b":a", b"{a}", b"{", b"*", b"a*", b"", b"A", b"a ", b"0", b"00"]),
    st.lists(TENANT_ALPHABET, min_size=1, max_size=12).map(bytes),
)
keys = st.one_of(
    st.sampled_from([b"b:c", b"c", b"k", b"*", b"{t}", b"b", b":c", b"a:b:c"]),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20)
    .filter(lambda k: not k.startswith('"'))  # a bare token, not a quoted one (test_bad_input covers those)
    .map(str.encode),
)


def test_two_scopes_never_see_each_others_records_or_bytes(store: Store) -> None:
    namespace = store.namespace()
    app = Charge()
    recorder = Recorder(store.backend)
    mw = tenant_middleware(app, recorder, namespace)
    runs = 0

    @settings(
        max_examples=ISOLATION_EXAMPLES[store.name],
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(a=st.tuples(tenants, keys), b=st.tuples(tenants, keys), same_key=st.booleans())
    def check(a: tuple[bytes, bytes], b: tuple[bytes, bytes], same_key: bool) -> None:
        nonlocal runs
        if same_key:
            b = (b[0], a[1])
        assume(a[0] != b[0])  # two parties
        # Examples never meet: each gets its own copy of the tenants. A prefix keeps the shapes that
        # would collide under a naive join: ("a", "b:c") and ("a:b", "c") both read "<salt>a:b:c".
        salt = uuid.uuid4().hex.encode()
        (ta, ka), (tb, kb) = (salt + a[0], a[1]), (salt + b[0], b[1])
        body_a, body_b = b"pay A " + salt, b"pay B " + salt

        async def scenario() -> None:
            nonlocal runs
            calls = app.calls
            first_a = await drive(mw, request_of(ta, ka), messages=messages_of([body_a]))
            first_b = await drive(mw, request_of(tb, kb), messages=messages_of([body_b]))
            # B's different body under A's key is no mismatch: B never sees A's record
            assert first_a.status == first_b.status == 201, (first_a.body, first_b.body)
            assert app.calls == calls + 2
            runs += 2
            again_a = await drive(mw, request_of(ta, ka), messages=messages_of([body_a]))
            again_b = await drive(mw, request_of(tb, kb), messages=messages_of([body_b]))
            assert again_a.body == first_a.body and again_b.body == first_b.body
            assert again_a.header("idempotent-replayed") == again_b.header("idempotent-replayed") == b"true"
            assert app.calls == calls + 2
            # (";sha=" ends the tenant field: one tenant may be a prefix of the other, "x" and "x;")
            for answer in (first_a, again_a):
                assert body_b not in answer.body and b"tenant=" + tb + b";sha=" not in answer.body
            for answer in (first_b, again_b):
                assert body_a not in answer.body and b"tenant=" + ta + b";sha=" not in answer.body
            for t, k, mine, other in ((ta, ka, first_a, body_b), (tb, kb, first_b, body_a)):
                record = await store.backend.get(RecordKey.build(namespace, t.decode("latin-1"), k.decode()))
                assert record is not None and record.state == COMPLETED and record.response is not None
                assert record.response.body == mine.body and other not in record.response.body
            # and A's key with B's body is still a mismatch within A's scope
            assert_problem(
                await drive(mw, request_of(ta, ka), messages=messages_of([body_b])), problems.FINGERPRINT_MISMATCH
            )

        store.run(scenario())

    check()
    assert store.run(store.count(namespace)) == runs
    line = {"test": "two_scopes_one_key", "backend": store.name, "pairs": runs // 2, "cross_scope_leaks": 0}
    report(line, "PROPERTY")


@pytest.mark.parametrize("rounds", [10])
def test_concurrent_bursts_of_two_scopes_on_one_key_stay_apart(store: Store, rounds: int) -> None:
    """Both tenants fire 25 duplicates of one key at once, interleaved; each tenant's operation runs
    once, each duplicate gets its own tenant's replay or a 409, never the other tenant's bytes."""
    namespace = store.namespace()
    app = Charge(delay=0.02)
    mw = tenant_middleware(app, store.backend, namespace)
    dup = 25
    outcomes = {"first": 0, "replay": 0, "409": 0}

    async def burst(key: bytes) -> None:
        bodies = {b"acme": b'{"to":"acme","amount":1}', b"globex": b'{"to":"globex","amount":2}'}
        calls = app.calls
        order = [t for _ in range(dup) for t in bodies]

        async def one(t: bytes) -> tuple[bytes, Result]:
            await asyncio.sleep(0)
            return t, await drive(mw, request_of(t, key), messages=messages_of([bodies[t][:5], bodies[t][5:]]))

        answers = await asyncio.gather(*(one(t) for t in order))
        assert app.calls == calls + 2
        assert sorted(b for b in app.bodies[-2:]) == sorted(bodies.values())
        first: dict[bytes, bytes] = {}
        for t, answer in answers:
            other = next(o for o in bodies if o != t)
            assert answer.status in (201, 409), (answer.status, answer.body)
            if answer.status == 409:
                assert_problem(answer, problems.IN_PROGRESS)
                outcomes["409"] += 1
                continue
            outcomes["replay" if answer.header("idempotent-replayed") else "first"] += 1
            assert b"tenant=" + t + b";" in answer.body and bodies[t] in answer.body
            assert bodies[other] not in answer.body and b"tenant=" + other not in answer.body
            assert first.setdefault(t, answer.body) == answer.body
        for t in bodies:  # once done, each tenant replays its own answer
            replay = await drive(mw, request_of(t, key), messages=messages_of([bodies[t]]))
            assert replay.header("idempotent-replayed") == b"true" and bodies[t] in replay.body
            assert t not in first or replay.body == first[t]

    for i in range(rounds):
        store.run(burst(b"shared-" + uuid.uuid4().hex.encode() + b"-%d" % i))
    assert app.calls == 2 * rounds
    assert store.run(store.count(namespace)) == 2 * rounds
    assert outcomes["first"] == 2 * rounds and outcomes["409"] > 0, outcomes  # the bursts did overlap


# --- 2. the memory backend's bound -----------------------------------------------------------


class Gate:
    """An app whose executions wait for `open`; counts entries and completions."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.entered = 0
        self.done = 0
        self._entries = asyncio.Condition()

    async def until_entered(self, n: int) -> None:
        async with self._entries:
            await self._entries.wait_for(lambda: self.entered >= n)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        async with self._entries:
            self.entered += 1
            self._entries.notify_all()
        await self.open.wait()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        self.done += 1


class Router:
    """`/slow` goes to a gated app, everything else to a quick one."""

    def __init__(self, slow: Gate) -> None:
        self.slow = slow

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            await self.slow(scope, receive, send)
            return
        await read_body(receive)
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def flood_request(path: str, key: bytes) -> dict[str, Any]:
    return http_scope("POST", path, raw_headers=[(b"idempotency-key", key)], state={})


def rss() -> int:
    """This process's resident set size now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_a_flood_of_100k_keys_cannot_grow_the_memory_store_past_its_bound() -> None:
    """100,000 distinct keys through the middleware into a store bounded at 10,000 entries, while 50
    claims stay running. Once full, new keys are refused (503 + Retry-After) and no record is evicted
    (a replay is never lost to make room). Memory: tracemalloc over the filling of the store gives its
    size per entry; the RSS after the other 90,000 keys must not grow by what they would take."""
    bound, flood, running = 10_000, 100_000, 50
    backend = MemoryBackend(max_entries=bound)
    gate = Gate()
    mw = IdempotencyMiddleware(
        Router(gate),
        backend=backend,
        routes=[RoutePolicy("/*", methods=["POST"], single_tenant=True, lease=3600, ttl=86_400)],
    )
    figures: dict[str, Any] = {}

    async def post(key: bytes) -> int:
        """One request, as lean as possible: the flood is 100,000 of them."""
        status = 0

        async def receive() -> Message:
            return {"type": "http.request", "body": b'{"amount":1}', "more_body": False}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]

        await mw(http_scope("POST", "/pay", raw_headers=[(b"idempotency-key", key)], state={}), receive, send)
        return status

    def sizes() -> dict[str, int]:
        return {
            "records": len(backend),
            "keys": len(backend._keys),
            "expiry_heap": len(backend._expiry),
        }

    async def scenario() -> None:
        # claims that stay running during the whole flood
        held = [
            asyncio.create_task(drive(mw, flood_request("/slow", b"held-%d" % i), messages=messages_of([b"{}"])))
            for i in range(running)
        ]
        await gate.until_entered(running)
        statuses: dict[int, int] = {}
        t0 = time.perf_counter()
        gc.collect()
        tracemalloc.start()
        for i in range(bound - running):  # fills the store
            status = await post(b"flood-%d" % i)
            statuses[status] = statuses.get(status, 0) + 1
        gc.collect()
        store_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert len(backend) == bound
        rss_full = rss()
        every_10k = []
        for i in range(bound - running, flood):
            status = await post(b"flood-%d" % i)
            statuses[status] = statuses.get(status, 0) + 1
            if (i + 1) % 10_000 == 0:
                now = sizes()
                every_10k.append(now["records"])
                assert now["records"] == now["keys"] == bound
                assert now["expiry_heap"] <= 2 * bound + 1024
        gc.collect()
        rss_after = rss()
        per_entry = store_bytes / (bound - running)
        figures.update(
            flood_s=round(time.perf_counter() - t0, 2),
            statuses=statuses,
            entries_every_10k=every_10k,
            final=sizes(),
            traced_store_mib_when_full=round(store_bytes / MiB, 2),
            bytes_per_entry=round(per_entry),
            rss_full_mib=round(rss_full / MiB, 1),
            rss_after_flood_mib=round(rss_after / MiB, 1),
            unbounded_would_add_mib=round((flood - bound) * per_entry / MiB, 1),
        )
        # full of live records: every key past the bound was refused, none evicted to make room
        assert statuses == {201: bound - running, 503: flood - bound + running}
        # 90,000 more keys added (almost) nothing: an unbounded store would have grown ~9x
        assert rss_after - rss_full < min(8 * MiB, 0.1 * (flood - bound) * per_entry), figures
        # running claims were never evicted, however many completed answers came after them
        for i in range(running):
            record = await backend.get(RecordKey.build("idem", None, f"held-{i}"))
            assert record is not None and record.state == IN_PROGRESS
        # every completed answer is still there; the refused keys left nothing behind
        stored = [await backend.get(RecordKey.build("idem", None, f"flood-{i}")) for i in range(bound - running)]
        assert all(r is not None and r.state == COMPLETED for r in stored)
        assert await backend.get(RecordKey.build("idem", None, f"flood-{flood - 1}")) is None
        gate.open.set()
        answers = await asyncio.gather(*held)
        assert {a.status for a in answers} == {201} and gate.done == running
        for i in range(running):
            record = await backend.get(RecordKey.build("idem", None, f"held-{i}"))
            assert record is not None and record.state == COMPLETED

    asyncio.run(scenario())
    report({"test": "flood_100k_keys", "backend": "memory", **figures}, "FLOOD")


@pytest.mark.memory
def test_a_memory_store_full_of_running_claims_answers_503_and_evicts_none() -> None:
    bound = 200
    clock = [1_000_000.0]
    backend = MemoryBackend(max_entries=bound, clock=lambda: clock[0])
    gate = Gate()
    recorder = Recorder(backend)
    mw = IdempotencyMiddleware(
        gate,
        backend=recorder,
        routes=[RoutePolicy("/slow", methods=["POST"], single_tenant=True, lease=3600, ttl=7200)],
    )
    body = messages_of([b"{}"])

    async def scenario() -> None:
        held = [
            asyncio.create_task(drive(mw, flood_request("/slow", b"run-%d" % i), messages=body)) for i in range(bound)
        ]
        await gate.until_entered(bound)
        assert len(backend) == bound
        refused = [await drive(mw, flood_request("/slow", b"more-%d" % i), messages=body) for i in range(300)]
        for answer in refused:
            doc = assert_problem(answer, problems.STORE_UNAVAILABLE)
            assert answer.header("retry-after") is not None, doc
        assert gate.entered == bound and len(backend) == bound  # nothing evicted, nothing extra ran
        running = [await backend.get(RecordKey.build("idem", None, f"run-{i}")) for i in range(bound)]
        assert all(r is not None and r.state == IN_PROGRESS for r in running)
        gate.open.set()
        assert {a.status for a in await asyncio.gather(*held)} == {201}
        # completed answers are kept for their TTL: still no room, and every answer still replays
        refused = [await drive(mw, flood_request("/slow", b"more-%d" % i), messages=body) for i in range(10)]
        assert {a.status for a in refused} == {503}
        replays = [await drive(mw, flood_request("/slow", b"run-%d" % i), messages=body) for i in range(bound)]
        assert {a.header("idempotent-replayed") for a in replays} == {b"true"}
        clock[0] += 7201  # their TTL is over: room again
        retried = [await drive(mw, flood_request("/slow", b"more-%d" % i), messages=body) for i in range(bound)]
        assert {a.status for a in retried} == {201} and len(backend) == bound

    asyncio.run(scenario())


# --- 3. a 100 MiB body, in a subprocess ------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, gc, itertools, json, resource, sys, tracemalloc
    from idem_asgi import IdempotencyMiddleware, RoutePolicy
    from idem_asgi.backends import MemoryBackend
    from tests.support.hostile import Recorder

    mode = sys.argv[1]
    TOTAL, CHUNK = 100 << 20, 64 << 10
    limit = (256 << 20) if mode == "control" else (1 << 20)
    ran = []

    async def app(scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        ran.append(len(body))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    serial = itertools.count()
    recorder = Recorder(MemoryBackend())
    mw = IdempotencyMiddleware(
        app, backend=recorder,
        routes=[RoutePolicy("/upload", methods=["POST"], single_tenant=True, max_body=limit)],
    )

    async def once(declared, total):
        pulled = 0
        sent = []

        async def receive():
            nonlocal pulled
            if pulled * CHUNK >= total:
                return {"type": "http.disconnect"}
            pulled += 1
            # a fresh bytes object per chunk, as a server reading a socket makes
            chunk = bytes(bytearray(CHUNK))
            return {"type": "http.request", "body": chunk, "more_body": pulled * CHUNK < total}

        async def send(message):
            sent.append(message)

        headers = [(b"idempotency-key", b"upload-%d" % next(serial))]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/upload", "raw_path": b"/upload", "query_string": b"",
                 "root_path": "", "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await mw(scope, receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, pulled, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    declared = {"honest": TOTAL, "chunked": None, "lying": 1000, "control": TOTAL}[mode]
    asyncio.run(once(len(b"warm-up"), CHUNK))  # imports, first-call allocations: before the baseline
    ran.clear()
    recorder.calls.clear()
    gc.collect()
    tracemalloc.start()  # its own cost is a few KiB here: 17 chunks, or none

    def status_kib(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS, so the peak read
    # afterwards is this request's alone (ru_maxrss would still hold the import-time peak).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status_kib("VmRSS") * 1024
        status, pulled, body = asyncio.run(once(declared, TOTAL))
        peak_rss = status_kib("VmHWM") * 1024
    except OSError:  # no /proc (not Linux): the high-water mark since start-up, a looser bound
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        status, pulled, body = asyncio.run(once(declared, TOTAL))
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"mode": mode, "status": status, "chunks_read": pulled, "store_calls": recorder.calls,
                      "app_runs": ran, "rss_before": before, "rss_peak": peak_rss, "rss_growth": peak_rss - before,
                      "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "traced_peak": peak, "body": body.decode("latin-1")}))
    """
)


def child(mode: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.memory
@pytest.mark.parametrize("mode", ["honest", "chunked", "lying"])
def test_a_100_mib_body_is_refused_before_any_claim_with_bounded_memory(mode: str) -> None:
    limit = MiB
    r = child(mode)
    figures = {k: v for k, v in r.items() if k != "body"}
    report({"test": f"body_100mib_{mode}", "backend": "memory", **figures}, "BODY100")
    assert r["status"] == 413 and json.loads(r["body"])["type"] == "urn:idem-asgi:problem:body-too-large"
    assert r["store_calls"] == [] and r["app_runs"] == []
    if mode == "honest":
        assert r["chunks_read"] == 0  # refused on the declared length, before reading the body
    else:
        assert r["chunks_read"] == limit // (64 << 10) + 1  # read up to the limit and one chunk past it
    bound = 2 * limit + 4 * MiB  # the limit's worth of chunks, a join of them, and slack
    assert r["rss_growth"] < bound, r
    assert r["traced_peak"] < bound, r


@pytest.mark.slow
@pytest.mark.memory
def test_the_memory_measure_does_see_a_buffered_100_mib_body() -> None:
    """Control: with a route limit above 100 MiB the body is buffered, and the same measure shows it."""
    r = child("control")
    print("BODY100", json.dumps({k: v for k, v in r.items() if k != "body"}))
    assert r["status"] == 201 and r["app_runs"] == [100 * MiB]
    assert r["rss_growth"] > 90 * MiB


# --- 4. unprotected routes are never buffered ------------------------------------------------

UNPROTECTED = [
    ("POST", "/refunds", [(b"idempotency-key", b"k1")]),  # no policy for the path
    ("GET", "/payments", [(b"idempotency-key", b"k1")]),  # the path's policy does not protect GET
    ("post", "/payments", [(b"idempotency-key", b"k1")]),  # methods are case-sensitive (RFC 9110)
    ("POST", "/payments", []),  # protected route, key optional and absent: passes through unprotected
]


@pytest.mark.memory
@pytest.mark.parametrize(("method", "path", "headers"), UNPROTECTED, ids=["path", "method", "lowercase", "no-key"])
def test_unprotected_requests_stream_to_the_app_unbuffered(
    method: str, path: str, headers: list[tuple[bytes, bytes]]
) -> None:
    chunk, n = 256 << 10, 8  # 2 MiB in all: twice the route's limit, which only protected requests have
    recorder = Recorder(MemoryBackend())
    seen: list[Message] = []
    channel_ids: list[int] = []

    async def scenario() -> None:
        saw = [asyncio.Event() for _ in range(n)]
        queue: asyncio.Queue[Message] = asyncio.Queue()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            channel_ids.append(id(receive))
            while True:
                message = await receive()
                seen.append(message)
                saw[len(seen) - 1].set()
                if not message.get("more_body"):
                    break
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"%d" % sum(len(m["body"]) for m in seen)})

        mw = IdempotencyMiddleware(
            app, backend=recorder, routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True)]
        )

        async def receive() -> Message:
            return await queue.get()

        sent_messages: list[Message] = []

        async def client() -> None:
            for i in range(n):
                message = {"type": "http.request", "body": bytes([i]) * chunk, "more_body": i < n - 1}
                sent_messages.append(message)
                queue.put_nowait(message)
                # the app must have this chunk before the next one exists: a buffering middleware
                # would wait for the whole body first, and this would time out
                await asyncio.wait_for(saw[i].wait(), timeout=5)

        out: list[Message] = []

        async def send(message: Message) -> None:
            out.append(message)

        channel_ids.append(id(receive))
        await asyncio.gather(mw(http_scope(method, path, raw_headers=headers, state={}), receive, send), client())
        assert [m is s for m, s in zip(seen, sent_messages, strict=True)] == [True] * n  # the very same messages
        assert Result(out).status == 200 and Result(out).body == b"%d" % (chunk * n)

    asyncio.run(scenario())
    assert len(set(channel_ids)) == 1  # the app got the client's own receive callable
    assert recorder.calls == []
