"""The fault matrix's HTTP cells (tests/support/fault_matrix.py, surface `http`): every point of a
claim under every kind of fault, on Redis and on Postgres, with uvicorn.

One test per (kind, store): a uvicorn worker (tests/faults/http_app.py: POST /pay behind
`IdempotencyMiddleware`, its handler `fault_points.work`, its store `PointStore(<the real store>)`)
gets `PER_POINT` requests per point at once, each key stopping at its own point; once all sit there
the fault is applied:

- sigkill: SIGKILL the worker; nothing is released;
- graceful_stop: SIGTERM; uvicorn's graceful shutdown waits for the running requests, so the keys
  are released after the signal and every request finishes;
- cancelled: the worker runs with `--timeout-graceful-shutdown 1`; SIGTERM and nothing released, so
  uvicorn's shutdown cancels the request tasks after that second (`Server.shutdown`: "Cancel N
  running task(s), timeout graceful shutdown exceeded", which the test finds in the worker's log);
- store_outage: the store (an fsynced redis-server / a throwaway Postgres cluster stopped
  `-m immediate`) is killed, the keys released while it is down, and it is started again on the
  same port and data after `DOWN` s;
- store_stall: the store is SIGSTOPped, the keys released while it is stopped, and it is resumed
  after two leases.

Then a fresh worker on the same store (its plan never stops a key) settles every key: POST it
again, again after Retry-After while 409 request-in-progress or 503 (bounded by lease + grace +
margin), once more after it ran. Each key is classified (tests/faults/key_outcomes.py) and compared
with `expected("http", point, kind, store)`; one scorecard line per run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from tests.faults.key_outcomes import (
    DOWN,
    LEASE,
    STALL,
    STORE_FAULTS,
    TTL,
    KeyEnd,
    StoreSite,
    cleanup,
    effects,
    judge,
    plan_for,
    prepare,
    settle,
    store_site,
)
from tests.support.fault_matrix import Kind, Store
from tests.support.fault_points import Plan, arrived, release
from tests.support.scorecard import Answer, http_post, report
from tests.support.servers import PostgresCluster, UvicornProcess, postgres_cluster, reachable
from tests.support.stores import TEST_TABLE

KINDS: Final[tuple[Kind, ...]] = ("sigkill", "graceful_stop", "cancelled", "store_outage", "store_stall")
CELLS = [
    pytest.param(kind, store, id=f"{kind}-{store}", marks=[pytest.mark.slow, getattr(pytest.mark, store)])
    for store in ("redis", "postgres")
    for kind in KINDS
]
TOKENS: Final = {
    "replay": "stored",
    "first": "ran",
    "409:request-in-progress": "in_progress",
    "409:outcome-unknown": "unknown",
    "503": "unavailable",
    "conn_error": "unavailable",
}
APP: Final = "tests.faults.http_app:app"


@pytest.fixture(scope="module")
def throwaway_postgres() -> Iterator[PostgresCluster]:
    """One throwaway cluster for this module's Postgres store faults (each run has its own namespace)."""
    with postgres_cluster() as cluster:
        yield cluster


def worker(env: dict[str, str], log: Path, *, graceful: int) -> UvicornProcess:
    """tests/faults/http_app.py under uvicorn (one worker), its graceful shutdown bounded by `graceful` s."""
    args = ["--lifespan", "on", "--timeout-graceful-shutdown", str(graceful)]
    return UvicornProcess(APP, env, log, args=args)


async def retry(port: int, key: str) -> tuple[str, float]:
    """One settle POST: what it got, and its Retry-After (or 0.25 s) when it is to be retried."""
    answer = await http_post(port, key, timeout=15)
    got = TOKENS.get(answer.outcome, f"error:{answer.outcome}")
    if got in ("stored", "ran") and json.loads(answer.body).get("result") != f"applied {key}":
        got = f"error:answer {answer.body[:80]!r}"
    return got, float(answer.header(b"retry-after") or 0.25)


async def refusing(server: UvicornProcess, within: float = 10.0) -> float:
    """Wait until the server's graceful shutdown has begun (it closed its listening socket: a new
    connection is refused); how long that took."""
    began = time.monotonic()
    while await asyncio.to_thread(reachable, f"http://127.0.0.1:{server.port}"):
        assert time.monotonic() - began < within, "uvicorn never began its shutdown"
        await asyncio.sleep(0.02)
    return round(time.monotonic() - began, 3)


