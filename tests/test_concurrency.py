"""Through the middleware, on every store: however many duplicates race, the handler runs once per key."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import httpx

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.http import problems
from tests.support.asgi import read_body


class Counted:
    """Counts executions per key; each answer carries its own execution number."""

    def __init__(self) -> None:
        self.executions: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        key = dict(scope["headers"])[b"idempotency-key"].decode()
        self.executions[key] += 1
        await asyncio.sleep(0.02)  # long enough for duplicates to arrive while it runs
        payload = json.dumps({"key": key, "run": self.executions[key], "body": body.decode()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def protect(app: Counted, backend: Backend, namespace: str) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app, backend=backend, namespace=namespace, routes=[RoutePolicy("/payments", single_tenant=True)]
    )


async def fire(client: httpx.AsyncClient, key: str, delay: float) -> httpx.Response:
    await asyncio.sleep(delay)
    return await client.post("/payments", content=f'{{"for":"{key}"}}', headers={"Idempotency-Key": key})


def check_one_key(responses: list[httpx.Response]) -> None:
    """Exactly one original answer; every other is a 409 in-progress or a byte-identical replay."""
    originals = [r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    assert len(originals) == 1, [r.status_code for r in responses]
    original = originals[0]
    for r in responses:
        if r is original:
            continue
        if r.status_code == 409:
            assert r.json()["type"] == problems.IN_PROGRESS.type
        else:
            assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
            assert r.content == original.content
            assert list(r.headers.items())[:-1] == list(original.headers.items())


async def test_hundred_concurrent_requests_with_one_key_run_once(backend: Backend, namespace: str) -> None:
    app = Counted()
    mw = protect(app, backend, namespace)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://test") as client:
        # Half start together, half trickle in while and after the first runs.
        delays = [0.0] * 50 + [random.uniform(0, 0.1) for _ in range(50)]
        responses = await asyncio.gather(*[fire(client, "only-key", d) for d in delays])

    assert app.executions == Counter({"only-key": 1})
    check_one_key(list(responses))
    assert any(r.status_code == 409 for r in responses)


async def test_fifty_keys_ten_duplicates_shuffled_run_fifty_times(backend: Backend, namespace: str) -> None:
    app = Counted()
    mw = protect(app, backend, namespace)
    keys = [f"order-{i}" for i in range(50) for _ in range(10)]
    random.shuffle(keys)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://test") as client:
        responses = await asyncio.gather(*[fire(client, k, random.uniform(0, 0.05)) for k in keys])

    assert sum(app.executions.values()) == 50
    assert set(app.executions.values()) == {1}
    by_key: dict[str, list[httpx.Response]] = {}
    for key, response in zip(keys, responses, strict=True):
        by_key.setdefault(key, []).append(response)
    for key, group in by_key.items():
        check_one_key(group)
        assert all(json.loads(r.content)["key"] == key for r in group if r.status_code == 201)
