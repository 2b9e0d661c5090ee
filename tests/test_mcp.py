"""`IdempotentTools`: an MCP server built with the official `mcp` SDK, served by uvicorn, called by
the SDK's own client and by raw JSON-RPC over HTTP, on every store. A retried `tools/call` runs
once; every retry gets the first result under its own request id; refusals are JSON-RPC errors
carrying the HTTP middleware's problem; everything that is not a protected `tools/call` reaches
the app as it was sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, cast

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import InputRequiredResult

from idem_asgi._types import Message, Scope
from idem_asgi.backends import Backend, MemoryBackend
from idem_asgi.errors import BackendMisconfigured, BackendUnavailable
from idem_asgi.http import problems
from idem_asgi.http.keys import scope_from_header
from idem_asgi.jobs import current_job
from idem_asgi.mcp import CODES, IdempotentTools
from idem_asgi.records import ClaimResult, RecordKey
from tests.support.asgi import StartupFailed, lifespan
from tests.support.servers import POSTGRES_DSN, ROOT, require, serving
from tests.support.stores import Delegating

MODERN = "2026-07-28"
RUNS: Counter[str] = Counter()
"""How many times each order's tool body ran (orders are unique per test)."""
GATES: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
"""Set by a test to let a `slow` call finish."""
STARTED: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)
"""Set by a `slow` call once it runs."""
PROTECTED = {"charge", "slow", "crash", "crash_after_effect", "refuse", "confirm"}


def mcp_server() -> MCPServer:
    """The SDK's server, with a tool for each way a call can end."""
    server = MCPServer("idem-test")

    @server.tool()
    async def charge(order: str, amount: int, ctx: Context) -> dict[str, Any]:
        """Charge once; a progress notification first (it commits an SSE answer when asked for progress)."""
        RUNS[order] += 1
        await ctx.report_progress(1, 2)
        await asyncio.sleep(0.05)
        job = current_job()
        return {"order": order, "amount": amount, "charge": uuid.uuid4().hex, "held": job and job.key.key}

    @server.tool()
    async def slow(order: str) -> str:
        RUNS[order] += 1
        STARTED[order].set()
        await GATES[order].wait()
        return f"done {order}"

    @server.tool()
    async def crash(order: str) -> str:
        RUNS[order] += 1
        raise RuntimeError("the provider timed out")

    @server.tool()
    async def crash_after_effect(order: str) -> str:
        RUNS[order] += 1
        job = current_job()
        assert job is not None
        job.mark_effect()
        raise RuntimeError("failed after the charge")

    @server.tool()
    async def refuse(order: str) -> str:
        RUNS[order] += 1
        raise MCPError(code=-32602, message="no such order")

    @server.tool()
    async def confirm(order: str) -> str | InputRequiredResult:
        """Asks the client for input on its first run (2026-07-28): the client calls again."""
        RUNS[order] += 1
        return InputRequiredResult(request_state=f"asked-{order}") if RUNS[order] == 1 else f"confirmed {order}"

    @server.tool()
    async def lookup(order: str) -> str:
        RUNS[order] += 1
        return f"looked up {order} ({RUNS[order]})"

    return server


def routed(inner: Any, backend: Backend) -> Callable[..., Awaitable[None]]:
    """One app, three wrappers of it by path prefix: `/h` (header key, wait 10 s), `/m` (`_meta`
    key, wait 10 s), `/z` (header key required, wait 0)."""
    space = uuid.uuid4().hex
    wrappers = {
        "/h": IdempotentTools(inner, backend, tools=PROTECTED, namespace=f"mcp-h-{space}", wait=10),
        "/m": IdempotentTools(inner, backend, key="meta", tools=PROTECTED, namespace=f"mcp-m-{space}", wait=10),
        "/z": IdempotentTools(inner, backend, tools=PROTECTED, namespace=f"mcp-z-{space}", required=True),
    }

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await wrappers["/h"](scope, receive, send)
            return
        prefix, path = scope["path"][:2], scope["path"][2:]
        await wrappers[prefix]({**scope, "path": path, "raw_path": path.encode()}, receive, send)

    return app


@pytest.fixture(params=[True, False], ids=["json", "sse"])
def json_response(request: pytest.FixtureRequest) -> bool:
    """The server's answer mode: `application/json`, or an SSE stream (`text/event-stream`)."""
    return bool(request.param)


