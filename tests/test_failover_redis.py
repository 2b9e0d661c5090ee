"""A Redis failover under a retry storm: Sentinel promotes a replica while the primary is SIGKILLed.

The topology is started here on free ports (`tests.support.servers.redis_sentinel`): a primary, two
replicas, three sentinels (quorum 2, down after 1 s). The storm (`tests.support.failover`: 100 keys
x 8 duplicates through uvicorn on `redis+sentinel://`) SIGKILLs the primary 1 s in.

- `durable_replicas=1`: 0 duplicate executions, 0 completed records lost, only 201/409/503 during
  the failover, full service after. Asserted.
- `durable_replicas=0` (Redis' asynchronous replication): the same storm, measured and reported;
  only the answers' shapes are asserted. What it can lose is shown deterministically in
  tests/test_durable_claims.py (a promoted replica that missed an acknowledged claim).

Each run prints one `FAILOVER` line (and appends it to `IDEM_SCORECARD_FILE`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.support.failover import assert_failover_kept_the_contract, run_storm
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, redis_sentinel, require

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
