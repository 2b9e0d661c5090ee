"""The client half against the real middleware: one key per logical call, and the first answer, whatever breaks.

In-process, a fault layer sits between the retry transport and `httpx.ASGITransport`; over TCP, a real
uvicorn (on a background thread) sits behind `tests.support.faultproxy.FaultProxy` on 127.0.0.1. Every fault
case checks that the handler ran exactly once and that the caller got the stored answer, byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Iterator
from types import TracebackType
from typing import Any

import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.claims.leases import grace
from idem_asgi.client import IdempotentRetrySyncTransport, IdempotentRetryTransport, was_replayed
from idem_asgi.errors import BackendUnavailable
from idem_asgi.http.problems import DEFAULT_PROBLEM_BASE
from idem_asgi.records import ClaimResult, RecordKey
from tests.support.asgi import read_body
from tests.support.faultproxy import FaultProxy
from tests.support.servers import serving
from tests.support.stores import Delegating

pytestmark = pytest.mark.memory

SLACK = 1.5  # seconds of scheduling noise tolerated on a busy 2-core machine
FAST: dict[str, Any] = {"backoff_base": 0.01, "backoff_cap": 0.05}


# --------------------------------------------------------------------------------------------------
# The server side: a payments app behind the real middleware
# --------------------------------------------------------------------------------------------------


class Shop:
    """A tiny payments app behind IdempotencyMiddleware that counts handler runs per key and every attempt.

    Paths (all POST/PATCH protected): `/payments` answers 201 at once (400 for the body `invalid`),
    `/slow` after 0.5 s, `/hang` after 30 s, `/broken` always 503 from the app itself.
    """

    def __init__(
        self, backend: Backend | None = None, *, lease: float = 30, problem_base: str = DEFAULT_PROBLEM_BASE
    ) -> None:
        self.backend = backend if backend is not None else MemoryBackend()
        self.runs: Counter[str | None] = Counter()
        self.seen: list[tuple[str, str | None]] = []  # (path, key) of every request that reached the server
        self.bodies: list[bytes] = []
        self.asgi = IdempotencyMiddleware(
            self._handler,
            backend=self.backend,
            routes=[RoutePolicy("/*", methods=["POST", "PATCH"], single_tenant=True, lease=lease, retry_after=1)],
            problem_base=problem_base,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["path"], _key_of(scope)))
        await self.asgi(scope, receive, send)

    async def _handler(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        info = current_idempotency()  # the key as the middleware parsed it (`"abc"` is `abc`)
        key = info.key if info is not None else None
        path = scope["path"]
        if scope["method"] in ("POST", "PATCH"):
            self.runs[key] += 1
            self.bodies.append(body)
        if path == "/slow":
            await asyncio.sleep(0.5)
        elif path == "/hang":
            await asyncio.sleep(30)
        payload: dict[str, object]
        if path == "/broken":
            status, payload = 503, {"error": "downstream is down"}
        elif body == b"invalid":
            status, payload = 400, {"error": "invalid"}
        else:
            status, payload = 201, {"charge": uuid.uuid4().hex, "key": key, "received": len(body)}
        raw = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    async def stored_body(self, key: str) -> bytes:
        """The body the middleware stored for `key`: what every caller of that key must get."""
        record = await self.backend.get(RecordKey.build("idem", None, key))
        assert record is not None and record.response is not None, f"nothing stored for {key!r}"
        return record.response.body

    def keys_seen(self, path: str) -> list[str | None]:
        return [k for p, k in self.seen if p == path]


def _key_of(scope: Scope) -> str | None:
    return next((v.decode() for k, v in scope["headers"] if k == b"idempotency-key"), None)


class FlakyStore(Delegating):
    """Our Backend protocol around MemoryBackend; its first `failures` claims raise BackendUnavailable (-> 503)."""

    def __init__(self, failures: int = 1) -> None:
        super().__init__(MemoryBackend())
        self.failures = failures
        self.claims = 0

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        self.claims += 1
        if self.failures:
            self.failures -= 1
            raise BackendUnavailable("injected: store unreachable")
        return await super().claim(key, fingerprint, lease=lease, ttl=ttl)


# --------------------------------------------------------------------------------------------------
# In-process: a fault-injecting transport between the retry transport and the app
# --------------------------------------------------------------------------------------------------


class Faults(httpx.AsyncBaseTransport):
    """Injects one network fault per attempt, in script order, then passes everything through.

    - `refused`: the connection fails before anything is sent (the server never sees it).
    - `lost`: the server answers completely, then the answer is lost on the way back.
    - `timeout`: the client gives up after 0.1 s while the server keeps working on it.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport, script: Iterable[str] = ()) -> None:
        self.inner = inner
        self.script = list(script)
        self.keys: list[str | None] = []
        self._orphans: list[asyncio.Task[httpx.Response]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.keys.append(request.headers.get("idempotency-key"))
        fault = self.script.pop(0) if self.script else "ok"
        if fault == "refused":
            raise httpx.ConnectError("injected: connection refused", request=request)
        if fault == "timeout":
            task = asyncio.create_task(self.inner.handle_async_request(request))
            self._orphans.append(task)
            await asyncio.wait({task}, timeout=0.1)
            raise httpx.ReadTimeout("injected: no answer in time", request=request)
        response = await self.inner.handle_async_request(request)
        if fault == "lost":
            await response.aread()
            raise httpx.RemoteProtocolError("injected: server disconnected without sending a response", request=request)
        return response

    async def aclose(self) -> None:
        for task in self._orphans:  # the server finished these; close what nobody read
            response = await asyncio.wait_for(task, timeout=10)
            await response.aclose()
        await self.inner.aclose()


class InProcess:
    """A shop, a fault layer and a client whose transport is the one under test."""

    def __init__(self, shop: Shop, script: Iterable[str] = (), **options: Any) -> None:
        self.shop = shop
        self.faults = Faults(httpx.ASGITransport(app=shop), script)
        self.transport = IdempotentRetryTransport(self.faults, **{**FAST, **options})
        self.client = httpx.AsyncClient(transport=self.transport, base_url="http://shop.test")

    async def __aenter__(self) -> InProcess:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()


async def assert_first_answer(shop: Shop, response: httpx.Response, *, replayed: bool) -> str:
    """The caller got the stored answer byte for byte, from the store iff `replayed`; the handler ran once."""
    key = response.extensions["idempotency_key"]
    assert response.status_code == 201, response.text
    assert response.content == await shop.stored_body(key)
    assert was_replayed(response) is replayed
    assert shop.runs[key] == 1
    return str(key)


# (a) the response is lost after the handler ran
async def test_lost_response_is_retried_with_the_same_key_and_replayed() -> None:
    shop = Shop()
    async with InProcess(shop, ["lost"]) as c:
        r = await c.client.post("/payments", json={"amount": 1230})
    key = await assert_first_answer(shop, r, replayed=True)
    assert shop.keys_seen("/payments") == [key, key]
    assert r.extensions["idempotency_attempts"] == 2


# (b) a second logical call with the same caller-minted key arrives while the first still runs
async def test_in_progress_409_waits_for_retry_after_then_gets_the_replay() -> None:
    shop = Shop()
    async with InProcess(shop) as c:
        headers = {"Idempotency-Key": "checkout-7f3a"}

        async def second() -> httpx.Response:
            await asyncio.sleep(0.15)
            return await c.client.post("/slow", json={"amount": 5}, headers=headers)

        start = time.monotonic()
        first, repeat = await asyncio.gather(c.client.post("/slow", json={"amount": 5}, headers=headers), second())
        elapsed = time.monotonic() - start
    await assert_first_answer(shop, first, replayed=False)
    await assert_first_answer(shop, repeat, replayed=True)
    assert repeat.extensions["idempotency_attempts"] == 2  # 409 in progress, then the replay
    assert elapsed >= 1.0  # it waited for Retry-After: 1 instead of hammering
    assert repeat.content == first.content


# (b) behind the problem base of the API's own docs (which the docs encourage), a 409 in progress is still
# retried: the client reads the slug after the base, whatever the base is.
@pytest.mark.parametrize("base", ["https://api.example.com/problems/", "https://docs.example.com/errors.html#"])
async def test_in_progress_409_is_retried_behind_a_custom_problem_base(base: str) -> None:
    shop = Shop(problem_base=base)
    async with InProcess(shop) as c:
        headers = {"Idempotency-Key": "checkout-base"}

        async def second() -> httpx.Response:
            await asyncio.sleep(0.15)
            return await c.client.post("/slow", json={"amount": 5}, headers=headers)

        first, repeat = await asyncio.gather(c.client.post("/slow", json={"amount": 5}, headers=headers), second())
    await assert_first_answer(shop, first, replayed=False)
    await assert_first_answer(shop, repeat, replayed=True)
    assert repeat.extensions["idempotency_attempts"] == 2  # 409 in progress (under `base`), then the replay
    assert repeat.content == first.content


@pytest.mark.parametrize(
    ("problem_type", "retried"),
    [
        ("https://api.example.com/problems/request-in-progress", True),
        ("https://docs.example.com/errors.html#request-in-progress", True),
        ("/problems/request-in-progress", True),  # a relative reference (RFC 9457 allows one)
        ("#request-in-progress", True),
        ("urn:idem-asgi:problem:request-in-progress", True),  # 0.1.0's form
        ("https://api.example.com/problems/outcome-unknown", False),
        ("https://api.example.com/problems/request-in-progress-elsewhere", False),
        ("https://api.example.com/problems/", False),
    ],
)
async def test_the_in_progress_slug_is_read_after_any_problem_base(problem_type: str, retried: bool) -> None:
    answers = [
        httpx.Response(409, json={"type": problem_type, "status": 409}, headers={"retry-after": "0"}),
        httpx.Response(201, json={"charge": "ch_1"}),
    ]
    transport = IdempotentRetryTransport(httpx.MockTransport(lambda request: answers.pop(0)), **FAST)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        r = await client.post("/payments", json={"amount": 5})
    assert (r.status_code, r.extensions["idempotency_attempts"]) == ((201, 2) if retried else (409, 1))


# (b) the client's attempt times out while the handler still runs; the retry meets 409, then the replay
async def test_timeout_while_running_then_409_then_replay() -> None:
    shop = Shop()
    async with InProcess(shop, ["timeout"]) as c:
        r = await c.client.post("/slow", content=b"pay 5")
    key = await assert_first_answer(shop, r, replayed=True)
    assert r.extensions["idempotency_attempts"] == 3  # timed out, 409 in progress, replay
    assert shop.keys_seen("/slow") == [key, key, key]


# (c) a transient 503: the store was unreachable on the first claim
async def test_transient_503_from_the_store_is_retried() -> None:
    shop = Shop(FlakyStore(failures=1))
    async with InProcess(shop) as c:
        r = await c.client.post("/payments", json={"amount": 99})
    await assert_first_answer(shop, r, replayed=False)  # the first run happened on the retry
    assert r.extensions["idempotency_attempts"] == 2


async def test_refused_connections_are_retried() -> None:
    shop = Shop()
    async with InProcess(shop, ["refused", "refused"]) as c:
        r = await c.client.post("/payments", json={"amount": 1})
    await assert_first_answer(shop, r, replayed=False)
    assert len(c.faults.keys) == 3 and len(set(c.faults.keys)) == 1


# (d) 422 and every other 4xx are final
async def test_422_fingerprint_mismatch_is_never_retried() -> None:
    shop = Shop()
    async with InProcess(shop) as c:
        headers = {"Idempotency-Key": "k-422"}
        first = await c.client.post("/payments", json={"amount": 1}, headers=headers)
        other = await c.client.post("/payments", json={"amount": 2}, headers=headers)
    assert first.status_code == 201
    assert other.status_code == 422
    assert other.json()["type"] == "urn:idem-asgi:problem:fingerprint-mismatch"
    assert other.extensions["idempotency_attempts"] == 1
    assert shop.keys_seen("/payments") == ["k-422", "k-422"]  # one attempt each
    assert shop.runs["k-422"] == 1


async def test_app_400_is_never_retried() -> None:
    shop = Shop()
    async with InProcess(shop) as c:
        r = await c.client.post("/payments", content=b"invalid")
    assert r.status_code == 400 and r.extensions["idempotency_attempts"] == 1
    assert len(shop.seen) == 1


async def test_outcome_unknown_409_is_never_retried() -> None:
    """The first call's attempt is cut off by total_timeout (the app is cancelled, its claim kept, its
    lease lapses): outcome unknown. A later call with the same key gets a final 409, not a retry loop."""
    shop = Shop(lease=0.3)
    headers = {"Idempotency-Key": "k-unknown"}
    async with InProcess(shop, total_timeout=0.3) as c:
        with pytest.raises(httpx.TimeoutException):
            await c.client.post("/hang", content=b"x", headers=headers)
    await asyncio.sleep(0.5)  # the lease, no longer renewed, expires
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shop), base_url="http://shop.test") as plain:
        seen = await plain.post("/hang", content=b"x", headers=headers)  # its holder might still renew
    assert seen.status_code == 409 and seen.json()["type"] == "urn:idem-asgi:problem:request-in-progress"
    await asyncio.sleep(grace(0.3))  # seen unchanged for its grace: the holder is gone, the outcome unknown
    async with InProcess(shop) as c:
        r = await c.client.post("/hang", content=b"x", headers=headers)
    assert r.status_code == 409
    assert r.json()["type"] == "urn:idem-asgi:problem:outcome-unknown"
    assert r.extensions["idempotency_attempts"] == 1
    assert shop.runs["k-unknown"] == 1