@pytest.fixture
async def url(backend: Backend, json_response: bool) -> AsyncIterator[str]:
    """The routed server on every store, in both answer modes."""
    async with serving(routed(mcp_server().streamable_http_app(json_response=json_response), backend)) as base:
        yield base


@pytest.fixture
async def surl(backend: Backend) -> AsyncIterator[str]:
    """The routed server on every store, in SSE mode (a call answers with an SSE stream when its
    tool streams, `application/json` when it does not)."""
    async with serving(routed(mcp_server().streamable_http_app(json_response=False), backend)) as base:
        yield base


@pytest.fixture
async def murl() -> AsyncIterator[str]:
    """The routed server in SSE mode on the memory store."""
    async with serving(routed(mcp_server().streamable_http_app(json_response=False), MemoryBackend())) as base:
        yield base


ENVELOPE: Final[dict[str, Any]] = {
    "io.modelcontextprotocol/protocolVersion": MODERN,
    "io.modelcontextprotocol/clientCapabilities": {},
}
"""The `_meta` members every 2026-07-28 request carries."""


def tool_call(
    rid: str | int, tool: str, arguments: dict[str, Any], meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A 2026-07-28 `tools/call` request, with a progress token (the SSE server then streams)."""
    params = {"name": tool, "arguments": arguments, "_meta": {**ENVELOPE, "progressToken": f"p-{rid}", **(meta or {})}}
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": params}


def headers(method: str, name: str | None = None, key: str | None = None, **more: str) -> dict[str, str]:
    found = {"accept": "application/json, text/event-stream", "content-type": "application/json"}
    found |= {"mcp-protocol-version": MODERN, "mcp-method": method} | ({"mcp-name": name} if name else {})
    return found | ({"idempotency-key": key} if key else {}) | more


def messages(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of an answer: its JSON body, or each SSE event's data."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return [response.json()]
    found = []
    for event in response.text.replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[5:].lstrip(" ") for line in event.split("\n") if line.startswith("data:"))
        if data:
            found.append(json.loads(data))
    return found


def answer_to(response: httpx.Response, rid: str | int) -> dict[str, Any]:
    """The one response (result or error) of an answer, checked to be for `rid`, of the same JSON type."""
    answers = [m for m in messages(response) if "result" in m or "error" in m]
    assert len(answers) == 1, response.text
    found: dict[str, Any] = answers[0]
    assert found["id"] == rid and type(found["id"]) is type(rid), (found["id"], rid)
    return found


async def call(
    http: httpx.AsyncClient, base: str, rid: str | int, tool: str, arguments: dict[str, Any], **kw: Any
) -> tuple[httpx.Response, dict[str, Any]]:
    """POST one `tools/call` under `base` (`/h`, `/m`, `/z` + its url); the response (of HTTP status
    `status=`, 200 unless told) and its answer."""
    meta, status = kw.pop("meta", None), kw.pop("status", 200)
    response = await http.post(
        f"{base}/mcp", json=tool_call(rid, tool, arguments, meta), headers=headers("tools/call", tool, **kw)
    )
    assert response.status_code == status, response.text
    return response, answer_to(response, rid)


def error_of(answer: dict[str, Any], problem: problems.ProblemType) -> dict[str, Any]:
    """The answer's `error`, checked to be `problem`'s: its code, and the problem as `error.data`."""
    error: dict[str, Any] = answer["error"]
    assert error["code"] == CODES[problem.slug]
    data = error["data"]
    assert (data["type"], data["title"], data["status"]) == (problem.type, problem.title, problem.status)
    assert data["detail"]
    return error


@contextlib.asynccontextmanager
async def sdk(url: str, *, key: str | None = None, mode: str = "auto") -> AsyncIterator[Client]:
    """The SDK's client (its own session), sending `key` as the Idempotency-Key header of every request."""
    async with (
        httpx2.AsyncClient(headers={"Idempotency-Key": key} if key else None, timeout=30) as http,
        Client(streamable_http_client(url, http_client=http), mode=mode) as client,
    ):
        yield client


def orders(n: int) -> list[str]:
    return [f"o-{uuid.uuid4().hex[:12]}" for _ in range(n)]


# -- storms ----------------------------------------------------------------------------------------


async def test_a_storm_of_raw_retries_runs_each_call_once_and_answers_each_retry_under_its_own_id(
    url: str, json_response: bool
) -> None:
    """20 keys x 10 concurrent retries, each its own request id (ints and strings): one run per key,
    every retry the first result under its own id; the first answer is the app's own (an SSE stream
    with its progress notification on the SSE server), the nine others replays."""
    keys = {order: f"key-{order}" for order in orders(20)}
    ids = iter(range(1000))

    async def retry(http: httpx.AsyncClient, order: str) -> tuple[str, httpx.Response, dict[str, Any]]:
        n = next(ids)
        rid: str | int = n if n % 2 else f"req-{n}"
        response, answer = await call(http, f"{url}/h", rid, "charge", {"order": order, "amount": 5}, key=keys[order])
        return order, response, answer

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as http:
        done = await asyncio.gather(*(retry(http, order) for order in keys for _ in range(10)))

    assert {order: RUNS[order] for order in keys} == dict.fromkeys(keys, 1)
    for order, key in keys.items():
        mine = [(response, answer) for o, response, answer in done if o == order]
        results = {json.dumps(answer["result"], sort_keys=True) for _, answer in mine}
        assert len(results) == 1, "every retry got the first result"
        first = [r for r, _ in mine if r.headers.get("idempotent-replayed") is None]
        assert len(first) == 1 and len(mine) == 10
        kind = "application/json" if json_response else "text/event-stream"
        assert first[0].headers["content-type"].startswith(kind)
        if not json_response:
            assert any(m.get("method") == "notifications/progress" for m in messages(first[0]))
        for response, _ in mine:
            if response is not first[0]:
                assert response.headers["idempotent-replayed"] == "true"
                assert response.headers["content-type"] == "application/json"
        text = mine[0][1]["result"]["content"][0]["text"]
        assert json.loads(text)["held"] == key, "the tool ran holding the claim (current_job())"


async def test_a_storm_of_sdk_sessions_runs_each_call_once(backend: Backend) -> None:
    """5 keys x 10 concurrent client sessions of the SDK (half of them on the 2025 handshake
    protocol, whose answers are SSE streams here, half on 2026-07-28), the key in a header: each
    key's tool ran once, every session got the same result. (The SDK client checks that each answer
    is for its own request id; the raw storm above checks it on the wire.)"""
    keys = {order: f"sdk-{order}" for order in orders(5)}

    async def session(url: str, order: str, n: int) -> tuple[str, str]:
        async with sdk(f"{url}/h/mcp", key=keys[order], mode="legacy" if n % 2 else "auto") as client:
            result = await client.call_tool("charge", {"order": order, "amount": 7})
        assert not result.is_error
        text = result.content[0].text  # type: ignore[union-attr]
        return order, text

    async with serving(routed(mcp_server().streamable_http_app(json_response=False), backend)) as url:
        done = await asyncio.gather(*(session(url, order, n) for order in keys for n in range(10)))
    assert {order: RUNS[order] for order in keys} == dict.fromkeys(keys, 1)
    for order, key in keys.items():
        texts = {text for o, text in done if o == order}
        assert len(texts) == 1
        assert json.loads(texts.pop())["held"] == key


# -- refusals --------------------------------------------------------------------------------------


async def test_the_same_key_for_another_call_is_a_mismatch_error(surl: str) -> None:
    order = orders(1)[0]
    async with httpx.AsyncClient(timeout=30) as http:
        _, first = await call(http, f"{surl}/h", 1, "charge", {"order": order, "amount": 5}, key=f"k-{order}")
        assert "result" in first
        _, other = await call(http, f"{surl}/h", 2, "charge", {"order": order, "amount": 6}, key=f"k-{order}")
        _, tool = await call(http, f"{surl}/h", "3", "lookup", {"order": order}, key=f"k-{order}")
        _, again = await call(http, f"{surl}/h", "4", "slow", {"order": order}, key=f"k-{order}")
    error_of(other, problems.FINGERPRINT_MISMATCH)
    assert "result" in tool, "an unprotected tool never reads the key"
    error_of(again, problems.FINGERPRINT_MISMATCH)
    assert RUNS[order] == 2  # charge once, lookup once


async def test_a_repeat_while_the_first_runs_gets_in_progress_then_the_result(surl: str) -> None:
    order = orders(1)[0]
    async with httpx.AsyncClient(timeout=30) as http:
        first = asyncio.ensure_future(call(http, f"{surl}/z", 1, "slow", {"order": order}, key=f"k-{order}"))
        await STARTED[order].wait()
        _, running = await call(http, f"{surl}/z", 2, "slow", {"order": order}, key=f"k-{order}")
        error = error_of(running, problems.IN_PROGRESS)
        assert error["data"]["retry_after"] == 1
        GATES[order].set()
        _, answer = await first
        response, later = await call(http, f"{surl}/z", "3", "slow", {"order": order}, key=f"k-{order}")
    assert later["result"] == answer["result"] and response.headers["idempotent-replayed"] == "true"
    assert RUNS[order] == 1


# -- how a first call ends -------------------------------------------------------------------------


async def test_a_protocol_error_or_a_failed_tool_releases_and_a_failure_after_the_effect_is_kept(surl: str) -> None:
    """A JSON-RPC error from the app and an `isError` result store nothing: the retry runs again.
    A tool that marked its effect before failing keeps its claim: the retry gets outcome-unknown."""
    refused, crashed, charged = orders(3)
    async with httpx.AsyncClient(timeout=30) as http:
        for rid in (1, 2):
            # (the 2026-07-28 transport answers -32602 with HTTP 400, passed on as the app sent it)
            _, answer = await call(http, f"{surl}/h", rid, "refuse", {"order": refused}, key=f"k-{refused}", status=400)
            assert answer["error"]["code"] == -32602 and answer["error"]["message"] == "no such order"
            _, answer = await call(http, f"{surl}/h", rid, "crash", {"order": crashed}, key=f"k-{crashed}")
            assert answer["result"]["isError"] is True
        _, answer = await call(http, f"{surl}/h", 1, "crash_after_effect", {"order": charged}, key=f"k-{charged}")
        assert answer["result"]["isError"] is True
        _, answer = await call(http, f"{surl}/h", 2, "crash_after_effect", {"order": charged}, key=f"k-{charged}")
        error_of(answer, problems.OUTCOME_UNKNOWN)
    assert (RUNS[refused], RUNS[crashed], RUNS[charged]) == (2, 2, 1)


async def test_a_transport_refusal_and_a_request_for_input_release_the_key(murl: str) -> None:
    """An answer that is no result for the call (the transport's 406 for a bad Accept, before any
    tool ran) and a result asking for input (`resultType: input_required`, to which the client
    answers by calling again) store nothing: the next call with the key runs. Its final result is
    stored."""
    refused, asked = orders(2)
    async with httpx.AsyncClient(timeout=30) as http:
        body = tool_call(1, "charge", {"order": refused, "amount": 1})
        more = headers("tools/call", "charge", key=f"k-{refused}", accept="text/html")
        assert (await http.post(f"{murl}/z/mcp", json=body, headers=more)).status_code == 406
        _, answer = await call(http, f"{murl}/z", 2, "charge", {"order": refused, "amount": 1}, key=f"k-{refused}")
        assert "result" in answer
        _, first = await call(http, f"{murl}/z", 1, "confirm", {"order": asked}, key=f"k-{asked}")
        assert first["result"]["resultType"] == "input_required"
        _, second = await call(http, f"{murl}/z", 2, "confirm", {"order": asked}, key=f"k-{asked}")
        response, third = await call(http, f"{murl}/z", 3, "confirm", {"order": asked}, key=f"k-{asked}")
    assert second["result"]["content"][0]["text"] == f"confirmed {asked}"
    assert third["result"] == second["result"] and response.headers["idempotent-replayed"] == "true"
    assert (RUNS[refused], RUNS[asked]) == (1, 2)


async def test_a_call_cut_by_its_client_is_kept_to_its_lease_never_run_again(backend: Backend) -> None:
    """On the SSE server the SDK cancels a tool whose client went away: its claim is kept (the tool
    may have had its effect), so a retry gets in-progress, not a second run."""
    order = orders(1)[0]
    app = routed(mcp_server().streamable_http_app(json_response=False), backend)
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        first = asyncio.ensure_future(call(http, f"{base}/z", 1, "slow", {"order": order}, key=f"k-{order}"))
        await STARTED[order].wait()
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.2)
        _, retry = await call(http, f"{base}/z", 2, "slow", {"order": order}, key=f"k-{order}")
    error_of(retry, problems.IN_PROGRESS)
    assert RUNS[order] == 1


