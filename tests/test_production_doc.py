"""docs/production.md works as printed: every fenced block on the page is run here (each is marked
`<!-- test: name -->`), against a throwaway Redis started with the page's configuration and a fresh
PostgreSQL database with a locked-down app role; only host names and roles are substituted."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import sys
import types
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis

from idem_asgi.observe import EVENT_NAMES
from tests.support.asgi import StartupFailed, lifespan
from tests.support.servers import POSTGRES_DSN, ROOT, free_port, redis_process, require

DOC = ROOT / "docs" / "production.md"
RUN_HERE = {
    "fastapi",
    "starlette",
    "litestar",
    "redis-conf",
    "postgres-migrate",
    "postgres-grant",
    "postgres-app",
    "postgres-cron",
    "asgi-servers",  # run by tests/test_asgi_servers.py, under each server
}


def marked_blocks() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    found = re.findall(r"<!-- test: ([\w-]+) -->\n```(\w+)\n(.*?)```", text, re.S)
    return {name: (lang, code) for name, lang, code in found}


def test_every_block_on_the_page_is_marked_and_run_here() -> None:
    fenced = re.findall(r"^```\w+$", DOC.read_text(), re.M)
    blocks = marked_blocks()
    assert len(blocks) == len(fenced), "a fenced block without its <!-- test: name --> marker"
    assert set(blocks) == RUN_HERE


def test_every_event_the_alert_table_names_exists() -> None:
    section = DOC.read_text().split("## What to alert on")[1].split("## ")[0]
    first_cells = re.findall(r"^\| (`[^|]+`) \|", section, re.M)
    named = {name for cell in first_cells for name in re.findall(r"`(\w+)`", cell)}
    assert len(named) >= 8 and named <= set(EVENT_NAMES), named - set(EVENT_NAMES)


def load(name: str, **substitutions: str) -> dict[str, Any]:
    """Exec one python block as a module of the user's, with host names substituted."""
    lang, code = marked_blocks()[name]
    assert lang == "python"
    for old, new in substitutions.items():
        assert old in code, (name, old)
        code = code.replace(old, new)
    module = types.ModuleType(f"production_doc_{name.replace('-', '_')}")
    sys.modules[module.__name__] = module  # a real module: Litestar reads its handlers' globals there
    exec(compile(code, f"docs/production.md ({name})", "exec"), module.__dict__)
    return module.__dict__