# (e) a caller-supplied key is used as-is, on every attempt
async def test_caller_supplied_key_is_used_as_is() -> None:
    shop = Shop()
    key = '"checkout-2024-05-01T10:00Z-9f2c"'  # the draft's quoted form goes out untouched
    async with InProcess(shop, ["lost", "refused"]) as c:
        r = await c.client.post("/payments", json={"amount": 7}, headers={"Idempotency-Key": key})
    assert r.extensions["idempotency_key"] == key
    assert c.faults.keys == [key, key, key]
    assert shop.keys_seen("/payments") == [key, key]  # the refused attempt never reached it
    bare = key.strip('"')
    assert shop.runs[bare] == 1 and was_replayed(r)
    assert r.content == await shop.stored_body(bare)


# (f) one key per logical call: minted once, reused by every attempt, never shared between calls
async def test_key_is_minted_once_per_logical_call() -> None:
    shop = Shop()
    async with InProcess(shop, ["lost", "refused", "ok", "lost"]) as c:
        one = await c.client.post("/payments", json={"amount": 1})
        two = await c.client.post("/payments", json={"amount": 1})
    k1, k2 = one.extensions["idempotency_key"], two.extensions["idempotency_key"]
    assert k1 != k2 and len(k1) == len(k2) == 32
    assert c.faults.keys == [k1, k1, k1, k2, k2]  # every attempt, as sent
    assert shop.keys_seen("/payments") == [k1, k1, k2, k2]  # every attempt, as the server saw it
    assert shop.runs == Counter({k1: 1, k2: 1})
    await assert_first_answer(shop, one, replayed=True)
    await assert_first_answer(shop, two, replayed=True)


