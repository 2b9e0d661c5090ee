"""Each framework, wired the way its users add middleware, keeps the whole contract."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from idem_asgi.testing import FAULTS, storm
from tests.framework_apps import FRAMEWORKS

pytestmark = pytest.mark.memory


class App:
    def __init__(self, name: str) -> None:
        self.counts: Counter[str] = Counter()
        self.background: list[str] = []
        self.asgi = FRAMEWORKS[name](self.counts, self.background)
        transport = httpx.ASGITransport(app=self.asgi, raise_app_exceptions=False)
        self.client = httpx.AsyncClient(transport=transport, base_url="http://test")

    async def post(self, path: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key is not None else {}
        return await self.client.post(path, headers=headers, **kwargs)


@pytest.fixture(params=sorted(FRAMEWORKS))
async def app(request: pytest.FixtureRequest) -> AsyncIterator[App]:
    a = App(request.param)
    async with a.client:
        yield a


async def test_protected_route_replays_byte_identical(app: App) -> None:
    first = await app.post("/payments", "k1", json={"amount": 1230})
    second = await app.post("/payments", "k1", json={"amount": 1230})
    assert first.status_code == second.status_code == 201
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert app.counts["payments"] == 1


async def test_handler_reads_the_key(app: App) -> None:
    r = await app.post("/payments", "read-me", json={})
    assert r.json()["key"] == "read-me"


async def test_unprotected_route_is_untouched(app: App) -> None:
    await app.post("/free", "k1")
    r = await app.post("/free", "k1")
    assert app.counts["free"] == 2 and "idempotent-replayed" not in r.headers


async def test_missing_required_key_is_400(app: App) -> None:
    r = await app.post("/payments", json={})
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:idem-asgi:problem:key-required"
    assert app.counts["payments"] == 0


async def test_other_body_same_key_is_422(app: App) -> None:
    await app.post("/payments", "k1", json={"amount": 1})
    r = await app.post("/payments", "k1", json={"amount": 2})
    assert r.status_code == 422 and app.counts["payments"] == 1


async def test_repeat_while_running_is_409(app: App) -> None:
    first, second = await asyncio.gather(app.post("/slow", "k1"), _after(0.05, app.post("/slow", "k1")))
    assert first.status_code == 200 and second.status_code == 409
    assert second.headers["retry-after"] == "1"
    assert app.counts["slow"] == 1


async def test_streaming_response_replays_byte_identical(app: App) -> None:
    first = await app.post("/stream", "s1")
    second = await app.post("/stream", "s1")
    assert first.status_code == 200 and first.content.count(b"chunk-") == 3
    assert second.content == first.content and app.counts["stream"] == 1


async def test_handler_that_raises_releases_the_key(app: App) -> None:
    first = await app.post("/boom", "b1")
    second = await app.post("/boom", "b1")
    assert first.status_code == second.status_code == 500
    assert app.counts["boom"] == 2  # released: the retry ran again


async def test_background_task_runs_and_replay_skips_it(app: App) -> None:
    first = await app.post("/bg", "g1")
    second = await app.post("/bg", "g1")
    assert second.content == first.content and second.headers["idempotent-replayed"] == "true"
    await asyncio.sleep(0.05)  # Falcon runs scheduled tasks after the response, as its own task
    assert app.background == ["ran"] and app.counts["bg"] == 1


async def test_large_chunked_body_reaches_the_handler_whole(app: App) -> None:
    payload = json.dumps({"blob": "x" * 600_000}).encode()

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 65_536):
            yield payload[i : i + 65_536]

    first = await app.post("/payments", "big", content=chunked())
    second = await app.post("/payments", "big", content=payload)
    assert first.status_code == 201 and first.json()["size"] == len(payload)
    assert second.content == first.content and app.counts["payments"] == 1


async def test_storm_plugin_finds_no_double_execution(app: App) -> None:
    """idem_asgi.testing's storm, every fault included, against the framework's /payments."""
    report = await storm(app.asgi, path="/payments", json={"amount": 1230}, probe=lambda: app.counts["payments"])
    report.assert_ok()
    assert [k.scenario for k in report.keys] == ["storm", *FAULTS]
    assert all(n == 1 for n in report.executions.values()), report.executions


async def _after(delay: float, coro: Any) -> Any:
    await asyncio.sleep(delay)
    return await coro
