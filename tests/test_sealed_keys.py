"""Keys sealed with the deployment's secret (`idem_asgi.sealed_keys`): a dump of Redis or of the
table shows no client key or scope, while `stale()` given the secret lists each claim by its key,
after a rotation too; another secret, a damaged or a moved sealed text lists it by digest, and
`migrate` never blanks a sealed key as if it were raw. (Before, `stale()` listed every claim of the
default settings as `? / ?`.)"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest
import redis.asyncio as aioredis

from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.ops.cli import run
from idem_asgi.records import RecordKey
from idem_asgi.sealed_keys import ENV_SECRET, KeySeal, is_sealed
from tests.support.servers import POSTGRES_DSN, REDIS_URL, require
from tests.support.stores import SHARED

NEW, OLD = "n" * 16 + "-new-secret", "o" * 16 + "-old-secret"
KEY = RecordKey.build("idem", "tenant-42", "pay-7f3a")

Store = RedisBackend | PostgresBackend


def test_a_sealed_key_opens_only_with_its_secret_and_only_for_its_record() -> None:
    seal = KeySeal([NEW])
    sealed = seal.seal(KEY)
    assert is_sealed(sealed) and "pay-7f3a" not in sealed and "tenant-42" not in sealed
    assert seal.seal(KEY) != sealed  # a fresh nonce each time
    assert seal.open("idem", KEY.digest, sealed) == KEY
    assert KeySeal([OLD]).open("idem", KEY.digest, sealed) is None
    other = RecordKey.build("idem", "tenant-7", "pay-91bc")
    assert seal.open("idem", other.digest, sealed) is None  # copied onto another record
    assert seal.open("other", KEY.digest, sealed) is None
    damaged = sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")
    assert seal.open("idem", KEY.digest, damaged) is None
    assert seal.open("idem", KEY.digest, "pay-7f3a") is None


def test_rotation_seals_with_the_newest_and_opens_with_any() -> None:
    old = KeySeal([OLD]).seal(KEY)
    both = KeySeal.from_setting(f"{NEW}, {OLD}")
    assert both is not None
    assert both.open("idem", KEY.digest, old) == KEY
    assert KeySeal([NEW]).open("idem", KEY.digest, both.seal(KEY)) == KEY


def test_the_secret_comes_from_the_environment_and_must_be_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SECRET, raising=False)
    assert KeySeal.from_setting(None) is None
    monkeypatch.setenv(ENV_SECRET, NEW)
    seal = KeySeal.from_setting(None)
    assert seal is not None and seal.open("idem", KEY.digest, KeySeal([NEW]).seal(KEY)) == KEY
    with pytest.raises(ConfigurationError, match="at least 16 characters"):
        KeySeal.from_setting("short")


@pytest.fixture(params=SHARED)
async def make(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[str | None], Store]]:
    """Backends on one fresh prefix or table, each with the secret given (None: none)."""
    kind, run = str(request.param), uuid.uuid4().hex[:10]
    made: list[Store] = []

    def build(secret: str | None) -> Store:
        store: Store
        if kind == "redis":
            store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-seal:{run}:", key_secret=secret or [])
        else:
            store = PostgresBackend.from_dsn(
                POSTGRES_DSN, table=f"idem_seal_{run}", key_secret=secret or [], min_size=1
            )
        made.append(store)
        return store

    require(kind, REDIS_URL if kind == "redis" else POSTGRES_DSN)
    try:
        yield build
    finally:
        for store in made:
            await store.aclose()
        if kind == "redis":
            client = aioredis.Redis.from_url(REDIS_URL)
            keys = [k async for k in client.scan_iter(match=f"idem-seal:{run}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()
        else:
            conn = await asyncpg.connect(POSTGRES_DSN)
            await conn.execute(f'DROP TABLE IF EXISTS "idem_seal_{run}"')
            await conn.close()


async def dump(store: Store) -> str:
    """Everything the store holds for this test, as text (what a leaked dump would show)."""
    if isinstance(store, RedisBackend):
        client = aioredis.Redis.from_url(REDIS_URL)
        try:
            return repr([(k, await client.hgetall(k)) async for k in client.scan_iter(match=f"{store.prefix}*")])
        finally:
            await client.aclose()
    conn = await asyncpg.connect(POSTGRES_DSN)
    try:
        return repr(await conn.fetch(f"SELECT r::text FROM {store.table} AS r"))
    finally:
        await conn.close()


async def stuck(store: Store) -> None:
    """A claim whose holder stopped: its lease ends at once."""
    await store.claim(KEY, b"f" * 32, lease=0.05, ttl=60)
    await asyncio.sleep(0.2)


async def test_a_dump_shows_no_key_while_stale_lists_it_by_key(make: Callable[[str | None], Store]) -> None:
    app = make(NEW)
    await stuck(app)
    text = await dump(app)
    assert "pay-7f3a" not in text and "tenant-42" not in text and KEY.digest in text
    [listed] = await app.stale(0)
    assert listed.key == KEY and not listed.key.hidden
    [other] = await make(OLD).stale(0)  # the ops tool holds another secret
    assert other.key.hidden and other.key.digest == KEY.digest
    [rotated] = await make(f"{OLD},{NEW}").stale(0)
    assert rotated.key == KEY
    # migrate's rewrite of raw keys to digests leaves a sealed key alone.
    assert (await make(None).hash_stored_keys())[0] == 0
    [after] = await app.stale(0)
    assert after.key == KEY


async def test_a_takeover_seals_the_key_again_and_without_a_secret_nothing_is_sealed(
    make: Callable[[str | None], Store],
) -> None:
    plain = make(None)
    await stuck(plain)
    [listed] = await plain.stale(0)
    assert listed.key.hidden
    assert (await make(NEW).stale(0))[0].key.hidden  # nothing was sealed: nothing to open
    app = make(NEW)
    taken = await app.takeover(KEY, listed.record.token, b"f" * 32, lease=0.05, ttl=60)
    assert taken is not None
    await asyncio.sleep(0.2)
    assert (await app.stale(0))[0].key == KEY


@pytest.mark.redis
async def test_stale_says_why_a_claim_is_shown_by_digest(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    require("redis", REDIS_URL)
    prefix = f"idem-seal:{uuid.uuid4().hex[:10]}:"
    app = RedisBackend.from_url(REDIS_URL, prefix=prefix, key_secret=NEW)
    try:
        await stuck(app)
        argv = ["--backend", REDIS_URL, "--prefix", prefix, "stale"]
        lines = {}
        for secret in (NEW, OLD, ""):
            monkeypatch.setenv(ENV_SECRET, secret)
            assert await run(argv) == 0
            lines[secret] = capsys.readouterr().out.splitlines()
    finally:
        await app.aclose()
        client = aioredis.Redis.from_url(REDIS_URL)
        await client.delete(*[k async for k in client.scan_iter(match=f"{prefix}*")])
        await client.aclose()
    assert "idem / tenant-42 / pay-7f3a  token" in lines[NEW][0] and len(lines[NEW]) == 2
    short = KEY.digest[:16]
    assert f"idem / sha256:{short}  token" in lines[OLD][0]
    assert lines[OLD][-1].startswith(
        f"1 claim(s) shown by digest: their key was not sealed with a secret of {ENV_SECRET}"
    )
    assert f"idem / sha256:{short}  token" in lines[""][0]
    assert lines[""][-1].startswith(f"1 claim(s) shown by digest: keys are kept as digests and no {ENV_SECRET} is set")
