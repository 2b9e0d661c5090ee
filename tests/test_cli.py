"""The `idem-asgi` command line against real stores: in-process (`run(argv)` returns the exit code,
output captured) and once as `python -m idem_asgi` in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from idem_asgi.backends import Backend
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.ops.cli import main, run
from idem_asgi.records import COMPLETED, Claimed, RecordKey, StoredResponse
from idem_asgi.transform import unseal
from tests.support.servers import POSTGRES_DSN, REDIS_URL, free_port, require
from tests.support.stores import SHARED

DAY = 86_400.0
RESPONSE = StoredResponse(
    201, [(b"content-type", b"application/json"), (b"x-charge", b"ch_1")], b'{"charge":"ch_1","amount":1230}'
)
FOUND = StoredResponse(200, [(b"content-type", b"application/json")], b'{"charge":"ch_from_provider"}')


@dataclass
class Store:
    """A real store for the CLI: the arguments that name it, and a backend to set records up with."""

    kind: str
    args: list[str]
    backend: Backend


@pytest.fixture(params=SHARED)
async def store(request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> AsyncIterator[Store]:
    if request.param == "redis":
        require("redis", REDIS_URL)
        prefix = f"idem-test:{uuid.uuid4().hex}:"
        # store_keys=True: an app that keeps raw keys for the tools to display (the default keeps digests)
        async with RedisBackend.from_url(REDIS_URL, prefix=prefix, store_keys=True) as redis_backend:
            yield Store("redis", ["--backend", REDIS_URL, "--prefix", prefix, "--store-keys"], redis_backend)
        return
    require("postgres", POSTGRES_DSN)
    table = f"idem_cli_{uuid.uuid4().hex[:16]}"
    args = ["--backend", POSTGRES_DSN, "--table", table, "--store-keys"]
    # The CLI makes the table (and nothing else does: the backend below is given a pool).
    assert await run([*args, "migrate"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"schema ready: table {table}" and out[1].startswith("raw keys kept: an app with store_keys=True")
    pool = await asyncpg.create_pool(POSTGRES_DSN, min_size=1, max_size=4)
    try:
        async with PostgresBackend(pool, table=table, store_keys=True) as pg:
            yield Store("postgres", args, pg)
    finally:
        await pool.execute(f'DROP TABLE IF EXISTS "{table}"')
        await pool.close()


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await run(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code, out, err = await cli(capsys, *argv, "--json")
    assert err == "" or code != 0, err
    return code, json.loads(out)


def iso(text: str) -> float:
    assert text.endswith("Z")
    return datetime.fromisoformat(text[:-1] + "+00:00").timestamp()


async def stuck(backend: Backend, key: RecordKey, lease: float = 0.1) -> int:
    claimed = await backend.claim(key, b"fp", lease=lease, ttl=DAY)
    assert isinstance(claimed, Claimed)
    return claimed.token


@pytest.fixture
def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A resolver module on sys.path: keys starting "paid" were charged, "gone" never were, "boom" raises."""
    name = f"cli_hook_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            f"""
            from idem_asgi.records import StoredResponse
            from idem_asgi.ops.reconcile import is_dry_run

            asked = []
            dry = []  # what is_dry_run() said at each call

            async def resolve(stale):
                asked.append(stale.key.key)
                dry.append(is_dry_run())
                if stale.key.key.startswith("paid"):
                    return StoredResponse(200, [(b"content-type", b"application/json")], {FOUND.body!r})
                if stale.key.key.startswith("gone"):
                    return "release"
                if stale.key.key.startswith("boom"):
                    raise ConnectionError("provider unreachable")
                return None

            not_a_function = 42

            from cryptography.fernet import Fernet
            from idem_asgi.transform import EncryptBody

            fernet = Fernet(Fernet.generate_key())
            sealing = EncryptBody(fernet.encrypt, fernet.decrypt)  # the app's transform
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# --- every command against Redis and Postgres --------------------------------------------------