# -- keys ------------------------------------------------------------------------------------------


async def test_the_key_can_come_from_params_meta(murl: str) -> None:
    """`key="meta"`: the SDK client's `call_tool(..., meta=...)` carries it; a header is not read."""
    order, other = orders(2)
    results = []
    for _ in range(3):
        async with sdk(f"{murl}/m/mcp") as client:
            result = await client.call_tool(
                "charge", {"order": order, "amount": 1}, meta=cast(Any, {"idempotency_key": order})
            )
            results.append(result.content[0].text)  # type: ignore[union-attr]
            await client.call_tool("charge", {"order": other, "amount": 1})
        async with sdk(f"{murl}/m/mcp", key=f"k-{other}") as client:
            await client.call_tool("charge", {"order": other, "amount": 1})
    assert len(set(results)) == 1 and json.loads(results[0])["held"] == order
    assert (RUNS[order], RUNS[other]) == (1, 6)


async def test_a_missing_or_malformed_key_is_refused_where_required(murl: str) -> None:
    order = orders(1)[0]
    async with httpx.AsyncClient(timeout=30) as http:
        _, missing = await call(http, f"{murl}/z", 1, "charge", {"order": order, "amount": 1})
        _, bad = await call(http, f"{murl}/z", 2, "charge", {"order": order, "amount": 1}, key="two words")
        _, optional = await call(http, f"{murl}/h", 3, "charge", {"order": order, "amount": 1})
        _, unprotected = await call(http, f"{murl}/z", 4, "lookup", {"order": order})
    error_of(missing, problems.KEY_REQUIRED)
    error_of(bad, problems.KEY_MALFORMED)
    assert "result" in optional and "result" in unprotected
    assert RUNS[order] == 2


