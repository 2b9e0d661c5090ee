"""docs/operations.md's worked example, end to end, on Redis and Postgres: a worker is SIGKILLed
mid-payment (after the charge, before its answer is stored), its retries get 409, and one
`idem-asgi resolve` command (after `inspect` showed the token) stores the answer the provider
confirmed; every retry then replays it, the payment ran once, and `inspect` shows the key's history:
the dead worker's claim, the refused retry, who resolved it, the replays.

`stuck_payment` stages the crash; tests/test_admin_browser.py resolves the same key through the
admin page instead."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.crash_app import launch, make_store
from tests.support.scorecard import Ledger, PostgresLedger, RedisLedger, cleanup_store, http_post
from tests.support.servers import POSTGRES_DSN, REDIS_URL, UvicornProcess, require
from tests.support.stores import SHARED

pytestmark = pytest.mark.slow

TABLE = "idem_reliability_records"
LEASE = 1.0
CHARGE = b'{"charge":"ch_from_provider","status":"succeeded"}'
KEY_SECRET = "worked-example-secret-0123456789abcdef"


async def idem_asgi(*argv: str) -> tuple[int, str, str]:
    """The console command, as an operator runs it (`python -m idem_asgi`, its own process)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idem_asgi", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@dataclass
class Stuck:
    """A payment whose worker was SIGKILLed after the charge: its key, where its record is, and a live worker."""

    kind: str
    url: str
    namespace: str
    key: str
    store: list[str]  # the CLI's options naming the store
    fresh: UvicornProcess
    ledger: Ledger
    servers: list[UvicornProcess] = field(default_factory=list)


@asynccontextmanager
async def stuck_payment(kind: str, tmp_path: Path) -> AsyncIterator[Stuck]:
    """Two uvicorn workers on one store that keeps histories; the first is SIGKILLed mid-payment and
    the retry on the second gets 409 (nobody knows whether the card was charged)."""
    url = REDIS_URL if kind == "redis" else POSTGRES_DSN
    require(kind, url)
    run = uuid.uuid4().hex[:12]
    namespace = f"ops-{run}"
    ledger: Ledger = RedisLedger(REDIS_URL, run) if kind == "redis" else PostgresLedger(POSTGRES_DSN, run)
    env = {
        **os.environ,
        "IDEM_CRASH_BACKEND": url,
        "IDEM_CRASH_NAMESPACE": namespace,
        "IDEM_CRASH_TABLE": TABLE,
        "IDEM_CRASH_LEDGER": url,
        "IDEM_CRASH_RUN": run,
        "IDEM_CRASH_LEASE": str(LEASE),
        "IDEM_CRASH_TTL": "120",
        "IDEM_CRASH_DELAY": "0.02",
        "IDEM_CRASH_POOL": "2",
        "IDEM_CRASH_AFTER": "1",
        "IDEM_CRASH_HISTORY": "16",
        # keys sealed in the record, so `stale` and the admin page list the stuck claim by its key
        "IDEM_ASGI_KEY_SECRET": KEY_SECRET,
    }
    store = ["--backend", url, "--prefix", f"idem-rel:{namespace}:", "--table", TABLE]
    key = f"pay-{run}"
    servers: list[UvicornProcess] = []
    try:
        await ledger.setup()
        if kind == "postgres":
            made = make_store(url, namespace=namespace, table=TABLE, pool=1)
            await made.setup()  # type: ignore[attr-defined]
            await made.aclose()
        crashing = launch({**env, "IDEM_CRASH_POINT": "mid_handler"}, tmp_path / "crashing.log")
        servers.append(crashing)
        fresh = launch({**env, "IDEM_CRASH_POINT": "none"}, tmp_path / "fresh.log")
        servers.append(fresh)
        await asyncio.gather(crashing.wait_ready(), fresh.wait_ready())

        lost = await http_post(crashing.port, key, timeout=10)  # the worker dies mid-payment
        assert lost.status == 0 and await crashing.wait_dead(10) == -9
        await asyncio.sleep(LEASE + 0.3)
        blocked = await http_post(fresh.port, key)
        assert blocked.status == 409, blocked.outcome  # nobody knows whether the card was charged
        yield Stuck(kind, url, namespace, key, store, fresh, ledger, servers)
    finally:
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))
        try:
            await ledger.cleanup()
            await cleanup_store(kind, namespace, TABLE)
        finally:
            await ledger.aclose()


def steps_by_name(history: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for step in history:
        found.setdefault(step["what"], []).append(step)
    return found


def assert_the_history_shows_every_step(history: list[dict[str, Any]], token: str, by: str) -> None:
    """The dead worker's claim (its token), the refused retry, the resolution (by whom), the 3 replays."""
    steps = steps_by_name(history)
    assert [s["token"] for s in steps["claimed"]] == [token[:8]], history
    assert sum(s["n"] for s in steps["conflict"]) >= 1, history
    (resolved,) = steps["resolved"]
    assert resolved["status"] == 201 and by in resolved["by"], resolved
    assert sum(s["n"] for s in steps["replayed"]) == 3, history
    order = [s["what"] for s in history]
    assert order.index("claimed") < order.index("conflict") < order.index("resolved") < order.index("replayed"), order


async def history_of(stuck: Stuck, *, until: str, within: float = 5.0) -> list[dict[str, Any]]:
    """The key's history as `idem-asgi inspect --json` prints it, once it holds `until`'s count of replays."""
    deadline = time.monotonic() + within
    while True:
        code, out, err = await idem_asgi(*stuck.store, "inspect", stuck.key, "--namespace", stuck.namespace, "--json")
        assert code == 0, err
        history: list[dict[str, Any]] = json.loads(out)["history"]
        replays = sum(s["n"] for s in history if s["what"] == "replayed")
        if (until != "replayed" or replays >= 3) or time.monotonic() > deadline:
            return history
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("kind", SHARED)
async def test_a_sigkilled_workers_key_is_resolved_with_one_command(kind: str, tmp_path: Path) -> None:
    async with stuck_payment(kind, tmp_path) as stuck:
        code, out, err = await idem_asgi(*stuck.store, "inspect", stuck.key, "--namespace", stuck.namespace, "--json")
        assert code == 0, err
        record = json.loads(out)
        assert record["state"] == "in_progress"
        body = tmp_path / "charge.json"
        body.write_bytes(CHARGE)
        # The provider, asked by the same key, says it charged: store that answer.
        code, out, err = await idem_asgi(
            *stuck.store,
            "resolve",
            stuck.key,
            "--namespace",
            stuck.namespace,
            "--token",
            str(record["token"]),
            "--older-than",
            "0",
            "--status",
            "201",
            "--header",
            "content-type: application/json",
            "--body-file",
            str(body),
        )
        assert (code, err) == (0, ""), out
        assert out.strip().endswith("stored the 201 answer: retries replay it")

        for _ in range(3):
            replay = await http_post(stuck.fresh.port, stuck.key)
            assert replay.status == 201 and replay.replayed and replay.body == CHARGE, replay.outcome
        assert (await stuck.ledger.counts([stuck.key]))[stuck.key] == 1
        history = await history_of(stuck, until="replayed")
        assert_the_history_shows_every_step(history, str(record["token"]), "via idem-asgi resolve")
        # and as text, as an operator reads it
        code, out, err = await idem_asgi(*stuck.store, "inspect", stuck.key, "--namespace", stuck.namespace)
        assert code == 0 and "history " in out and "resolved" in out and "replayed x3" in out, out