async def test_a_streamed_body_is_read_once_and_resent_whole() -> None:
    shop = Shop()

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b'{"amount": ', b"4200", b"}"):
            yield part

    async with InProcess(shop, ["lost"]) as c:
        r = await c.client.post("/payments", content=chunks())
    await assert_first_answer(shop, r, replayed=True)
    assert shop.bodies == [b'{"amount": 4200}']


# (g) bounded time and attempts
async def test_total_timeout_bounds_retries_of_5xx() -> None:
    shop = Shop()
    async with InProcess(shop, total_timeout=0.6, max_attempts=1000, backoff_base=0.05, backoff_cap=0.1) as c:
        start = time.monotonic()
        r = await c.client.post("/broken", json={"amount": 1})
        elapsed = time.monotonic() - start
    assert r.status_code == 503
    assert elapsed < 0.6 + SLACK
    assert 2 <= r.extensions["idempotency_attempts"] < 1000
    assert len(set(shop.keys_seen("/broken"))) == 1


async def test_retry_after_beyond_the_deadline_gives_up_at_once() -> None:
    shop = Shop(FlakyStore(failures=100))  # 503 with Retry-After: 1, every time
    async with InProcess(shop, total_timeout=0.5) as c:
        start = time.monotonic()
        r = await c.client.post("/payments", json={"amount": 1})
        elapsed = time.monotonic() - start
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["type"] == "urn:idem-asgi:problem:store-unavailable"
    assert r.extensions["idempotency_attempts"] == 1
    assert elapsed < 0.5 + SLACK


