"""A Redis failover under a retry storm: Sentinel promotes a replica while the primary is SIGKILLed,
or paused 4 s (SIGSTOP, then SIGCONT: it comes back as a second primary until Sentinel demotes it).

The topology is started here on free ports (`tests.support.servers.redis_sentinel`): a primary, two
replicas, three sentinels (quorum 2, down after 1 s). The storm (`tests.support.failover`: 100 keys
x 8 duplicates through uvicorn on `redis+sentinel://`) SIGKILLs the primary 1 s in.

- `durable_replicas=1`: 0 duplicate executions, 0 completed records lost, only 201/409/503 during
  the failover, full service after. Asserted.
- `durable_replicas=0` (Redis' asynchronous replication): the same storm, measured and reported;
  only the answers' shapes are asserted. What it can lose is shown deterministically in
  tests/test_durable_claims.py (a promoted replica that missed an acknowledged claim).

- SIGSTOP 4 s with the DEFAULT settings of a `redis+sentinel://` URL (durable claims, 1 replica):
  0 duplicate executions, 0 replay mismatches, 0 lost completions. Asserted. With
  `durable_replicas=0`: what asynchronous replication costs, printed, not asserted.

Also the defaults themselves: through Sentinel a claim the replicas do not confirm is refused
(opt out with `durable_replicas=0` or `?durable_replicas=0`), and `check()` on a plain `redis://`
primary with replicas logs what a failover can cost.

Each run prints one `FAILOVER` line (and appends it to `IDEM_SCORECARD_FILE`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import BackendUnavailable
from idem_asgi.records import Claimed, RecordKey
from tests.support.failover import assert_failover_kept_the_contract, run_storm
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, RedisProcess, redis_sentinel, require

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.parametrize("durable", [1, 0], ids=["durable", "async-replication"])
async def test_sentinel_failover_under_a_storm(durable: int, tmp_path: Path) -> None:
    require("redis", REDIS_URL)  # the execution counter
    with redis_sentinel(tmp_path / "redis") as (primary, _replicas, sentinels):
        url = "redis+sentinel://" + ",".join(s.address for s in sentinels) + "/mymaster/0"

        async def fail_over() -> None:
            primary.kill()  # the sentinels notice within 1 s and promote a replica

        name = f"failover_redis_sentinel_{'durable' if durable else 'async'}"
        env = {"IDEM_STORM_DURABLE": str(durable)}
        result = await run_storm(name, url, env, tmp_path / "uvicorn.log", fail_over, seed=name)
        log = await asyncio.to_thread(sentinels[0].log_tail)
    result["durable_replicas"] = durable
    report(result, tag="FAILOVER")
    assert "+switch-master" in log, "no failover happened"
    assert_failover_kept_the_contract(result, durable=bool(durable))


@pytest.mark.parametrize("durable", [None, 0], ids=["default", "async-replication"])
async def test_sentinel_primary_paused_4s_under_a_storm(durable: int | None, tmp_path: Path) -> None:
    """SIGSTOP 4 s, then SIGCONT: the old primary answers again as a second primary until Sentinel
    demotes it. With the URL's defaults: nothing doubled, nothing lost (before: 11 duplicate
    executions, 11 replay mismatches, 7 lost completions of 800)."""
    require("redis", REDIS_URL)
    with redis_sentinel(tmp_path / "redis") as (primary, _replicas, sentinels):
        url = "redis+sentinel://" + ",".join(s.address for s in sentinels) + "/mymaster/0"

        async def fail_over() -> None:
            primary.signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(4.0)  # the fault itself: the primary is away 4 s
            finally:
                primary.signal(signal.SIGCONT)

        name = f"failover_redis_sentinel_sigstop_{'default' if durable is None else 'async'}"
        env = {} if durable is None else {"IDEM_STORM_DURABLE": str(durable)}
        result = await run_storm(name, url, env, tmp_path / "uvicorn.log", fail_over, seed=name)
        log = await asyncio.to_thread(sentinels[0].log_tail)
    result["durable_replicas"] = "default (1)" if durable is None else durable
    report(result, tag="FAILOVER")
    assert "+switch-master" in log, "no failover happened"
    assert_failover_kept_the_contract(result, durable=durable is None)


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisProcess, list[RedisProcess], str]]:
    """(primary, replicas, redis+sentinel:// URL) of a primary with two replicas, for this module."""
    require("redis", REDIS_URL)
    with redis_sentinel(tmp_path_factory.mktemp("defaults")) as (primary, replicas, sentinels):
        yield primary, replicas, "redis+sentinel://" + ",".join(s.address for s in sentinels) + "/mymaster/0"


async def _claim_with_replicas_paused(replicas: list[RedisProcess], url: str, **options: Any) -> object:
    """A claim through `url` while every replica is stopped: durable claims cannot be confirmed."""
    key = RecordKey.build("defaults", None, f"k-{id(options)}-{len(options)}-{url[-3:]}")
    async with RedisBackend.from_url(url, prefix="idem-defaults:", **options) as backend:
        await backend.get(key)  # connected before the replicas stop
        for replica in replicas:
            replica.signal(signal.SIGSTOP)
        try:
            return await backend.claim(key, b"fp", lease=5, ttl=60)
        except BackendUnavailable as exc:
            return exc
        finally:
            for replica in replicas:
                replica.signal(signal.SIGCONT)


async def test_claims_through_sentinel_are_durable_by_default(
    topology: tuple[RedisProcess, list[RedisProcess], str],
) -> None:
    """Replicas stopped: the default Sentinel backend refuses the claim (503, the app would not run)
    rather than acknowledge one a failover can lose; `durable_replicas=0`, as a keyword or on the
    URL, opts out. Before: acknowledged (durable claims were opt-in)."""
    _primary, replicas, url = topology
    assert RedisBackend.from_url(url).durable_replicas == 1
    refused = await _claim_with_replicas_paused(replicas, url)
    assert isinstance(refused, BackendUnavailable) and "replicas confirmed the claim" in str(refused)
    assert isinstance(await _claim_with_replicas_paused(replicas, url, durable_replicas=0), Claimed)
    assert isinstance(await _claim_with_replicas_paused(replicas, url + "?durable_replicas=0"), Claimed)
    assert RedisBackend.from_url(url + "?durable_replicas=2").durable_replicas == 2
    assert RedisBackend.from_url(url + "?durable_replicas=2", durable_replicas=0).durable_replicas == 0


def test_a_sentinel_url_option_that_is_not_known_is_refused() -> None:
    from idem_asgi.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="unknown option 'durable'"):
        RedisBackend.from_url("redis+sentinel://127.0.0.1:26379/mymaster?durable=0")
    with pytest.raises(ConfigurationError, match="not a number"):
        RedisBackend.from_url("redis+sentinel://127.0.0.1:26379/mymaster?durable_replicas=one")


async def test_check_on_a_primary_with_replicas_logs_what_a_failover_can_cost(
    topology: tuple[RedisProcess, list[RedisProcess], str], caplog: pytest.LogCaptureFixture
) -> None:
    """A plain `redis://` to a primary with replicas: one warning at start-up naming durable_replicas=1;
    none once claims are durable, none through Sentinel (durable by default), none without replicas."""
    primary, _replicas, url = topology
    caplog.set_level(logging.WARNING, logger="idem_asgi")
    cases: list[tuple[str, dict[str, Any]]] = [(primary.url, {}), (primary.url, {"durable_replicas": 1}), (url, {})]
    for target, options in [*cases, (REDIS_URL, {})]:
        caplog.clear()
        async with RedisBackend.from_url(target, prefix="idem-defaults:", **options) as backend:
            await backend.check()
        warned = [r.getMessage() for r in caplog.records if "failover" in r.getMessage()]
        if target == primary.url and not options:
            assert len(warned) == 1 and "2 connected replica(s)" in warned[0] and "durable_replicas=1" in warned[0]
        else:
            assert warned == [], (target, options, warned)
