"""An on-call engineer follows docs/operations.md after a worker was SIGKILLed mid-payment.

The shop of the page's worked example (its code exactly as printed, `tests/ops_app.py`) serves under
uvicorn on a real store with the default settings (`store_keys=False`: keys hashed at rest) and the
deployment's key secret. Two payments block in the handler, one after the provider charged it and
one before, and the worker is SIGKILLed. Then, as the page says: `idem-asgi stale` lists both by the
key the client sent; `idem-asgi reconcile --hook` with the page's own hook, first `--dry-run`
(nothing written, the hook's ledger untouched), then for real: the charged one completes with the
provider's answer, the other is released. A fresh worker then replays the first to the client's
retry and runs the second once. Without the secret the claims are listed by digest, with a line
saying why, and the hook still finds the charged one by `key_among`. (Before the key secret, the
hook got `? / ?`: `stale` showed only digests, and the never-charged claim stayed unresolved.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import httpx
import pytest
import redis.asyncio as aioredis

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from tests.support.ops_shop import hook_module
from tests.support.servers import POSTGRES_DSN, REDIS_URL, ROOT, UvicornProcess, require

SECRET = "kS3cr3t-for-the-ops-test-0123456789"
LEASE = 30  # the worked example's route keeps the default lease


@dataclass
class Shop:
    """One deployment: its store, the environment its app and its ops tools get, and its run id."""

    kind: str
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    env: dict[str, str] = field(default_factory=dict)
    cli: list[str] = field(default_factory=list)

    def backend(self) -> RedisBackend | PostgresBackend:
        """The store, to count its stale claims (by digest: what they hold is the CLI's to show)."""
        if self.kind == "redis":
            return RedisBackend.from_url(REDIS_URL, prefix=self.env["IDEM_OPS_PREFIX"])
        return PostgresBackend.from_dsn(POSTGRES_DSN, table=self.env["IDEM_OPS_TABLE"], min_size=1)


def deployment(kind: str, secret: bool) -> Shop:
    shop = Shop(kind)
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEM_")}
    env.update(IDEM_OPS_RUN=shop.run, IDEM_REDIS_URL=REDIS_URL)
    if secret:
        env["IDEM_ASGI_KEY_SECRET"] = SECRET
    if kind == "redis":
        require("redis", REDIS_URL)
        env.update(IDEM_OPS_BACKEND=REDIS_URL, IDEM_OPS_PREFIX=f"idem-ops:{shop.run}:")
        shop.cli = ["--backend", REDIS_URL, "--prefix", env["IDEM_OPS_PREFIX"]]
    else:
        require("postgres", POSTGRES_DSN)
        require("redis", REDIS_URL)  # the provider's state
        env.update(IDEM_OPS_BACKEND=POSTGRES_DSN, IDEM_OPS_TABLE=f"idem_ops_{shop.run}")
        shop.cli = ["--backend", POSTGRES_DSN, "--table", env["IDEM_OPS_TABLE"]]
    shop.env = env
    return shop


@pytest.fixture
async def shared() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield client
    finally:
        await client.aclose()


async def cleanup(shop: Shop, shared: aioredis.Redis) -> None:
    keys = [k async for k in shared.scan_iter(match=f"ops:{shop.run}:*")]
    keys += [k async for k in shared.scan_iter(match=f"idem-ops:{shop.run}:*")]
    if keys:
        await shared.delete(*keys)
    if shop.kind == "postgres":
        conn = await asyncpg.connect(POSTGRES_DSN)
        try:
            await conn.execute(f'DROP TABLE IF EXISTS "idem_ops_{shop.run}"')
        finally:
            await conn.close()


async def idem_asgi(shop: Shop, cwd: Path, *args: str) -> tuple[int, str]:
    """`python -m idem_asgi` as the on-call engineer runs it, from the directory of the hook module."""
    env = {**shop.env, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idem_asgi", *shop.cli, *args, cwd=cwd, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def kill_mid_payment(shop: Shop, shared: aioredis.Redis, tmp: Path, keys: list[str]) -> None:
    """Serve, send `keys` (their handlers block), SIGKILL the worker, wait until the leases end."""
    server = UvicornProcess("tests.ops_app:app", {**shop.env, "IDEM_OPS_HOLD": "1"}, tmp / "held.log")
    try:
        await server.wait_ready(timeout=30)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
            sent = [
                asyncio.ensure_future(
                    client.post(
                        "/payments", json={"amount": 1230}, headers={"Idempotency-Key": k, "x-user": "tenant-42"}
                    )
                )
                for k in keys
            ]
            for _ in range(300):
                if await shared.scard(f"ops:{shop.run}:entered") == len(keys):
                    break
                await asyncio.sleep(0.05)
            assert await shared.scard(f"ops:{shop.run}:entered") == len(keys), server.tail()
            server.signal(signal.SIGKILL)  # the worker dies mid-payment: no answer stored, no release
            for request in sent:
                with pytest.raises(httpx.TransportError):
                    await request
    finally:
        await asyncio.to_thread(server.stop)
    store = shop.backend()
    try:
        for _ in range(LEASE * 10 + 100):  # the lease ends by the store's clock
            if len(await store.stale(0)) == len(keys):
                break
            await asyncio.sleep(0.2)
    finally:
        await store.aclose()


async def retry(shop: Shop, tmp: Path, keys: list[str]) -> list[httpx.Response]:
    """The clients' retries, to a fresh worker; each retried again after `Retry-After` while it is
    answered `request-in-progress` (an expired lease is first seen so: its holder might renew)."""
    server = UvicornProcess("tests.ops_app:app", shop.env, tmp / "fresh.log")
    try:
        await server.wait_ready(timeout=30)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
            answers = []
            for k in keys:
                for _ in range(10):
                    answer = await client.post(
                        "/payments", json={"amount": 1230}, headers={"Idempotency-Key": k, "x-user": "tenant-42"}
                    )
                    if answer.status_code != 409 or "request-in-progress" not in answer.text:
                        break
                    await asyncio.sleep(float(answer.headers.get("retry-after", "1")))
                answers.append(answer)
            return answers
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["redis", "postgres"])
async def test_the_documented_hook_resolves_a_sigkilled_payment_by_its_key(
    kind: str, shared: aioredis.Redis, tmp_path: Path
) -> None:
    shop = deployment(kind, secret=True)
    charged, never = f"charged-{shop.run}", f"never-{shop.run}"
    (tmp_path / "shop_ops.py").write_text(hook_module())
    try:
        await kill_mid_payment(shop, shared, tmp_path, [charged, never])

        code, out = await idem_asgi(shop, tmp_path, "stale")
        assert code == 0, out
        assert f"idem / tenant-42 / {charged}  token" in out and f"idem / tenant-42 / {never}  token" in out, out
        assert "sha256:" not in out and "2 stale claim(s)" in out, out

        code, out = await idem_asgi(
            shop, tmp_path, "reconcile", "--hook", "shop_ops:resolve", "--older-than", "0", "--dry-run"
        )
        assert code == 0, out
        assert f"completed   idem / tenant-42 / {charged}  dry run: would store a 200 answer" in out, out
        assert f"released    idem / tenant-42 / {never}  dry run: would release" in out, out
        assert await shared.llen(f"ops:{shop.run}:ledger") == 0  # the hook wrote nothing of its own
        code, out = await idem_asgi(shop, tmp_path, "--json", "stale")
        assert len(json.loads(out)) == 2, out  # nor did reconcile

        code, out = await idem_asgi(shop, tmp_path, "reconcile", "--hook", "shop_ops:resolve", "--older-than", "0")
        assert code == 0, out
        assert f"completed   idem / tenant-42 / {charged}  stored a 200 answer" in out, out
        assert f"released    idem / tenant-42 / {never}  released; the next retry runs it" in out, out
        ledger = sorted(json.loads(e) for e in await shared.lrange(f"ops:{shop.run}:ledger", 0, -1))
        assert ledger == [
            ["reconciled", "tenant-42", charged, "200"],
            ["reconciled", "tenant-42", never, "never charged"],
        ]

        first, second = await retry(shop, tmp_path, [charged, never])
        charge = json.loads(await shared.hget(f"ops:{shop.run}:charges", f"pay:tenant-42:{charged}") or b"{}")
        assert first.status_code == 200 and first.headers.get("idempotent-replayed") == "true", first.text
        assert first.json() == {"charge": charge}
        assert second.status_code == 200 and "idempotent-replayed" not in second.headers, second.text
        ran = await shared.hgetall(f"ops:{shop.run}:ran")
        assert ran == {charged.encode(): b"1", never.encode(): b"1"}  # each handler ran once in all
        assert await shared.hlen(f"ops:{shop.run}:charges") == 2  # one charge each
    finally:
        await cleanup(shop, shared)


@pytest.mark.slow
@pytest.mark.redis
async def test_without_the_secret_claims_are_listed_by_digest_and_the_hook_matches_the_providers_keys(
    shared: aioredis.Redis, tmp_path: Path
) -> None:
    shop = deployment("redis", secret=False)
    charged, never = f"charged-{shop.run}", f"never-{shop.run}"
    (tmp_path / "shop_ops.py").write_text(hook_module())
    try:
        await kill_mid_payment(shop, shared, tmp_path, [charged, never])
        code, out = await idem_asgi(shop, tmp_path, "stale")
        assert code == 0 and out.count("idem / sha256:") == 2 and charged not in out, out
        assert "2 claim(s) shown by digest: keys are kept as digests and no IDEM_ASGI_KEY_SECRET is set here" in out

        code, out = await idem_asgi(shop, tmp_path, "reconcile", "--hook", "shop_ops:resolve", "--older-than", "0")
        assert code == 0, out
        assert "completed 1, released 0, unresolved 1" in out, out  # the provider never saw the other key
        first, second = await retry(shop, tmp_path, [charged, never])
        assert first.status_code == 200 and first.headers.get("idempotent-replayed") == "true", first.text
        # The retry's recover hook sees the request's own key: the provider never charged it, so it runs.
        assert second.status_code == 200 and "idempotent-replayed" not in second.headers, second.text
        ran = await shared.hgetall(f"ops:{shop.run}:ran")
        assert ran == {charged.encode(): b"1", never.encode(): b"1"}
    finally:
        await cleanup(shop, shared)