async def test_total_timeout_cuts_off_a_hanging_attempt() -> None:
    shop = Shop()
    async with InProcess(shop, total_timeout=0.4) as c:
        start = time.monotonic()
        with pytest.raises(httpx.TimeoutException) as info:
            await c.client.post("/hang", json={"amount": 1})
        elapsed = time.monotonic() - start
    assert elapsed < 0.4 + SLACK
    key = info.value.request.headers["idempotency-key"]  # what the caller retries with later
    assert key in str(info.value)


async def test_max_attempts_bounds_attempts() -> None:
    shop = Shop()
    async with InProcess(shop, ["refused"] * 10, max_attempts=3) as c:
        with pytest.raises(httpx.ConnectError):
            await c.client.post("/payments", json={"amount": 1})
    assert len(c.faults.keys) == 3 and len(set(c.faults.keys)) == 1
    assert shop.seen == []


async def test_unprotected_methods_pass_through_untouched() -> None:
    shop = Shop()
    async with InProcess(shop, ["refused"]) as c:
        with pytest.raises(httpx.ConnectError):
            await c.client.get("/payments")
        r = await c.client.get("/payments")
    assert c.faults.keys == [None, None]  # no key minted, and not retried
    assert "idempotency_key" not in r.extensions


def test_settings_are_checked_up_front() -> None:
    for bad in ({"max_attempts": 0}, {"total_timeout": 0}, {"backoff_base": 2, "backoff_cap": 1}, {"header": ""}):
        with pytest.raises(ValueError):
            IdempotentRetryTransport(httpx.MockTransport(lambda r: httpx.Response(200)), **bad)


