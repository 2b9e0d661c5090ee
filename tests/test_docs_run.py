"""Every python block of the docs pages runs as printed. A page reads top to bottom, so its blocks
run in order in one namespace (a later block may use what an earlier one defined), against the
real servers (host names substituted), with stand-ins only for the reader's own objects (their
app, payment provider, logger...). A block that imports or names anything else must do it itself.
The RabbitMQ and NATS consumers a page starts then get one message each and must apply it once.
(README.md, docs/production.md and the pages whose blocks each stand alone, `ALONE`, have tests of
their own.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import types
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aio_pika
import asyncpg
import nats
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette

from idem_asgi.backends import Backend
from idem_asgi.backends.redis import RedisBackend
from tests.support.servers import POSTGRES_DSN, REDIS_URL, ROOT, require
from tests.support.snippets import ALONE, bound_names, compile_snippet, python_blocks, undefined_names

AMQP = "amqp://guest:guest@127.0.0.1:5672/"
NATS = "nats://127.0.0.1:4222"
PAGES = [
    "client.md",
    "jobs.md",
    "operations.md",
    "outbox.md",
    "postgres.md",
    "problems.md",
    "redis.md",
    "testing.md",
    "webhooks.md",
]
HOSTS = {
    "redis://localhost:6379/0": REDIS_URL,
    "postgresql://app@db.internal:5432/shop": POSTGRES_DSN,
    "postgresql://app@db/shop": POSTGRES_DSN,
    "postgresql://app@db/payments": POSTGRES_DSN,
    "postgresql://app@db1:5432,db2:5432/payments?target_session_attrs=read-write": (
        "postgresql://postgres@127.0.0.1:5432,127.0.0.1:5432/test?target_session_attrs=read-write"
    ),
}
YOURS = {
    "app",  # your ASGI app (a FastAPI app here)
    "backend",  # your store, where a page has not built one yet
    "provider",  # your payment provider's client
    "fake_provider",
    "order_from",
    "handle",
    "send_welcome",
    "user_id",
    "channel",  # your aio-pika channel
    "ProviderUnavailable",
    "ledger",
    "dsn",
    "create_app",
}


class FakeProvider:
    """A payment provider that dedupes by idempotency key, as real ones do; counts its charges."""

    def __init__(self) -> None:
        self.charges: dict[str, SimpleNamespace] = {}

    async def charge(self, *order: Any, idempotency_key: str) -> SimpleNamespace:
        if idempotency_key not in self.charges:
            self.charges[idempotency_key] = SimpleNamespace(id=f"ch_{len(self.charges) + 1}", status="succeeded")
        return self.charges[idempotency_key]

    async def find_charge(self, *, idempotency_key: str) -> SimpleNamespace | None:
        return self.charges.get(idempotency_key)

    async def recent_idempotency_keys(self) -> list[str]:
        return list(self.charges)

    async def find_by_key(self, key: str) -> SimpleNamespace | None:
        return self.charges.get(key)

    async def get_charge(self, charge_id: str) -> SimpleNamespace | None:
        return next((c for c in self.charges.values() if c.id == charge_id), None)


async def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def stand_ins(provider: FakeProvider, backend: Backend) -> dict[str, Any]:
    return {
        "app": FastAPI(),
        "backend": backend,
        "provider": provider,
        "fake_provider": provider,
        "order_from": lambda body: json.loads(body),
        "handle": _nothing,
        "send_welcome": _nothing,
        "user_id": "u-1",
        "ProviderUnavailable": type("ProviderUnavailable", (Exception,), {}),
        "ledger": SimpleNamespace(record=_nothing),
        "dsn": POSTGRES_DSN,
        "create_app": FastAPI,
    }


def test_each_page_names_only_what_it_defines_imports_or_calls_yours() -> None:
    unknown = {}
    for page in PAGES:
        defined: set[str] = set()
        for line, code in python_blocks(ROOT / "docs" / page):
            missing = undefined_names(code) - defined - YOURS
            if missing:
                unknown[f"docs/{page}:{line}"] = sorted(missing)
            defined |= bound_names(code)
    assert unknown == {}


async def _until(condition: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
async def brokers() -> AsyncIterator[dict[str, Any]]:
    """An aio-pika channel for the page to use, and the broker objects the jobs page makes, removed after."""
    require("rabbitmq", AMQP)
    require("nats", NATS)
    connection = await aio_pika.connect_robust(AMQP)
    channel = await connection.channel()
    cleanup = await nats.connect(NATS)
    try:
        yield {"channel": channel}
    finally:
        js = cleanup.jetstream()
        for stream in ("PAYMENTS", "PAYMENTS_DEAD"):
            with contextlib.suppress(Exception):  # not made: the page failed before it
                await js.delete_stream(stream)
        async with connection.channel() as admin:
            await admin.queue_delete("payments")
        await cleanup.close()
        await connection.close()


def page_module(name: str, yours: dict[str, Any]) -> dict[str, Any]:
    """A real module for the page's code (type hints and Litestar look their globals up there)."""
    module = types.ModuleType(f"docs_page_{name}")
    sys.modules[module.__name__] = module
    module.__dict__.update(yours)
    return module.__dict__