async def fault(kind: Kind, site: StoreSite, server: UvicornProcess, plan: Plan) -> dict[str, Any]:
    """Apply the fault to the worker whose keys all sit at their points; what it did (for the line)."""
    keys = list(plan.points)
    seen: dict[str, Any] = {}
    if kind == "sigkill":
        server.signal(signal.SIGKILL)
        seen["exit"] = await server.wait_dead(10)
    elif kind in ("graceful_stop", "cancelled"):
        server.signal(signal.SIGTERM)
        if kind == "graceful_stop":
            seen["shutdown_began_s"] = await refusing(server)
            await release(plan, keys)
        seen["exit"] = await server.wait_dead(30)
        seen["cancelled_by_uvicorn"] = "timeout graceful shutdown exceeded" in server.tail()
    elif kind == "store_outage":
        await asyncio.to_thread(site.kill)
        await release(plan, keys)
        await asyncio.sleep(DOWN)
        await asyncio.to_thread(site.start)
    else:
        site.freeze()
        try:
            await release(plan, keys)
            await asyncio.sleep(STALL)
        finally:
            site.thaw()
    return seen


@pytest.mark.parametrize(("kind", "store"), CELLS)
async def test_http_cells(kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Every HTTP cell of this (kind, store) ends as the table says."""
    with store_site(kind, store, tmp_path, request) as site:
        await run_cells(kind, store, site, tmp_path)


async def run_cells(kind: Kind, store: Store, site: StoreSite, tmp_path: Path) -> None:
    run = f"http-{kind}-{uuid.uuid4().hex[:8]}"
    plan = plan_for("http", kind, store, run)
    keys = list(plan.points)
    namespace, prefix = f"matrix-{run}", f"idem-fault-store:{run}:"
    env = {
        **os.environ,
        **plan.env(),
        "IDEM_FAULT_STORE": site.url,
        "IDEM_FAULT_PREFIX": prefix,
        "IDEM_FAULT_TABLE": TEST_TABLE,
        "IDEM_FAULT_NAMESPACE": namespace,
        "IDEM_FAULT_LEASE": str(LEASE),
        "IDEM_FAULT_TTL": str(TTL),
        "IDEM_FAULT_POOL": "6",
    }
    times: dict[str, float] = {}
    servers: list[UvicornProcess] = []
    started = time.monotonic()
    try:
        await prepare(site)
        faulted = worker(env, tmp_path / "faulted.log", graceful=1 if kind == "cancelled" else 30)
        servers.append(faulted)
        fresh = worker({**env, "IDEM_FAULT_UNSTOPPED": "1"}, tmp_path / "settle.log", graceful=5)
        servers.append(fresh)
        await asyncio.gather(faulted.wait_ready(), fresh.wait_ready())
        times["start_s"] = time.monotonic() - started

        began = time.monotonic()
        sent = [asyncio.create_task(http_post(faulted.port, k, timeout=60)) for k in keys]
        there = await arrived(plan, keys, within=20)
        assert there == set(keys), f"never reached their points: {sorted(set(keys) - there)}"
        seen = await fault(kind, site, faulted, plan)
        answers: list[Answer] = await asyncio.gather(*sent)
        before = await effects(site, plan)
        times["fault_s"] = time.monotonic() - began

        began = time.monotonic()
        settled = await asyncio.gather(*(settle(lambda k=k: retry(fresh.port, k)) for k in keys))  # type: ignore[misc]
        after = await effects(site, plan)
        times["settle_s"] = time.monotonic() - began

        ends = [KeyEnd(k, plan.points[k], before[k], after[k], trace) for k, trace in zip(keys, settled, strict=True)]
        first_answers = {a.key: a.error or a.outcome for a in answers}
        extra = {
            **seen,
            "first_answers": sorted(set(first_answers.values())),
            **{k: round(v, 2) for k, v in times.items()},
        }
        line, failures = judge("http", kind, store, ends, extra)
        line["wall_s"] = round(time.monotonic() - started, 2)
        report(line)
        if kind == "sigkill":
            assert seen["exit"] == -signal.SIGKILL, f"worker exit {seen['exit']}"
        if kind == "cancelled":
            assert seen["cancelled_by_uvicorn"], f"uvicorn did not cancel the requests: {faulted.tail()}"
        if kind in STORE_FAULTS or kind == "graceful_stop":
            assert all(a.status for a in answers), f"requests left unanswered: {first_answers}"
        assert not failures, "\n".join(failures)
    finally:
        await asyncio.gather(*(asyncio.to_thread(s.stop) for s in servers))
        site.heal()
        try:
            await cleanup(site, plan, prefix=prefix, namespace=namespace)
        finally:
            await plan.aclose()