async def test_inspect_prints_a_completed_record(
    store: Store, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    key = RecordKey.build(namespace, "tenant-1", "pay-1")
    claimed = await store.backend.claim(key, b"\x01\x02", lease=30, ttl=DAY)
    assert isinstance(claimed, Claimed)
    assert await store.backend.complete(key, claimed.token, RESPONSE, ttl=DAY)

    code, out, err = await cli(capsys, *store.args, "inspect", "pay-1", "--namespace", namespace, "--scope", "tenant-1")
    assert (code, err) == (0, "")
    assert f"record    {namespace} / tenant-1 / pay-1" in out
    assert "state     completed" in out
    assert f"token     {claimed.token}" in out
    assert f"response  201, 2 headers, {len(RESPONSE.body)} bytes, replayable" in out
    assert "  x-charge: ch_1" in out

    code, doc = await cli_json(capsys, *store.args, "inspect", "pay-1", "--namespace", namespace, "--scope", "tenant-1")
    assert code == 0
    assert doc["found"] is True and doc["state"] == COMPLETED and doc["token"] == claimed.token
    assert (doc["namespace"], doc["scope"], doc["key"], doc["digest"]) == (namespace, "tenant-1", "pay-1", key.digest)
    assert doc["fingerprint"] == "0102"
    assert doc["response"] == {
        "status": 201,
        "headers": [["content-type", "application/json"], ["x-charge", "ch_1"]],
        "body_size": len(RESPONSE.body),
        "replayable": True,
        "sealed": False,
        "tombstone": False,
    }
    assert abs(iso(doc["expires_at"]) - time.time() - DAY) < 60
    assert iso(doc["lease_until"]) <= time.time() + 5


async def test_inspect_of_an_absent_key_exits_1(
    store: Store, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await cli(capsys, *store.args, "inspect", "nope", "--namespace", namespace)
    assert code == 1 and out == f"no record for {namespace} / - / nope (a scoped key is found only with its --scope)\n"
    code, doc = await cli_json(capsys, *store.args, "inspect", "nope", "--namespace", namespace)
    assert code == 1 and doc["found"] is False and doc["key"] == "nope"


async def test_stale_lists_stuck_claims(store: Store, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    token = await stuck(store.backend, RecordKey.build(namespace, "t", "stuck-1"))
    await stuck(store.backend, RecordKey.build(namespace, "t", "running"), lease=30)
    await asyncio.sleep(0.25)

    code, doc = await cli_json(capsys, *store.args, "stale", "--older-than", "0", "--namespace", namespace)
    assert code == 0
    assert [(d["scope"], d["key"], d["token"], d["effect_committed"]) for d in doc] == [("t", "stuck-1", token, False)]
    assert iso(doc[0]["lease_until"]) < time.time()

    code, out, _ = await cli(capsys, *store.args, "stale", "--older-than", "0", "--namespace", namespace)
    assert code == 0
    assert f"{namespace} / t / stuck-1  token {token}" in out
    assert out.endswith("1 stale claim(s) whose lease ended more than 0 s ago\n")


async def test_stale_lists_a_just_ended_lease_while_reconcile_and_resolve_wait_and_say_so(
    store: Store, namespace: str, hook_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stale` only lists, so it shows every ended lease; `reconcile` and `resolve` write, so by
    default they leave a lease over for less than 60 s (a live holder stalled past its lease may
    still renew), each saying why and what takes it."""
    token = await stuck(store.backend, RecordKey.build(namespace, "t", "just-ended"))
    await asyncio.sleep(0.25)
    code, doc = await cli_json(capsys, *store.args, "stale", "--namespace", namespace)
    assert code == 0 and [d["key"] for d in doc] == ["just-ended"]
    code, out, _ = await cli(capsys, *store.args, "stale", "--namespace", namespace, "--older-than", "60")
    assert code == 0 and "0 stale claim(s)" in out and "--older-than 60 leaves out" in out
    hook = f"{hook_module}:resolve"
    code, out, _ = await cli(capsys, *store.args, "reconcile", "--hook", hook, "--namespace", namespace, "--dry-run")
    assert code == 0 and "examined 0" in out and "--older-than 0 takes every one" in out
    argv = [*store.args, "resolve", "just-ended", "--namespace", namespace, "--scope", "t", "--token", str(token)]
    code, out, _ = await cli(capsys, *argv, "--release")
    assert code == 1 and "less than --older-than 60" in out


async def test_reconcile_runs_the_hook(
    store: Store, namespace: str, hook_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = {name: RecordKey.build(namespace, None, name) for name in ("paid-1", "gone-1", "unknown-1")}
    for key in keys.values():
        await stuck(store.backend, key)
    await asyncio.sleep(0.25)
    base = [*store.args, "reconcile", "--hook", f"{hook_module}:resolve", "--older-than", "0", "--namespace", namespace]

    code, doc = await cli_json(capsys, *base, "--dry-run")
    assert code == 0 and doc["dry_run"] is True
    assert (doc["examined"], doc["completed"], doc["released"], doc["unresolved"]) == (3, 1, 1, 1)
    assert [await store.backend.get(k) is not None for k in keys.values()] == [True] * 3  # nothing written
    assert sys.modules[hook_module].dry == [True] * 3  # the hook was told (its own writes can wait)

    code, out, err = await cli(capsys, *base, "--ttl", "600")
    assert (code, err) == (0, "")
    assert f"completed   {namespace} / - / paid-1  stored a 200 answer" in out
    assert f"released    {namespace} / - / gone-1  released; the next retry runs it" in out
    assert f"unresolved  {namespace} / - / unknown-1  outcome still unknown" in out
    assert out.endswith("examined 3: completed 1, released 1, unresolved 1, skipped 0, errors 0\n")
    assert sys.modules[hook_module].dry[3:] == [False] * 3  # a real run is not one
    paid = await store.backend.get(keys["paid-1"])
    assert paid is not None and paid.state == COMPLETED and paid.response == FOUND
    assert await store.backend.get(keys["gone-1"]) is None

    code, doc = await cli_json(capsys, *store.args, "inspect", "paid-1", "--namespace", namespace)
    assert code == 0 and doc["response"]["status"] == 200 and iso(doc["expires_at"]) < time.time() + 700


async def test_reconcile_seals_resolved_answers_with_the_apps_transform(
    store: Store, namespace: str, hook_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--transform` seals what `reconcile` stores as the app seals it; without it, the answer is stored
    in clear and marked so (the app's transform replays it as stored)."""
    sealed_key, clear_key = (
        RecordKey.build(namespace, None, "paid-sealed"),
        RecordKey.build(namespace, None, "paid-clear"),
    )
    await stuck(store.backend, sealed_key)
    await asyncio.sleep(0.25)
    base = [*store.args, "reconcile", "--hook", f"{hook_module}:resolve", "--older-than", "0", "--namespace", namespace]
    code, doc = await cli_json(capsys, *base, "--ttl", "600", "--transform", f"{hook_module}:sealing")
    assert code == 0 and doc["completed"] == 1
    record = await store.backend.get(sealed_key)
    assert record is not None and record.response is not None and record.response.sealed
    assert record.response.body != FOUND.body and b"ch_from_provider" not in record.response.body
    assert unseal(sys.modules[hook_module].sealing, record.response) == FOUND
    code, doc = await cli_json(capsys, *store.args, "inspect", "paid-sealed", "--namespace", namespace)
    assert code == 0 and doc["response"]["sealed"] is True

    await stuck(store.backend, clear_key)
    await asyncio.sleep(0.25)
    code, doc = await cli_json(capsys, *base, "--ttl", "600")
    assert code == 0 and doc["completed"] == 1
    record = await store.backend.get(clear_key)
    assert record is not None and record.response == FOUND and not record.response.sealed

    code, out, err = await cli(capsys, *base, "--transform", f"{hook_module}:not_a_function")
    assert code == 2 and "has no store(response) and load(response) methods" in err and out == ""


async def test_reconcile_with_a_failing_hook_exits_1_without_a_traceback(
    store: Store, namespace: str, hook_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await stuck(store.backend, RecordKey.build(namespace, None, "boom-1"))
    await asyncio.sleep(0.25)
    argv = [*store.args, "reconcile", "--hook", f"{hook_module}:resolve", "--older-than", "0", "--namespace", namespace]
    code, out, err = await cli(capsys, *argv, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["errors"] == 1
    assert doc["items"][0]["detail"] == "resolve raised ConnectionError: provider unreachable"
    assert "Traceback" not in err


async def test_purge(store: Store, namespace: str, capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(3):
        claimed = await store.backend.claim(RecordKey.build(namespace, None, f"short-{i}"), b"fp", lease=0.1, ttl=0.2)
        assert isinstance(claimed, Claimed)
    await stuck(store.backend, RecordKey.build(namespace, None, "kept"))
    await asyncio.sleep(0.35)

    code, doc = await cli_json(capsys, *store.args, "purge", "--batch-size", "2")
    expected = 0 if store.kind == "redis" else 3  # Redis expires records by itself
    assert (code, doc) == (0, {"deleted": expected})
    code, out, _ = await cli(capsys, *store.args, "purge")
    note = " (Redis deletes expired records by itself)" if store.kind == "redis" else ""
    assert (code, out) == (0, f"purged 0 expired record(s){note}\n")
    assert await store.backend.get(RecordKey.build(namespace, None, "kept")) is not None


# --- memory, migrate, and errors ---------------------------------------------------------------


@pytest.mark.memory
async def test_memory_store_works_but_starts_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert await cli_json(capsys, "--backend", "memory://", "stale", "--older-than", "0") == (0, [])
    assert await cli_json(capsys, "--backend", "memory://", "purge") == (0, {"deleted": 0})
    code, doc = await cli_json(capsys, "--backend", "memory://", "inspect", "k")
    assert code == 1 and doc["found"] is False
    code, out, err = await cli(capsys, "--backend", "memory://", "migrate")
    assert (code, out) == (2, "")
    assert err == "idem-asgi: error: migrate is for postgresql:// and Redis backends; the memory store keeps nothing\n"


async def test_migrate_print_needs_no_connection(capsys: pytest.CaptureFixture[str]) -> None:
    nowhere = f"postgresql://nobody@127.0.0.1:{free_port()}/x"
    code, out, _ = await cli(capsys, "--backend", nowhere, "migrate", "--print", "--table", "ops.idem")
    assert code == 0 and out.startswith('CREATE TABLE IF NOT EXISTS "ops"."idem" (') and "inflight_idx" in out
    code, doc = await cli_json(capsys, "migrate", "--print")
    assert code == 0 and doc["table"] == "idem_records" and doc["ddl"] == PostgresBackend().ddl


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--backend", "mysql://db/x", "stale"],
            "unknown backend URL scheme 'mysql'; use one of "
            "memory://, redis://, rediss://, redis+sentinel://, unix://, postgres://, postgresql://",
        ),
        (
            ["--backend", "localhost:6379", "purge"],
            "unknown backend URL scheme none; use one of "
            "memory://, redis://, rediss://, redis+sentinel://, unix://, postgres://, postgresql://",
        ),
        (
            ["--backend", "memory://", "reconcile", "--hook", "no_such_module_xyz:resolve"],
            "hook module 'no_such_module_xyz' not found",
        ),
        (
            ["--backend", "memory://", "reconcile", "--hook", "idem_asgi.ops.reconcile:no_such_function"],
            "hook module 'idem_asgi.ops.reconcile' has no 'no_such_function'",
        ),
        (
            ["--backend", "memory://", "reconcile", "--hook", "idem_asgi.ops.reconcile"],
            "--hook must be MODULE:FUNCTION, got 'idem_asgi.ops.reconcile'",
        ),
        (
            ["--backend", "memory://", "reconcile", "--hook", "idem_asgi.ops.reconcile:logger"],
            "hook 'idem_asgi.ops.reconcile:logger' is not callable",
        ),
    ],
)
async def test_configuration_errors_exit_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await cli(capsys, *argv)
    assert (code, out, err) == (2, "", f"idem-asgi: error: {message}\n")


async def test_backend_url_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("IDEM_BACKEND_URL", raising=False)
    code, _, err = await cli(capsys, "stale")
    assert code == 2 and err == "idem-asgi: error: no backend: pass --backend URL or set IDEM_BACKEND_URL\n"
    monkeypatch.setenv("IDEM_BACKEND_URL", "memory://")
    assert await cli_json(capsys, "stale") == (0, [])


async def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = await cli(capsys, "--backend", "memory://", "frobnicate")
    assert code == 2 and "invalid choice: 'frobnicate'" in err
    code, _, err = await cli(capsys, "--backend", "memory://", "reconcile")
    assert code == 2 and "--hook" in err
    assert (await cli(capsys, "--help"))[0] == 0


@pytest.mark.parametrize(
    "scheme", [pytest.param("redis", marks=pytest.mark.redis), pytest.param("postgresql", marks=pytest.mark.postgres)]
)
async def test_unreachable_store_exits_3_quickly(scheme: str, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0" if scheme == "redis" else f"postgresql://postgres@127.0.0.1:{port}/test"
    started = time.monotonic()
    code, out, err = await cli(capsys, "--backend", url, "--timeout", "2", "stale")
    assert time.monotonic() - started < 2
    assert code == 3 and out == ""
    assert err.startswith("idem-asgi: error: store unreachable: ") and err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.redis
async def test_an_unreachable_sentinel_is_one_short_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/mymaster"
    code, out, err = await cli(capsys, "--backend", url, "--timeout", "2", "stale")
    assert code == 3 and out == ""
    assert err == (
        "idem-asgi: error: store unreachable: redis unavailable: No master found for 'mymaster' "
        "(no sentinel answered, or none knows its primary)\n"
    )


@pytest.mark.postgres
async def test_migrate_as_a_role_that_may_not_alter_the_table_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    require("postgres", POSTGRES_DSN)
    name = uuid.uuid4().hex[:12]
    role, table = f"idem_app_{name}", f"idem_cli_owned_{name}"
    admin = await asyncpg.connect(POSTGRES_DSN)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        code, out, _ = await cli(capsys, "--backend", POSTGRES_DSN, "--table", table, "migrate")
        assert (code, out) == (0, f"schema ready: table {table}\n")  # the owner: nothing more to say
        await admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}")
        as_app = POSTGRES_DSN.replace("postgres@", f"{role}@", 1)
        code, out, _ = await cli(capsys, "--backend", as_app, "--table", table, "migrate")
        assert code == 0 and "may not alter it: run migrate as its owner" in out, out
        code, doc = await cli_json(capsys, "--backend", as_app, "--table", table, "migrate")
        assert code == 0 and doc["may_alter"] is False
    finally:
        await admin.execute(f"DROP TABLE IF EXISTS {table}")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


@pytest.mark.postgres
async def test_postgres_missing_table_is_a_configuration_error_not_created(capsys: pytest.CaptureFixture[str]) -> None:
    require("postgres", POSTGRES_DSN)
    table = f"idem_cli_missing_{uuid.uuid4().hex[:12]}"
    code, out, err = await cli(capsys, "--backend", POSTGRES_DSN, "--table", table, "stale")
    assert code == 2 and out == "" and err.startswith("idem-asgi: error: postgres refuses the table")
    assert "migrate" in err and err.count("\n") == 1
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        assert await conn.fetchval("SELECT to_regclass($1)", table) is None
    finally:
        await conn.close()


@pytest.mark.memory
def test_main_runs_its_own_loop_and_returns_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--backend", "memory://", "stale", "--older-than", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["--backend", "bogus://x", "purge"]) == 2
    assert capsys.readouterr().err.startswith("idem-asgi: error: unknown backend URL scheme 'bogus'")


# --- the real thing: a subprocess ----------------------------------------------------------------


@pytest.mark.redis
async def test_python_dash_m_reconciles_with_a_hook_from_the_working_directory(tmp_path: Path, namespace: str) -> None:
    require("redis", REDIS_URL)
    prefix = f"idem-test:{uuid.uuid4().hex}:"
    (tmp_path / "ops_hooks.py").write_text('def resolve(stale):\n    return "release"\n')
    async with RedisBackend.from_url(REDIS_URL, prefix=prefix) as backend:
        key = RecordKey.build(namespace, "t", "gone-in-subprocess")
        await stuck(backend, key)
        await asyncio.sleep(0.25)
        env = {**os.environ, "IDEM_BACKEND_URL": REDIS_URL}
        argv = ["--prefix", prefix, "reconcile", "--hook", "ops_hooks:resolve", "--older-than", "0", "--json"]
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "idem_asgi", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert (doc["examined"], doc["released"]) == (1, 1)
        assert doc["items"][0]["key"] == "?"  # the store keeps the digest only (store_keys=False)
        assert doc["items"][0]["digest"] == key.digest
        assert await backend.get(key) is None


async def test_jobs_records_are_listed_and_resolved_by_the_tools(
    store: Store, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job that failed after its effect is a stuck claim like a request's: `stale` lists it,
    `reconcile` stores what the provider says happened, and the next call returns that."""
    from idem_asgi.jobs.decorator import OutcomeUnknown, current_job, idempotent, stored_result
    from idem_asgi.ops.reconcile import ReconcilableBackend, reconcile

    runs: list[str] = []

    @idempotent(store.backend, args=["order_id"], namespace=namespace, lease=0.2)
    async def charge(order_id: str, amount: int) -> dict[str, Any]:
        runs.append(order_id)
        job = current_job()
        assert job is not None
        job.mark_effect()
        raise ConnectionError("the provider's answer was lost")

    with pytest.raises(ConnectionError):
        await charge("o-1", 100)
    with pytest.raises(OutcomeUnknown):
        await charge("o-1", 100)
    await asyncio.sleep(0.3)
    code, doc = await cli_json(capsys, *store.args, "stale", "--older-than", "0", "--namespace", namespace)
    assert code == 0
    assert [d["key"] for d in doc] == ["order_id=o-1"]

    found = {"charge": "ch_from_provider", "amount": 100}
    tools = store.backend
    assert isinstance(tools, (RedisBackend, PostgresBackend))
    resolved: ReconcilableBackend = tools
    report = await reconcile(resolved, lambda s: stored_result(found), older_than=0, namespace=namespace)
    assert (report.examined, report.completed) == (1, 1)
    assert await charge("o-1", 100) == found and runs == ["o-1"], "the resolved result, without a second run"
    code, doc = await cli_json(capsys, *store.args, "inspect", "order_id=o-1", "--namespace", namespace)
    assert code == 0 and doc["response"]["status"] == 200


@pytest.mark.parametrize("argv", [["migrate", "--print"], ["--backend", "memory://", "stale", "--json"]])
def test_a_closed_stdout_ends_quietly_not_as_a_store_outage(argv: list[str]) -> None:
    """`idem-asgi migrate --print | head -3`: the reader went away; that is no store outage (3)."""
    env = {**os.environ, "IDEM_BACKEND_URL": POSTGRES_DSN}
    child = subprocess.Popen(
        [sys.executable, "-m", "idem_asgi", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()  # before the CLI writes a byte: its first write meets a closed pipe
    err = child.stderr.read()
    child.stderr.close()
    assert (child.wait(30), err) == (141, b"")


async def test_in_process_run_reports_a_closed_stdout_and_leaves_the_callers_stdout_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    before = os.fstat(1)
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert await run(["migrate", "--print"]) == 141
    after = os.fstat(1)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino), "fd 1 not redirected by run()"
