"""The job surface of the fault matrix: `@idempotent` calls in a process of their own.

    python -m tests.faults.job_process '<json config>'

Calls `job(key)` for every key of the plan at once (`asyncio.gather`), where `job` is
`@idempotent(store, key=..., namespace=...)` over `fault_points.work(plan, key, store)` and `store`
is `PointStore(<the real store>)`, so each call stops at its key's point (the first time it gets
there the first time only). The plan comes from the environment (`IDEM_FAULT_RUN`, `IDEM_FAULT_POINTS`:
tests/support/fault_points.py).

A graceful stop is the usual one: `SIGTERM` cancels the main task (`loop.add_signal_handler`), so
every call still running is cancelled. With `timeout` in the config, each call runs inside
`asyncio.wait_for(..., timeout)`. Once the calls are over the process prints one JSON line
(`{"pid", "outcomes": {key: "returned" | exception name}}`), closes its store (draining its late
writes) and exits 0, also after a graceful stop.

Config: `store` (URL), `prefix` (Redis key prefix), `table` (Postgres table), `namespace`, `lease`,
`ttl`, `pool`, `timeout` (or null).
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
from typing import Any

from idem_asgi.jobs import idempotent
from tests.faults.key_outcomes import STORE_TIMEOUT
from tests.support.fault_points import Plan, PointStore, work
from tests.support.stores import store_from_url


def make_job(store: PointStore, plan: Plan, *, namespace: str, lease: float, ttl: float) -> Any:
    """The matrix's job over `store`: the same function, key and namespace in every process (and in
    the test, which settles with it)."""

    @idempotent(store, key=lambda key: key, namespace=namespace, lease=lease, ttl=ttl)
    async def job(key: str) -> str:
        return await work(plan, key, store)

    return job


async def main(config: dict[str, Any]) -> dict[str, str]:
    plan = Plan()
    real = store_from_url(
        config["store"], prefix=config["prefix"], table=config["table"], pool=config["pool"], timeout=STORE_TIMEOUT
    )
    store = PointStore(real, plan)
    job = make_job(store, plan, namespace=config["namespace"], lease=config["lease"], ttl=config["ttl"])
    timeout: float | None = config.get("timeout")
    outcomes: dict[str, str] = {}

    async def one(key: str) -> None:
        try:
            if timeout is None:
                await job(key)
            else:
                await asyncio.wait_for(job(key), timeout)
            outcomes[key] = "returned"
        except BaseException as exc:
            outcomes[key] = type(exc).__name__
            raise

    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        await asyncio.gather(*(one(k) for k in plan.points), return_exceptions=True)
    finally:
        print(json.dumps({"pid": os.getpid(), "outcomes": outcomes}), flush=True)
        await store.aclose()
        await plan.aclose()
    return outcomes


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung process's stacks, into its stderr
    try:
        asyncio.run(main(json.loads(sys.argv[1])))
    except asyncio.CancelledError:  # stopped by SIGTERM: the calls' claims are kept, as after a crash
        sys.exit(0)
