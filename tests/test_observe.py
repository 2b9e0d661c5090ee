"""The observer hook sees every decision; the ready-made observers turn events into counts, logs, metrics and spans."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import MemoryBackend
from idem_asgi.claims.leases import grace
from idem_asgi.errors import BackendUnavailable
from idem_asgi.http.fingerprint import RawBody
from idem_asgi.observe import Counters, Event, LogObserver, fan_out, otel_observer, prometheus_observer
from idem_asgi.records import ClaimResult, RecordKey

pytestmark = pytest.mark.memory


def app_answering(status: int = 201, delay: float = 0.0, raises: bool = False) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await asyncio.sleep(delay)
        if raises:
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"done"})

    return app


def client(app: Any, observer: Any, backend: Any = None, **policy: Any) -> httpx.AsyncClient:
    mw = IdempotencyMiddleware(
        app,
        backend=MemoryBackend() if backend is None else backend,
        routes=[RoutePolicy("/pay", single_tenant=True, **policy)],
        observer=observer,
    )
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=mw, raise_app_exceptions=False), base_url="http://t")


async def test_a_storm_is_counted_claim_by_claim() -> None:
    counts = Counters()
    async with client(app_answering(delay=0.05), counts) as c:
        await asyncio.gather(*[c.post("/pay", content=b"x", headers={"Idempotency-Key": "k"}) for _ in range(30)])
        await c.post("/pay", content=b"x", headers={"Idempotency-Key": "k"})
        await c.post("/pay", content=b"y", headers={"Idempotency-Key": "k"})
        await c.post("/pay", content=b"x", headers={"Idempotency-Key": "bad key"})
    assert counts["claimed"] == 1 and counts["completed"] == 1
    assert counts["conflict"] + counts["replayed"] == 30
    assert counts["mismatch"] == 1 and counts["rejected"] == 1
    assert counts.by_route["/pay", "claimed"] == 1


async def test_release_is_observed_for_exceptions_and_5xx() -> None:
    counts = Counters()
    async with client(app_answering(raises=True), counts) as c:
        await c.post("/pay", headers={"Idempotency-Key": "a"})
    async with client(app_answering(status=503), counts) as c:
        await c.post("/pay", headers={"Idempotency-Key": "b"})
    assert counts["released"] == 2 and counts["completed"] == 0


async def test_lease_renewal_is_observed() -> None:
    counts = Counters()
    async with client(app_answering(delay=0.5), counts, lease=0.15) as c:
        await c.post("/pay", headers={"Idempotency-Key": "slow"})
    assert counts["lease_extended"] >= 2


class DownOnce(MemoryBackend):
    """Our own protocol, failing its first claim as an unreachable store would."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        if not self.failed:
            self.failed = True
            raise BackendUnavailable("store down")
        return await super().claim(key, fingerprint, lease=lease, ttl=ttl)


async def test_store_errors_are_observed() -> None:
    counts = Counters()
    async with client(app_answering(), counts, backend=DownOnce()) as c:
        first = await c.post("/pay", headers={"Idempotency-Key": "k"})
        second = await c.post("/pay", headers={"Idempotency-Key": "k"})
    assert (first.status_code, second.status_code) == (503, 201)
    assert counts["store_error"] == 1 and counts["claimed"] == 1


async def test_expired_lease_outcomes_are_observed() -> None:
    counts = Counters()
    backend = MemoryBackend()
    rkey = RecordKey.build("idem", None, "dead")
    scope = {"method": "POST", "path": "/pay", "query_string": b"", "headers": []}
    fingerprint = RawBody().begin(scope).digest()
    await backend.claim(rkey, fingerprint, lease=0.05, ttl=60)  # a holder that died
    await asyncio.sleep(0.1)
    async with client(app_answering(), counts, backend=backend, lease=0.05) as c:
        seen = await c.post("/pay", headers={"Idempotency-Key": "dead"})  # first sighting: it may renew yet
        assert seen.status_code == 409 and counts["conflict"] == 1 and counts["expired"] == 0
        await asyncio.sleep(grace(0.05))
        r = await c.post("/pay", headers={"Idempotency-Key": "dead"})
    assert r.status_code == 409 and counts["expired"] == 1 and counts["outcome_unknown"] == 1


