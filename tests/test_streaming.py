"""Streaming: the first client gets chunks as they are made; the replay is the same bytes, verbatim."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import ASGIApp, Message, Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.http import problems
from idem_asgi.records import COMPLETED, IN_PROGRESS, RecordKey
from tests.support.asgi import Result, drive, http_scope, read_body
from tests.support.problems import assert_problem

KEY = "stream-1"
BODY = b'{"report":"q3"}'


def protect(app: ASGIApp, backend: Backend, namespace: str, **policy: Any) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], single_tenant=True, **policy)],
    )


def rk(namespace: str) -> RecordKey:
    return RecordKey.build(namespace, None, KEY)


async def test_streaming_app_reaches_the_first_client_chunk_by_chunk(backend: Backend, namespace: str) -> None:
    parts = [b"alpha,", b"beta,", b"gamma,", b"delta"]
    client = Result()
    seen_by_client: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/csv")]})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})
            seen_by_client.append(len(client.chunks))  # what the client holds while the app still runs
            await asyncio.sleep(0.01)

    mw = protect(app, backend, namespace)
    await drive(mw, http_scope(key=KEY), [BODY], result=client)

    # Every chunk but the last was already at the client when the app moved on; the last one is
    # held only while the completion is written.
    assert seen_by_client == [1, 2, 3, 4]
    assert client.chunks == parts
    assert [m["more_body"] for m in client.messages[1:]] == [True, True, True, False]


async def test_first_chunk_arrives_before_the_app_finishes(backend: Backend, namespace: str) -> None:
    first_chunk_seen = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"head", "more_body": True})
        # Deadlocks (and times out) unless the middleware forwarded the first chunk already.
        await asyncio.wait_for(first_chunk_seen.wait(), 2)
        await send({"type": "http.response.body", "body": b"tail", "more_body": False})

    def on_send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body") == b"head":
            first_chunk_seen.set()

    mw = protect(app, backend, namespace)
    result = await drive(mw, http_scope(key=KEY), [BODY], on_send=on_send)
    assert result.chunks == [b"head", b"tail"]


async def test_replay_is_byte_identical_with_headers_in_order(backend: Backend, namespace: str) -> None:
    body = bytes(range(256)) * 8 + b"\r\n\x00end"
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"x-trace", b"b"),
        (b"Vary", b"Accept"),
        (b"x-trace", b"a"),
        (b"content-length", str(len(body)).encode()),
        (b"vary", b"Accept-Encoding"),
        (b"x-trace", b"c"),
    ]
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        calls += 1
        await read_body(receive)
        await send({"type": "http.response.start", "status": 202, "headers": headers})
        for i in range(0, len(body), 500):
            await send({"type": "http.response.body", "body": body[i : i + 500], "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    mw = protect(app, backend, namespace)
    first = await drive(mw, http_scope(key=KEY), [BODY])
    replay = await drive(mw, http_scope(key=KEY), [BODY])

    assert calls == 1
    assert first.headers == headers and first.body == body
    assert replay.status == 202
    assert replay.headers == [*headers, (b"idempotent-replayed", b"true")]
    assert replay.body == body


async def test_replay_keeps_content_length_over_http(backend: Backend, namespace: str) -> None:
    async def handler(request: Request) -> Response:
        await request.body()
        return Response(json.dumps({"id": "ch_1", "amount": 12.30}).encode(), 201, media_type="application/json")

    mw = protect(Starlette(routes=[Route("/payments", handler, methods=["POST"])]), backend, namespace)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://test") as client:
        first = await client.post("/payments", content=BODY, headers={"Idempotency-Key": KEY})
        replay = await client.post("/payments", content=BODY, headers={"Idempotency-Key": KEY})

    assert replay.content == first.content == b'{"id": "ch_1", "amount": 12.3}'
    assert replay.headers["content-length"] == first.headers["content-length"] == str(len(first.content))
    assert "transfer-encoding" not in replay.headers
    assert list(replay.headers.items())[:-1] == list(first.headers.items())


async def test_body_over_max_stored_body_reaches_first_client_whole(backend: Backend, namespace: str) -> None:
    parts = [bytes([i]) * 50 for i in range(5)]  # 250 bytes, limit 100
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        calls += 1
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    mw = protect(app, backend, namespace, max_stored_body=100)
    first = await drive(mw, http_scope(key=KEY), [BODY])
    repeats = [await drive(mw, http_scope(key=KEY), [BODY]) for _ in range(2)]

    assert first.status == 200 and first.chunks == parts
    for repeat in repeats:
        doc = json.loads(repeat.body)
        assert repeat.status == 409 and doc["type"] == problems.NOT_STORED.type
        assert repeat.header("cache-control") == b"no-store"
        assert repeat.header("content-type") == b"application/problem+json"
    assert calls == 1
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == COMPLETED
    assert record.response is not None and record.response.replayable is False and record.response.body == b""


async def test_app_raising_after_starting_its_response_leaves_no_completed_record_and_never_runs_again(
    backend: Backend, namespace: str
) -> None:
    calls = 0

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal calls
        calls += 1
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial ", "more_body": True})
        raise RuntimeError("generator failed mid-stream")

    mw = protect(app, backend, namespace)
    with pytest.raises(RuntimeError, match="mid-stream"):
        await drive(mw, http_scope(key=KEY), [BODY])
    record = await backend.get(rk(namespace))
    assert record is not None and record.state == IN_PROGRESS and record.response is None  # no partial body kept
    assert record.holder_failed

    retry = await drive(mw, http_scope(key=KEY), [BODY])

    assert calls == 1  # the 200 had started: the operation may have happened, so it never runs again
    assert_problem(retry, problems.OUTCOME_UNKNOWN)


async def test_background_task_does_not_delay_storing(backend: Backend, namespace: str) -> None:
    finish_background = asyncio.Event()
    background_done: list[bool] = []
    executions = 0

    async def send_receipt_email() -> None:
        await asyncio.wait_for(finish_background.wait(), 5)
        background_done.append(True)

    async def handler(request: Request) -> Response:
        nonlocal executions
        executions += 1
        await request.body()
        return Response(b"charged", 201, background=BackgroundTask(send_receipt_email))

    mw = protect(Starlette(routes=[Route("/payments", handler, methods=["POST"])]), backend, namespace)
    answered = asyncio.Event()

    def on_send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            answered.set()

    first = asyncio.ensure_future(drive(mw, http_scope(key=KEY), [BODY], on_send=on_send))
    try:
        await asyncio.wait_for(answered.wait(), 5)
        assert not first.done() and not background_done  # the background task is still running

        retry = await drive(mw, http_scope(key=KEY), [BODY])

        assert retry.status == 201 and retry.body == b"charged"
        assert retry.header("idempotent-replayed") == b"true"
        assert executions == 1
        finish_background.set()
        assert (await first).body == b"charged"
    finally:
        finish_background.set()
        with contextlib.suppress(Exception):
            await first
    assert background_done == [True]