def test_httpx_is_only_needed_by_the_client() -> None:
    code = (
        "import sys\n"
        "import idem_asgi, idem_asgi.backends, idem_asgi.http.middleware\n"
        "assert 'httpx' not in sys.modules, 'the middleware imported httpx'\n"
        "sys.modules['httpx'] = None\n"
        "try:\n"
        "    import idem_asgi.client\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert 'pip install "idem-asgi[client]"' in out.stdout


# --------------------------------------------------------------------------------------------------
# Over TCP: real uvicorn on 127.0.0.1 behind the fault proxy, on a background thread
# --------------------------------------------------------------------------------------------------


class LiveServer:
    """uvicorn serving a Shop on loopback, a FaultProxy in front, both on their own thread's event loop.

    Always stopped by `__exit__`, even when the test failed.
    """

    def __init__(self, shop: Shop) -> None:
        self.shop = shop
        self.proxy: FaultProxy | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="live-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return f"http://127.0.0.1:{self.proxy.port}"

    def __enter__(self) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(timeout=20):
            self.__exit__(None, None, None)
            raise RuntimeError("uvicorn did not start within 20 s")
        if self._error is not None:
            self.__exit__(None, None, None)
            raise RuntimeError("uvicorn failed to start") from self._error
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout=20)
        assert not self._thread.is_alive(), "the uvicorn thread did not stop"

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        config = {"lifespan": "off", "ws": "none", "timeout_graceful_shutdown": 1}
        async with serving(self.shop, start_within=20, stop_within=15, **config) as url:
            self.proxy = FaultProxy(int(url.rsplit(":", 1)[1]))
            await self.proxy.start()
            try:
                self._ready.set()
                await self._stop.wait()
            finally:
                await self.proxy.stop()


@pytest.fixture
def live() -> Iterator[LiveServer]:
    with LiveServer(Shop()) as server:
        yield server