async def test_a_store_that_cannot_claim_is_a_store_unavailable_error_and_nothing_runs() -> None:
    class Down(Delegating):
        async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
            raise BackendUnavailable("connection refused")

    order = orders(1)[0]
    app = routed(mcp_server().streamable_http_app(json_response=True), Down(MemoryBackend()))
    async with serving(app) as base, httpx.AsyncClient(timeout=30) as http:
        _, answer = await call(http, f"{base}/h", 1, "charge", {"order": order, "amount": 1}, key=f"k-{order}")
    assert error_of(answer, problems.STORE_UNAVAILABLE)["data"]["retry_after"] == 1
    assert RUNS[order] == 0


class Misconfigured(Delegating):
    """A store that refuses this app (no rights on its table): its start-up check and its claims
    raise `BackendMisconfigured`."""

    async def check(self) -> None:
        raise BackendMisconfigured("permission denied for table idem_records")

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        raise BackendMisconfigured("permission denied for table idem_records")


@pytest.fixture(params=["fake", pytest.param("postgres", marks=pytest.mark.postgres)])
async def misconfigured(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """A store that can never serve this app: the fake above, or a Postgres whose database does not exist."""
    if request.param == "fake":
        yield Misconfigured(MemoryBackend())
        return
    from idem_asgi.backends.postgres import PostgresBackend

    require("postgres", POSTGRES_DSN)
    backend = PostgresBackend.from_dsn(
        POSTGRES_DSN.rsplit("/", 1)[0] + "/no_such_database_idem", min_size=1, max_size=1
    )
    try:
        yield backend
    finally:
        await backend.aclose()


async def test_a_store_that_refuses_this_app_fails_the_lifespan_start_up(misconfigured: Backend) -> None:
    """The store is checked once the app has started, as the middleware does: a store that can
    never work fails the start-up (a store that can serve starts and stops)."""
    async with lifespan(IdempotentTools(mcp_server().streamable_http_app(), MemoryBackend())):
        pass
    with pytest.raises(StartupFailed, match="the idempotency store refuses this app"):
        async with lifespan(IdempotentTools(mcp_server().streamable_http_app(), misconfigured)):
            pass


async def test_a_store_that_refuses_this_app_is_a_store_misconfigured_error_and_nothing_runs() -> None:
    """Served anyway (a server without lifespan): each protected call is refused with
    store-misconfigured, with no retry_after (retrying will not help), and the tool never runs.
    (The fake store only: a Postgres without its database takes 10 s to close after a claim.)"""
    order = orders(1)[0]
    app = IdempotentTools(
        mcp_server().streamable_http_app(json_response=True), Misconfigured(MemoryBackend()), tools=PROTECTED
    )
    async with serving(app, lifespan="off") as base, httpx.AsyncClient(timeout=30) as http:
        for rid in (1, 2):
            _, answer = await call(http, base, rid, "charge", {"order": order, "amount": 1}, key=f"k-{order}")
            assert "retry_after" not in error_of(answer, problems.STORE_MISCONFIGURED)["data"]
    assert RUNS[order] == 0


def tenant_of(scope: Scope) -> str | None:
    """The `x-tenant` header a gateway sets; None without one."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-tenant"), None)


async def test_a_scope_gives_each_tenant_its_own_run_and_replay_of_the_same_key(backend: Backend) -> None:
    """`scope=`: two tenants sending the same key are two calls, each run once; each tenant's
    retry replays its own tenant's result. A call the scope callable names nobody for is refused
    with scope-required, one whose scope cannot be an owner with scope-malformed; neither runs."""
    order = orders(1)[0]
    args, key = {"order": order, "amount": 5}, f"k-{order}"
    namespace = f"mcp-s-{uuid.uuid4().hex}"
    by_header = IdempotentTools(
        mcp_server().streamable_http_app(json_response=True), backend, namespace=namespace, scope=tenant_of
    )
    first: dict[str, Any] = {}
    async with serving(by_header) as base, httpx.AsyncClient(timeout=30) as http:
        for rid, tenant in enumerate(("acme", "globex")):
            response, answer = await call(http, base, rid, "charge", args, key=key, **{"x-tenant": tenant})
            assert "idempotent-replayed" not in response.headers
            first[tenant] = answer["result"]
        for rid, tenant in enumerate(("globex", "acme"), start=10):
            response, answer = await call(http, base, rid, "charge", args, key=key, **{"x-tenant": tenant})
            assert response.headers["idempotent-replayed"] == "true"
            assert answer["result"] == first[tenant], tenant
        _, nobody = await call(http, base, 20, "charge", args, key=key)
    assert RUNS[order] == 2, "one run per tenant"
    assert first["acme"] != first["globex"]
    assert error_of(nobody, problems.SCOPE_REQUIRED)["data"]["type"].endswith("scope-required")

    strict = IdempotentTools(
        mcp_server().streamable_http_app(json_response=True),
        backend,
        namespace=namespace,
        scope=scope_from_header("x-tenant"),
    )
    async with serving(strict) as base, httpx.AsyncClient(timeout=30) as http:
        twice = [*headers("tools/call", "charge", key=key).items(), ("x-tenant", "acme"), ("x-tenant", "globex")]
        response = await http.post(f"{base}/mcp", json=tool_call(21, "charge", args), headers=twice)
    error_of(answer_to(response, 21), problems.SCOPE_MALFORMED)
    assert RUNS[order] == 2


# -- replays ---------------------------------------------------------------------------------------


async def test_a_replay_is_an_sse_event_when_only_sse_is_accepted_and_carries_the_session_id(murl: str) -> None:
    order = orders(1)[0]
    async with httpx.AsyncClient(timeout=30) as http:
        _, first = await call(http, f"{murl}/h", 1, "charge", {"order": order, "amount": 1}, key=f"k-{order}")
        more = {"accept": "text/event-stream", "mcp-session-id": "s-123"}
        response = await http.post(
            f"{murl}/h/mcp",
            json=tool_call("again", "charge", {"order": order, "amount": 1}),
            headers=headers("tools/call", "charge", key=f"k-{order}", **more),
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["mcp-session-id"] == "s-123" and response.headers["idempotent-replayed"] == "true"
    assert response.text.startswith("event: message\r\ndata: ")
    assert answer_to(response, "again")["result"] == first["result"]


@pytest.mark.parametrize("stateless", [False, True], ids=["sessions", "stateless"])
async def test_the_claim_reaches_the_tool_on_both_protocols(stateless: bool) -> None:
    """`current_job()` inside the tool holds the call's claim on the 2026-07-28 single exchange
    and on the 2025 handshake protocol, with sessions and without (the SDK carries the request's
    context to the task that runs the tool)."""
    app = mcp_server().streamable_http_app(json_response=False, stateless_http=stateless)
    async with serving(routed(app, MemoryBackend())) as base:
        for mode in ("auto", "legacy"):
            order = orders(1)[0]
            async with sdk(f"{base}/h/mcp", key=f"k-{order}", mode=mode) as client:
                result = await client.call_tool("charge", {"order": order, "amount": 1})
            assert json.loads(result.content[0].text)["held"] == f"k-{order}", mode  # type: ignore[union-attr]


# -- what passes through ---------------------------------------------------------------------------


async def test_everything_but_a_protected_tool_call_reaches_the_app_as_sent() -> None:
    """Bodies that are not one `tools/call` request (other methods, notifications, batches, bad
    JSON, a null id), a body in chunks and other HTTP methods reach the app as the very messages
    the server received, and the app's answer goes back unchanged, key header or not."""
    seen: list[list[dict[str, Any]]] = []

    async def echo(scope: Any, receive: Any, send: Any) -> None:
        got = [await receive()]
        while got[-1].get("more_body"):
            got.append(await receive())
        seen.append(got)
        await send({"type": "http.response.start", "status": 207, "headers": [(b"x-echo", b"1")]})
        await send({"type": "http.response.body", "body": b"".join(m.get("body", b"") for m in got)})

    app = IdempotentTools(echo, MemoryBackend(), required=True)
    bodies = [
        b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{}}',
        b'{"jsonrpc":"2.0","id":2,"method":"initialize","params":{"protocolVersion":"2025-11-25"}}',
        b'{"jsonrpc":"2.0","method":"notifications/initialized"}',
        b'[{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"charge"}}]',
        b'{"jsonrpc":"2.0","id":4,"method":"tools/call"',
        b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":"charge","arguments":{}}}',
        b'{"jsonrpc": "2.0", "id": null, "method": "tools/call", "params": {"name": "charge"}}',
    ]
    requests: list[tuple[str, list[Message]]] = [
        ("POST", [{"type": "http.request", "body": body, "more_body": False}]) for body in bodies
    ]
    parts = [b'{"jsonrpc":"2.0","id":5,', b'"method":"tools/list"}', b""]
    chunked: list[Message] = [{"type": "http.request", "body": part, "more_body": part != b""} for part in parts]
    requests += [("POST", chunked), ("GET", [{"type": "http.request"}]), ("DELETE", [{"type": "http.request"}])]
    for method, sent in requests:
        pending = [dict(m) for m in sent]
        answered: list[Message] = []

        async def receive() -> Message:
            return pending.pop(0)  # noqa: B023

        async def send(message: Message) -> None:
            answered.append(message)  # noqa: B023

        scope = {"type": "http", "method": method, "path": "/mcp", "headers": [(b"idempotency-key", b"same")]}
        await app(scope, receive, send)
        assert seen[-1] == sent, method
        assert answered[0] == {"type": "http.response.start", "status": 207, "headers": [(b"x-echo", b"1")]}
        assert answered[1]["body"] == b"".join(m.get("body", b"") for m in sent)
    assert len(seen) == len(requests)


