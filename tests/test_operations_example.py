"""docs/operations.md's worked example, end to end, on Redis and Postgres: a worker is SIGKILLed
mid-payment (after the charge, before its answer is stored), its retries get 409, and one
`idem-asgi resolve` command (after `inspect` showed the token) stores the answer the provider
confirmed; every retry then replays it, and the payment ran once."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.crash_app import launch, make_store
from tests.support.scorecard import Ledger, PostgresLedger, RedisLedger, cleanup_store, http_post
from tests.support.servers import POSTGRES_DSN, REDIS_URL, UvicornProcess, require
from tests.support.stores import SHARED

pytestmark = pytest.mark.slow

TABLE = "idem_reliability_records"
LEASE = 1.0
CHARGE = b'{"charge":"ch_from_provider","status":"succeeded"}'


async def idem_asgi(*argv: str) -> tuple[int, str, str]:
    """The console command, as an operator runs it (`python -m idem_asgi`, its own process)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idem_asgi", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("kind", SHARED)
async def test_a_sigkilled_workers_key_is_resolved_with_one_command(kind: str, tmp_path: Path) -> None:
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

        code, out, err = await idem_asgi(*store, "inspect", key, "--namespace", namespace, "--json")
        assert code == 0, err
        record = json.loads(out)
        assert record["state"] == "in_progress"
        body = tmp_path / "charge.json"
        body.write_bytes(CHARGE)
        # The provider, asked by the same key, says it charged: store that answer.
        code, out, err = await idem_asgi(
            *store,
            "resolve",
            key,
            "--namespace",
            namespace,
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
            replay = await http_post(fresh.port, key)
            assert replay.status == 201 and replay.replayed and replay.body == CHARGE, replay.outcome
        assert (await ledger.counts([key]))[key] == 1
    finally:
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))
        try:
            await ledger.cleanup()
            await cleanup_store(kind, namespace, TABLE)
        finally:
            await ledger.aclose()