async def test_an_observer_that_raises_never_fails_a_request() -> None:
    def broken(event: Event) -> None:
        raise ValueError("metrics backend down")

    async with client(app_answering(), broken) as c:
        r = await c.post("/pay", headers={"Idempotency-Key": "k"})
    assert r.status_code == 201


async def test_log_observer_writes_structured_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="idem_asgi.events")
    async with client(app_answering(), LogObserver()) as c:
        await c.post("/pay", headers={"Idempotency-Key": "k"})
        await c.post("/pay", headers={"Idempotency-Key": "k"})
    fields = [vars(r) for r in caplog.records if hasattr(r, "idem_event")]  # the `extra` of each record
    events = [(f["idem_event"], f["idem_key"], f["idem_route"]) for f in fields]
    assert events == [("claimed", "k", "/pay"), ("completed", "k", "/pay"), ("replayed", "k", "/pay")]


async def test_prometheus_counter_counts_events() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    async with client(app_answering(), prometheus_observer(registry)) as c:
        await c.post("/pay", headers={"Idempotency-Key": "k"})
        await c.post("/pay", headers={"Idempotency-Key": "k"})
    value = registry.get_sample_value("idem_asgi_events_total", {"event": "replayed", "route": "/pay"})
    assert value == 1.0


async def test_otel_observer_annotates_the_current_span() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    counts = Counters()
    inner = client(app_answering(), fan_out(otel_observer(), counts))
    async with inner as c:
        with tracer.start_as_current_span("request"):
            await c.post("/pay", headers={"Idempotency-Key": "k"})
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["idempotency.key"] == "k" and span.attributes["idempotency.route"] == "/pay"
    assert [e.name for e in span.events] == ["idempotency.claimed", "idempotency.completed"]
    assert counts["claimed"] == 1


async def test_reclaimed_lease_is_observed_as_recovered() -> None:
    counts = Counters()
    backend = MemoryBackend()
    scope = {"method": "POST", "path": "/pay", "query_string": b"", "headers": []}
    await backend.claim(RecordKey.build("idem", None, "dead"), RawBody().begin(scope).digest(), lease=0.05, ttl=60)
    await asyncio.sleep(0.1)
    async with client(app_answering(), counts, backend=backend, on_expired="reclaim", lease=0.05) as c:
        assert (await c.post("/pay", headers={"Idempotency-Key": "dead"})).status_code == 409  # first sighting
        await asyncio.sleep(grace(0.05))
        r = await c.post("/pay", headers={"Idempotency-Key": "dead"})
    assert r.status_code == 201
    assert (counts["expired"], counts["recovered"], counts["claimed"], counts["completed"]) == (1, 1, 1, 1)


async def test_stored_or_released_is_visible_per_answer() -> None:
    """A final error (402 declined card) is stored and replayed; a transient one (503) is released:
    observers see which, with the status, and Prometheus counts it by answer and status."""
    from prometheus_client import CollectorRegistry

    seen: list[Event] = []
    registry = CollectorRegistry()
    observer = fan_out(seen.append, prometheus_observer(registry))
    async with client(app_answering(status=402), observer) as c:
        declined = await c.post("/pay", headers={"Idempotency-Key": "card"})
        again = await c.post("/pay", headers={"Idempotency-Key": "card"})
    async with client(app_answering(status=503), observer) as c:
        await c.post("/pay", headers={"Idempotency-Key": "busy"})
    assert declined.status_code == 402 and again.headers["idempotent-replayed"] == "true"
    answers = [(e.answer, e.status) for e in seen if e.answer is not None]
    assert answers == [("stored", 402), ("released", 503)]
    sample = registry.get_sample_value
    assert sample("idem_asgi_answers_total", {"route": "/pay", "answer": "stored", "status": "402"}) == 1.0
    assert sample("idem_asgi_answers_total", {"route": "/pay", "answer": "released", "status": "503"}) == 1.0