async def test_other_methods_of_the_real_server_are_untouched(murl: str) -> None:
    """`server/discover`, `tools/list` and an unprotected tool answer as without the wrapper,
    each time they are sent with the same key: never replayed, never refused."""
    order = orders(1)[0]
    async with httpx.AsyncClient(timeout=30) as http:
        for rid in (1, 2):
            for method in ("server/discover", "tools/list"):
                meta = {
                    "io.modelcontextprotocol/protocolVersion": MODERN,
                    "io.modelcontextprotocol/clientCapabilities": {},
                }
                body = {"jsonrpc": "2.0", "id": rid, "method": method, "params": {"_meta": meta}}
                response = await http.post(f"{murl}/z/mcp", json=body, headers=headers(method, key="same-key"))
                assert "idempotent-replayed" not in response.headers
                assert "result" in answer_to(response, rid)
            response, answer = await call(http, f"{murl}/z", rid, "lookup", {"order": order}, key="same-key")
            assert answer["result"]["content"][0]["text"] == f"looked up {order} ({rid})"
            assert "idempotent-replayed" not in response.headers


async def test_a_body_over_max_body_passes_through_unprotected_and_byte_identical() -> None:
    """A `tools/call` body larger than `max_body` is not read for a key: the app gets the very
    messages sent (those read before the limit, then the rest), answers as it would, and runs on
    every retry. A body of exactly `max_body` is still protected: its retry is replayed."""
    seen: list[list[Message]] = []

    async def tool_app(scope: Any, receive: Any, send: Any) -> None:
        got = [await receive()]
        while got[-1].get("more_body"):
            got.append(await receive())
        seen.append(got)
        rid = json.loads(b"".join(m.get("body", b"") for m in got))["id"]
        result = {"content": [{"type": "text", "text": f"run {len(seen)}"}], "isError": False}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send(
            {"type": "http.response.body", "body": json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()}
        )

    def body(rid: int) -> bytes:
        return json.dumps(tool_call(rid, "charge", {"order": "o-big", "amount": 1, "note": "x" * 2000})).encode()

    size = len(body(1))
    assert len(body(2)) == size
    for limit, protected in ((size, True), (size - 1, False), (size // 3, False)):
        app = IdempotentTools(tool_app, MemoryBackend(), max_body=limit)
        seen.clear()
        answers = []
        for rid in (1, 2):
            data = body(rid)
            sent: list[Message] = [
                {"type": "http.request", "body": data[i : i + 500], "more_body": i + 500 < len(data)}
                for i in range(0, len(data), 500)
            ]
            pending = [dict(m) for m in sent]
            answered: list[Message] = []

            async def receive() -> Message:
                return pending.pop(0)  # noqa: B023

            async def send(message: Message) -> None:
                answered.append(message)  # noqa: B023

            scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": [(b"idempotency-key", b"k-big")]}
            await app(scope, receive, send)
            if not protected or rid == 1:
                assert seen[-1] == sent, (limit, rid)
            answers.append(answered)
        assert len(seen) == (1 if protected else 2), limit
        replayed = [(b"idempotent-replayed", b"true") in a[0]["headers"] for a in answers]
        assert replayed == [False, protected], limit
        assert json.loads(answers[1][1]["body"])["result"]["content"][0]["text"] == f"run {len(seen)}"


async def test_the_scope_is_asked_only_for_keyed_calls_and_an_empty_or_failing_one_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As on HTTP: a call without a key passes through whoever calls (its scope is not asked); an
    empty tenant is nobody (`scope-required`), not a shared tenant ""; a scope callable that raises
    is `scope-malformed`, its message logged redacted, never a 500 with the credential."""
    runs: list[int] = []

    async def tool_app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        rid = json.loads(message["body"])["id"]
        runs.append(rid)
        result = {"content": [{"type": "text", "text": f"run {len(runs)}"}], "isError": False}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send(
            {"type": "http.response.body", "body": json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}).encode()}
        )

    def tenant(scope: Any) -> str | None:
        headers = dict(scope["headers"])
        if b"authorization" in headers:
            raise KeyError(headers[b"authorization"].decode())
        value = headers.get(b"x-tenant")
        return None if value is None else value.decode()

    app = IdempotentTools(tool_app, MemoryBackend(), scope=tenant)

    async def post(rid: int, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
        answered: list[Message] = []
        body = json.dumps(tool_call(rid, "charge", {"order": "o-1"})).encode()

        async def receive() -> Message:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Message) -> None:
            answered.append(message)

        await app({"type": "http", "method": "POST", "path": "/mcp", "headers": list(headers)}, receive, send)
        return dict(json.loads(answered[1]["body"]))

    assert "result" in await post(1) and runs == [1], "no key, no tenant: passes through unprotected"
    empty = await post(2, (b"idempotency-key", b"k-1"), (b"x-tenant", b""))
    assert empty["error"]["code"] == CODES["scope-required"] and runs == [1]
    with caplog.at_level("ERROR", logger="idem_asgi"):
        failing = await post(3, (b"idempotency-key", b"k-1"), (b"authorization", b"Bearer sk_live_secret_123456"))
    assert failing["error"]["code"] == CODES["scope-malformed"] and runs == [1]
    assert "scope callable raised KeyError" in caplog.text and "sk_live_secret_123456" not in caplog.text


# -- the docs page's example -----------------------------------------------------------------------


def test_the_docs_example_runs() -> None:
    """docs/mcp_example.py, included in docs/mcp.md, runs and shows one charge for three calls."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "mcp_example.py")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "charges made: 1"