async def pay_twice(app: Any) -> None:
    """Inside the app's lifespan: a payment, then its retry, which must be the stored answer."""
    headers = {"Idempotency-Key": f"doc-{uuid.uuid4().hex}", "X-Tenant-Id": "t-1"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://doc") as client:
        first = await client.post("/payments", json={"amount": 1}, headers=headers)
        again = await client.post("/payments", json={"amount": 1}, headers=headers)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers, first.text
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content


async def clients_after_close(admin: aioredis.Redis, within: float = 3.0) -> int:
    """How many clients the server lists once it has read the closes already sent (polled: the
    server learns of a close when it next reads that socket)."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        count = len(await admin.client_list())
        if count == 1 or asyncio.get_running_loop().time() > deadline:
            return count
        await asyncio.sleep(0.02)


def conf_args() -> list[str]:
    """The page's redis.conf lines as redis-server arguments."""
    _, conf = marked_blocks()["redis-conf"]
    args: list[str] = []
    for line in conf.splitlines():
        if line.strip():
            option, value = line.split(None, 1)
            args += [f"--{option}", value]
    return args


@pytest.fixture
async def configured_redis(tmp_path: Path) -> AsyncIterator[str]:
    with redis_process(tmp_path / "redis", args=conf_args()) as server:
        yield server.url


@pytest.mark.redis
@pytest.mark.parametrize("framework", ["fastapi", "starlette", "litestar"])
async def test_lifespan_wiring_opens_checks_and_closes_one_store(framework: str, configured_redis: str) -> None:
    ns = load(framework, **{"redis://redis.internal:6379/0": configured_redis})
    admin = aioredis.Redis.from_url(configured_redis)
    try:
        assert await admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert (await admin.config_get("appendonly"))["appendonly"] == "yes"
        async with lifespan(ns["app"]):
            await pay_twice(ns["app"])
            assert len(await admin.client_list()) > 1, "the app's pool is open"
        # The server drops a closed connection from its list when it reads the close: give it a moment.
        left = await clients_after_close(admin)
        assert left == 1, "shutdown closed the app's pool (only ours is left)"
    finally:
        await admin.aclose()


@pytest.mark.redis
async def test_litestars_start_up_hook_fails_a_misconfigured_store_and_tolerates_a_down_one(tmp_path: Path) -> None:
    with redis_process(tmp_path / "locked", args=conf_args()) as server:
        admin = aioredis.Redis.from_url(server.url)
        await admin.config_set("requirepass", "s3cret")
        await admin.aclose()
        ns = load("litestar", **{"redis://redis.internal:6379/0": server.url})  # no password: NOAUTH
        with pytest.raises(StartupFailed, match="store refuses this app"):
            async with lifespan(ns["app"]):
                pass
        await ns["backend"].aclose()
    down = f"redis://127.0.0.1:{free_port()}/0"
    ns = load("litestar", **{"redis://redis.internal:6379/0": down})
    transport = httpx.ASGITransport(app=ns["app"])
    async with lifespan(ns["app"]), httpx.AsyncClient(transport=transport, base_url="http://doc") as client:
        # only down: the app starts, and protected requests get 503 until it is back
        answer = await client.post("/payments", headers={"Idempotency-Key": "k-1", "X-Tenant-Id": "t-1"})
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/problem+json"


@pytest.mark.redis
async def test_the_start_up_check_warns_when_redis_may_evict_records(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = [a if a != "noeviction" else "allkeys-lru" for a in conf_args()]
    with redis_process(tmp_path / "lru", args=args) as server:
        ns = load("fastapi", **{"redis://redis.internal:6379/0": server.url})
        with caplog.at_level(logging.WARNING, logger="idem_asgi"):
            async with lifespan(ns["app"]):
                await pay_twice(ns["app"])
    warned = [r.getMessage() for r in caplog.records if "maxmemory-policy is allkeys-lru" in r.getMessage()]
    assert len(warned) == 1 and "noeviction" in warned[0]


def run_bash(name: str, env: dict[str, str], **substitutions: str) -> str:
    lang, code = marked_blocks()[name]
    assert lang == "bash"
    for old, new in substitutions.items():
        assert old in code, (name, old)
        code = code.replace(old, new)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # idem-asgi, as installed
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "PATH": path},
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.postgres
async def test_postgres_migrate_at_deploy_then_a_locked_down_role_serves() -> None:
    require("postgres", POSTGRES_DSN)
    run = uuid.uuid4().hex[:10]
    database, role = f"idem_doc_{run}", f"idem_app_{run}"
    admin = await asyncpg.connect(POSTGRES_DSN)
    await admin.execute(f'CREATE DATABASE "{database}"')
    await admin.execute(f'CREATE ROLE "{role}" LOGIN')
    base = POSTGRES_DSN.rsplit("/", 1)[0].split("://", 1)[1].split("@", 1)[-1]  # host:port
    owner_url, app_url = f"postgresql://postgres@{base}/{database}", f"postgresql://{role}@{base}/{database}"
    try:
        out = run_bash("postgres-migrate", {}, **{"postgresql://owner@db.internal/payments": owner_url})
        assert "schema ready: table idem_records" in out and "CREATE TABLE IF NOT EXISTS" in out

        # Before the GRANT the app refuses to start, naming the fix; never a 500 per request.
        ns = load("postgres-app", **{"postgresql://payments_app@db.internal/payments": app_url})
        with pytest.raises(StartupFailed, match="GRANT SELECT, INSERT, UPDATE, DELETE ON"):
            async with lifespan(ns["app"]):
                pass
        await ns["backend"].aclose()

        _, grant = marked_blocks()["postgres-grant"]
        db = await asyncpg.connect(owner_url)
        try:
            await db.execute(grant.replace("payments_app", f'"{role}"'))
        finally:
            await db.close()

        ns = load("postgres-app", **{"postgresql://payments_app@db.internal/payments": app_url})
        async with lifespan(ns["app"]):
            await pay_twice(ns["app"])
        sessions = await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE usename = $1", role)
        assert sessions == 0, "shutdown closed the app's pool"

        out = run_bash("postgres-cron", {"IDEM_BACKEND_URL": owner_url})
        assert out.startswith("purged 0 expired record(s)") and out.rstrip().endswith("[]"), out
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


def test_the_page_is_linked_from_the_readme_first_screen() -> None:
    first_screen = (ROOT / "README.md").read_text().split("## ", 1)[0]
    assert "(docs/production.md)" in first_screen