async def run_page(page: str, namespace: dict[str, Any]) -> list[Backend]:
    """Run the page's blocks in order in `namespace`; returns every store they made (to close)."""
    made: list[Backend] = []
    for line, code in python_blocks(ROOT / "docs" / page):
        for old, new in HOSTS.items():
            code = code.replace(old, new)
        compiled = compile_snippet(code, f"docs/{page}:{line}")
        if "asyncio.run(" in code:  # a script of its own: its own event loop, in a thread
            await asyncio.to_thread(exec, compiled, namespace)
        else:
            outcome = eval(compiled, namespace)  # the page's own code
            if outcome is not None:
                await outcome
        made += [v for v in namespace.values() if isinstance(v, Backend) and not isinstance(v, type) and v not in made]
        for value in list(namespace.values()):
            if isinstance(value, Starlette):  # its middleware is built on the first request: build it now
                value.build_middleware_stack()
    return made


@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.parametrize("page", [p for p in PAGES if p != "jobs.md"])
async def test_the_page_runs_as_printed(
    page: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("STRIPE_WEBHOOK_SECRETS", "CLERK_WEBHOOK_SECRETS"):  # the reader's secrets
        monkeypatch.setenv(variable, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    require("redis", REDIS_URL)
    require("postgres", POSTGRES_DSN)
    admin = await asyncpg.connect(POSTGRES_DSN)
    await admin.execute("CREATE SCHEMA IF NOT EXISTS billing")  # postgres.md's own pool uses billing.*
    await admin.close()
    provider = FakeProvider()
    own = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{uuid.uuid4().hex}:")
    namespace = page_module(page[:-3], stand_ins(provider, own))
    made = await run_page(page, namespace)
    for store in made:
        await store.aclose()
    if page == "client.md":  # the page says what its script prints
        out = capsys.readouterr().out
        assert "charges: 2" in out and "replayed" in out, out


@pytest.mark.redis
@pytest.mark.postgres
async def test_the_jobs_page_runs_and_its_consumers_apply_each_message_once(brokers: dict[str, Any]) -> None:
    require("redis", REDIS_URL)
    require("postgres", POSTGRES_DSN)
    provider = FakeProvider()
    own = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{uuid.uuid4().hex}:")
    namespace = page_module("jobs", {**stand_ins(provider, own), "channel": brokers["channel"]})
    made = await run_page("jobs.md", namespace)
    run = uuid.uuid4().hex[:8]
    try:
        # The decorator: a second call is the stored Receipt, one charge.
        first = await namespace["charge"](f"o-{run}", 100)
        assert await namespace["charge"](f"o-{run}", 100) == first
        await namespace["welcome"](f"u-{run}")
        # RabbitMQ: one message on the page's queue, charged once under its message id.
        message = aio_pika.Message(b'{"amount": 100}', message_id=f"m-{run}")
        await brokers["channel"].default_exchange.publish(message, routing_key="payments")
        # NATS: one outbox message; both durables of the page apply it, each once.
        js = namespace["js"]
        await js.publish("payments.requested", b'{"id": "o-1", "amount": 100}', headers={"Nats-Msg-Id": f"ob-{run}"})

        async def applied() -> bool:
            keys = {f"m-{run}", f"ob-{run}", f"order-charge:ob-{run}"}
            return keys <= set(provider.charges)

        await _until(applied, 20)
        follow_up = await js.get_last_msg("PAYMENTS", "payments.charged")
        assert follow_up.headers is not None and follow_up.headers["Nats-Msg-Id"] == f"ob-{run}:charged"
        assert json.loads(follow_up.data or b"{}")["charge"] == provider.charges[f"order-charge:ob-{run}"].id
    finally:
        await namespace["nc"].close()
        for store in made:
            await store.aclose()
    logging.getLogger(__name__).info("charges: %s", sorted(provider.charges))


def test_the_pages_listed_are_all_pages_with_python_blocks() -> None:
    with_code = {p.name for p in (ROOT / "docs").glob("*.md") if python_blocks(p)}
    assert with_code == {*PAGES, *ALONE, "production.md"}, with_code
    assert all(isinstance(p, str) and Path(ROOT / "docs" / p).exists() for p in PAGES)
