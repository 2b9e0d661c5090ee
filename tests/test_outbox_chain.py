"""An HTTP payment, its outbox message, and a consumer on RabbitMQ or NATS: each payment's event is
applied exactly once and none is lost, with the API, a relay or the consumer SIGKILLed at each point
of the chain (tests/outbox_chain.py holds the three processes and their crash points).

Each cell runs the API (uvicorn), two relays (one leads, one stands by) and a consumer as
processes a supervisor restarts when they die; eight payments are retried by their clients until
they get an answer. Then: one ledger row per payment, one applied row per payment's event, nothing
left unsent, and the named process did die by SIGKILL at its point.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from idem_asgi.backends import PostgresBackend
from idem_asgi.outbox import Outbox
from tests.support.servers import POSTGRES_DSN, free_port, require

ROOT = Path(__file__).resolve().parent.parent
AMQP = os.environ.get("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")
PAYMENTS = 8
POINTS = [
    ("app", "app_before_commit", 3),
    ("app", "app_after_commit", 3),
    ("relay", "relay_before_publish", 3),
    ("relay", "relay_after_publish", 3),
    ("consumer", "consumer_before_commit", 2),
    ("consumer", "consumer_after_commit", 2),
    ("consumer", "consumer_after_store", 2),
]


class Supervisor:
    """Runs the chain's processes and starts again any that exits (as a deploy's orchestrator would)."""

    def __init__(self, config: dict[str, Any], env: dict[str, str], logs: Path) -> None:
        self.config = config
        self.env = env
        self.logs = logs
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.exits: dict[str, list[int]] = {}
        self._task: asyncio.Task[None] | None = None

    async def _start(self, name: str) -> None:
        role = name.split("-")[0]
        out = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.outbox_chain", role, json.dumps(self.config),
            cwd=ROOT, env=self.env, stdout=out, stderr=out,
        )  # fmt: skip
        out.close()

    async def __aenter__(self) -> Supervisor:
        for name in ("app", "relay-1", "relay-2", "consumer"):
            await self._start(name)
        self._task = asyncio.create_task(self._watch())
        return self

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            for name, proc in list(self.procs.items()):
                if proc.returncode is not None:
                    self.exits.setdefault(name.split("-")[0], []).append(proc.returncode)
                    await self._start(name)

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def pay(client: httpx.AsyncClient, url: str, key: str, deadline: float) -> int:
    """POST one payment until it has an answer (201, or 409 outcome-unknown after a crash past its
    COMMIT); the API being down, restarting or still holding the claim is retried."""
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            r = await client.post(url, json={"amount": 500}, headers={"Idempotency-Key": key})
        except httpx.TransportError:
            await asyncio.sleep(0.2)
            continue
        if r.status_code == 201 or (r.status_code == 409 and r.json()["type"].endswith("outcome-unknown")):
            return r.status_code
        last = f"{r.status_code} {r.text}"
        await asyncio.sleep(0.3)
    raise AssertionError(f"payment {key} got no final answer in time; the last: {last}")


@contextlib.asynccontextmanager
async def broker(kind: str, tag: str, subject: str) -> AsyncIterator[dict[str, Any]]:
    """A queue (RabbitMQ) or a stream and durable consumer (NATS) for this cell, removed afterwards."""
    if kind == "rabbitmq":
        import aio_pika

        connection = await aio_pika.connect(AMQP)
        channel = await connection.channel()
        await channel.declare_queue(subject, durable=True)
        try:
            yield {"broker_url": AMQP}
        finally:
            await channel.queue_delete(subject)
            await connection.close()
        return
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

    nc = await nats.connect(NATS)
    js = nc.jetstream()
    stream = f"CHAIN{tag}"
    # A short duplicate window: a relay's republish after its crash reaches the consumer, whose
    # record (keyed by Nats-Msg-Id) must absorb it, instead of the stream dropping it first.
    await js.add_stream(StreamConfig(name=stream, subjects=[subject], duplicate_window=0.2))
    await js.add_consumer(stream, ConsumerConfig(durable_name="applier", ack_policy=AckPolicy.EXPLICIT, ack_wait=3))
    try:
        yield {"broker_url": NATS, "stream": stream, "durable": "applier"}
    finally:
        await js.delete_stream(stream)
        await nc.close()


@pytest.mark.parametrize("kind", ["rabbitmq", "nats"])
@pytest.mark.parametrize(("role", "point", "nth"), POINTS, ids=[p[1] for p in POINTS])
async def test_each_payment_event_is_applied_once_with_a_sigkill_at(
    kind: str, role: str, point: str, nth: int, tmp_path: Path
) -> None:
    require("postgres", POSTGRES_DSN)
    require(kind, AMQP if kind == "rabbitmq" else NATS)
    tag = uuid.uuid4().hex[:8]
    subject = f"chain.{tag}" if kind == "nats" else f"chain-{tag}"
    config: dict[str, Any] = {
        "dsn": POSTGRES_DSN,
        "broker": kind,
        "records": f"chain_{tag}",
        "consumer_records": f"chain_{tag}_consumer",
        "ledger": f"chain_{tag}_ledger",
        "applied": f"chain_{tag}_applied",
        "subject": subject,
        "port": free_port(),
    }
    db = await asyncpg.connect(POSTGRES_DSN)
    made = [config["ledger"], config["applied"]]
    await db.execute(f"CREATE TABLE {config['ledger']} (key text NOT NULL, amount int NOT NULL)")  # no unique: a
    await db.execute(f"CREATE TABLE {config['applied']} (msg_id text NOT NULL, payment text NOT NULL)")  # 2nd shows
    store = PostgresBackend.from_dsn(POSTGRES_DSN, table=config["records"], min_size=1, max_size=2)
    await store.setup()
    outbox = Outbox(store)
    await outbox.setup()
    mark = tmp_path / "died"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IDEM_DIE_AT": point, "IDEM_DIE_MARK": str(mark)}
    env["IDEM_DIE_NTH"] = str(nth)
    try:
        async with broker(kind, tag, subject) as found:
            config.update(found)
            async with Supervisor(config, env, tmp_path) as supervisor, httpx.AsyncClient(timeout=10) as client:
                url = f"http://127.0.0.1:{config['port']}/pay"
                keys = [f"pay-{tag}-{i}" for i in range(PAYMENTS)]
                deadline = time.monotonic() + 60
                answers = await asyncio.gather(*(pay(client, url, key, deadline) for key in keys))
                applied: dict[str, int] = {}
                while time.monotonic() < deadline:
                    rows = await db.fetch(f"SELECT payment, count(*) FROM {config['applied']} GROUP BY payment")
                    applied = {row[0]: row[1] for row in rows}
                    if len(applied) == PAYMENTS and (await outbox.backlog()).unsent == 0:
                        break
                    await asyncio.sleep(0.2)
                await asyncio.sleep(4)  # redeliveries still under way (ack_wait, leases) land now or never
                exits = dict(supervisor.exits)
        rows = await db.fetch(f"SELECT key, count(*) FROM {config['ledger']} GROUP BY key")
        ledger = {row[0]: row[1] for row in rows}
        rows = await db.fetch(f"SELECT payment, count(*) FROM {config['applied']} GROUP BY payment")
        applied = {row[0]: row[1] for row in rows}
        backlog = await outbox.backlog()
    finally:
        with contextlib.suppress(Exception):
            await store.aclose()
        for table in [*made, config["records"], config["consumer_records"], f"{config['records']}_outbox"]:
            await db.execute(f"DROP TABLE IF EXISTS {table}")
        await db.close()
    assert mark.exists(), f"nothing reached {point}"
    assert -9 in exits.get(role, []), f"the {role} did not die by SIGKILL at {point}: {exits}"
    assert ledger == dict.fromkeys(keys, 1), "each payment charged once"
    assert applied == dict.fromkeys(keys, 1), f"each payment's event applied once, none lost ({answers}, {exits})"
    assert backlog.unsent == 0