def _proxy(live: LiveServer) -> FaultProxy:
    assert live.proxy is not None
    return live.proxy


# (a) over TCP: the proxy loses the first response after uvicorn sent it
async def test_real_server_lost_response(live: LiveServer) -> None:
    _proxy(live).set_faults(lose=[1])
    transport = IdempotentRetryTransport(httpx.AsyncHTTPTransport(), **FAST)
    async with httpx.AsyncClient(transport=transport, base_url=live.url) as client:
        r = await client.post("/payments", json={"amount": 1230})
    assert _proxy(live).lost == 1
    key = await assert_first_answer(live.shop, r, replayed=True)
    assert live.shop.keys_seen("/payments") == [key, key]


# (b) over TCP: the client's read timeout fires while the handler still runs
async def test_real_server_read_timeout_while_running(live: LiveServer) -> None:
    transport = IdempotentRetryTransport(httpx.AsyncHTTPTransport(), **FAST)
    timeout = httpx.Timeout(10, read=0.2)
    async with httpx.AsyncClient(transport=transport, base_url=live.url, timeout=timeout) as client:
        r = await client.post("/slow", json={"amount": 5})
    key = await assert_first_answer(live.shop, r, replayed=True)
    assert r.extensions["idempotency_attempts"] == 3  # read timeout, 409 in progress, replay
    assert live.shop.keys_seen("/slow") == [key, key, key]


# (h) the sync transport, with a generator body and a lost response
def test_sync_transport_lost_response(live: LiveServer) -> None:
    _proxy(live).set_faults(lose=[1])

    def chunks() -> Iterator[bytes]:
        yield b'{"amount": '
        yield b"77}"

    transport = IdempotentRetrySyncTransport(httpx.HTTPTransport(), **FAST)
    with httpx.Client(transport=transport, base_url=live.url) as client:
        r = client.post("/payments", content=chunks())
        other = client.post("/payments", content=b'{"amount": 77}')
    key = r.extensions["idempotency_key"]
    assert r.status_code == 201 and was_replayed(r)
    assert r.content == asyncio.run(live.shop.stored_body(key))
    assert live.shop.keys_seen("/payments")[:2] == [key, key]
    assert live.shop.runs[key] == 1 and live.shop.bodies[0] == b'{"amount": 77}'
    assert other.extensions["idempotency_key"] != key  # a new logical call, a new key
    assert not was_replayed(other)


def test_sync_transport_waits_out_409_in_progress(live: LiveServer) -> None:
    transport = IdempotentRetrySyncTransport(httpx.HTTPTransport(), **FAST)
    with httpx.Client(transport=transport, base_url=live.url, timeout=httpx.Timeout(10, read=0.2)) as client:
        r = client.post("/slow", json={"amount": 5})
    assert r.status_code == 201 and was_replayed(r)
    assert r.extensions["idempotency_attempts"] == 3
    assert live.shop.runs[r.extensions["idempotency_key"]] == 1


# (g) the sync transport cannot cancel, so it caps every network timeout to the time left
def test_sync_total_timeout_against_a_silent_server(live: LiveServer) -> None:
    _proxy(live).set_faults(hang=range(1, 100))
    transport = IdempotentRetrySyncTransport(httpx.HTTPTransport(), total_timeout=0.5, **FAST)
    with httpx.Client(transport=transport, base_url=live.url, timeout=30) as client:
        start = time.monotonic()
        with pytest.raises(httpx.TimeoutException):
            client.post("/payments", json={"amount": 1})
        elapsed = time.monotonic() - start
    assert elapsed < 0.5 + SLACK
    assert live.shop.seen == []


async def test_a_retry_after_of_thousands_of_digits_is_a_long_wait_not_a_crash() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        headers = [(b"content-type", b"application/problem+json"), (b"retry-after", b"9" * 5000)]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": b'{"status": 503}'})

    transport = IdempotentRetryTransport(httpx.ASGITransport(app=app), total_timeout=0.5)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
        r = await client.post("/payments", json={"amount": 1})
    assert r.status_code == 503  # a day's wait is past the deadline: handed back at once, no ValueError
    assert r.extensions["idempotency_attempts"] == 1
