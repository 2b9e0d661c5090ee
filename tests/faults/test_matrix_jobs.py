"""The fault matrix's job cells (tests/support/fault_matrix.py, surface `job`): every point of a
claim under every kind of fault, on Redis and on Postgres, with `@idempotent` in a process of its own.

One test per (kind, store): a job process (tests/faults/job_process.py) calls its `@idempotent` job
(body `fault_points.work`, store `PointStore(<the real store>)`) for `PER_POINT` keys per point at
once (`asyncio.gather`), each key stopping at its own point; once all sit there the fault is applied:

- sigkill: SIGKILL the process; nothing is released;
- graceful_stop: SIGTERM, which cancels the process's main task (`loop.add_signal_handler`), and
  with it every call; nothing is released;
- cancelled: each call runs inside `asyncio.wait_for(..., CANCEL_AFTER)`, which fires while the keys
  sit at their points (no signal); nothing is released;
- store_outage: the store (an fsynced redis-server / a throwaway Postgres cluster stopped
  `-m immediate`) is killed, the keys released while it is down, and it is started again on the
  same port and data after `DOWN` s; the process ends once its calls did (a call whose completion
  write failed waits for its retry);
- store_stall: the store is SIGSTOPped, the keys released while it is stopped, resumed after two
  leases.

Then the test settles every key with the same job (same function, key and namespace) on the same
store in this process: called again, again while `InProgress` (bounded by lease + grace + margin),
once more after it ran. Each key is classified (tests/faults/key_outcomes.py) and compared with
`expected("job", point, kind, store)`; one scorecard line per run (with `unanswered_claims_left`:
the claims whose reply the store stall lost that the process's store still had to remove when it
closed, as its log says).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from idem_asgi.errors import BackendUnavailable, InProgress, OutcomeUnknown
from tests.faults.job_process import make_job
from tests.faults.key_outcomes import (
    DOWN,
    LEASE,
    STALL,
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
from tests.support.fault_points import Plan, PointStore, arrived, counts, release
from tests.support.scorecard import report
from tests.support.servers import ROOT, PostgresCluster, postgres_cluster
from tests.support.stores import TEST_TABLE, store_from_url

KINDS: Final[tuple[Kind, ...]] = ("sigkill", "graceful_stop", "cancelled", "store_outage", "store_stall")
CELLS = [
    pytest.param(kind, store, id=f"{kind}-{store}", marks=[pytest.mark.slow, getattr(pytest.mark, store)])
    for store in ("redis", "postgres")
    for kind in KINDS
]
CANCEL_AFTER: Final = 4.0
"""The `wait_for` timeout around each call of a `cancelled` run: its keys reach their points well before."""


@pytest.fixture(scope="module")
def throwaway_postgres() -> Iterator[PostgresCluster]:
    """One throwaway cluster for this module's Postgres store faults (each run has its own namespace)."""
    with postgres_cluster() as cluster:
        yield cluster


class JobProcess:
    """tests/faults/job_process.py with `config` and the plan's environment; its stderr in `log`."""

    def __init__(self, config: dict[str, Any], plan: Plan, log: Path) -> None:
        self.log = log
        env = {**os.environ, **plan.env(), "PYTHONPATH": str(ROOT)}
        with log.open("wb") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.faults.job_process", json.dumps(config)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=errors,
                start_new_session=True,
            )

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def ended(self, within: float) -> tuple[int | None, dict[str, str]]:
        """Its exit code and the outcome of each call (none when it was killed), once it exited."""
        try:
            out, _ = await asyncio.to_thread(self.proc.communicate, timeout=within)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # its stacks, into the log (faulthandler)
            await asyncio.sleep(0.5)
            return None, {}
        lines = [line for line in out.decode().splitlines() if line.startswith("{")]
        outcomes: dict[str, str] = json.loads(lines[-1])["outcomes"] if lines else {}
        return self.proc.returncode, outcomes

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.communicate(timeout=10)


async def fault(kind: Kind, site: StoreSite, process: JobProcess, plan: Plan) -> None:
    """Apply the fault to the process whose keys all sit at their points."""
    keys = list(plan.points)
    if kind == "sigkill":
        process.signal(signal.SIGKILL)
    elif kind == "graceful_stop":
        process.signal(signal.SIGTERM)
    elif kind == "cancelled":
        pass  # each call's own timeout fires while it sits at its point
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


class Settler:
    """The same job in this process, on the same store and namespace; its plan never stops a key."""

    def __init__(self, site: StoreSite, plan: Plan, *, prefix: str, namespace: str) -> None:
        self.plan = plan
        self.unstopped = Plan(plan.run, plan.points, stops=False)
        self.store = PointStore(store_from_url(site.url, prefix=prefix, table=TEST_TABLE, pool=8), self.unstopped)
        self.job = make_job(self.store, self.unstopped, namespace=namespace, lease=LEASE, ttl=TTL)

    async def retry(self, key: str) -> tuple[str, float]:
        """One call: `stored` (its stored result, `ran` unchanged), `ran`, `in_progress`, `unknown`, ..."""
        ran = (await counts(self.plan, [key], "ran"))[key]
        try:
            value = await self.job(key)
        except InProgress:
            return "in_progress", 0.25
        except OutcomeUnknown:
            return "unknown", 0.0
        except BackendUnavailable:
            return "unavailable", 0.25
        except Exception as exc:
            return f"error:{type(exc).__name__}: {exc}", 0.0
        if value != f"applied {key}":
            return f"error:result {value!r}", 0.0
        return ("ran" if (await counts(self.plan, [key], "ran"))[key] > ran else "stored"), 0.0

    async def aclose(self) -> None:
        try:
            await self.store.aclose()
        finally:
            await self.unstopped.aclose()


@pytest.mark.parametrize(("kind", "store"), CELLS)
async def test_job_cells(kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Every job cell of this (kind, store) ends as the table says."""
    with store_site(kind, store, tmp_path, request) as site:
        await run_cells(kind, store, site, tmp_path)


async def run_cells(kind: Kind, store: Store, site: StoreSite, tmp_path: Path) -> None:
    run = f"job-{kind}-{uuid.uuid4().hex[:8]}"
    plan = plan_for("job", kind, store, run)
    keys = list(plan.points)
    namespace, prefix = f"matrix-{run}", f"idem-fault-store:{run}:"
    config = {
        "store": site.url,
        "prefix": prefix,
        "table": TEST_TABLE,
        "namespace": namespace,
        "lease": LEASE,
        "ttl": TTL,
        "pool": 6,
        "timeout": CANCEL_AFTER if kind == "cancelled" else None,
    }
    times: dict[str, float] = {}
    process: JobProcess | None = None
    settler: Settler | None = None
    started = time.monotonic()
    try:
        await prepare(site)
        process = JobProcess(config, plan, tmp_path / "job.log")
        there = await arrived(plan, keys, within=20)
        assert there == set(keys), f"never reached their points: {sorted(set(keys) - there)}: {process.tail()}"
        times["arrived_s"] = time.monotonic() - started

        began = time.monotonic()
        await fault(kind, site, process, plan)
        code, outcomes = await process.ended(45)
        before = await effects(site, plan)
        times["fault_s"] = time.monotonic() - began

        began = time.monotonic()
        settler = Settler(site, plan, prefix=prefix, namespace=namespace)
        settled = await asyncio.gather(*(settle(lambda k=k: settler.retry(k)) for k in keys))  # type: ignore[misc]
        after = await effects(site, plan)
        times["settle_s"] = time.monotonic() - began

        ends = [KeyEnd(k, plan.points[k], before[k], after[k], trace) for k, trace in zip(keys, settled, strict=True)]
        calls = sorted(set(outcomes.values()))
        left = re.search(r"closing with (\d+) unanswered claims", process.tail())
        extra = {
            "exit": code,
            "calls": calls,
            "unanswered_claims_left": int(left.group(1)) if left else 0,
            **{k: round(v, 2) for k, v in times.items()},
        }
        line, failures = judge("job", kind, store, ends, extra)
        line["wall_s"] = round(time.monotonic() - started, 2)
        report(line)
        want_exit = -signal.SIGKILL if kind == "sigkill" else 0
        assert code == want_exit, f"job process exit {code}, not {want_exit}: {process.tail()}"
        if kind in ("graceful_stop", "cancelled"):
            stopped = "CancelledError" if kind == "graceful_stop" else "TimeoutError"
            assert calls == [stopped], f"the calls ended {outcomes}, not all {stopped}"
        assert not failures, "\n".join(failures)
    finally:
        if process is not None:
            await asyncio.to_thread(process.kill)
        if settler is not None:
            await settler.aclose()
        site.heal()
        try:
            await cleanup(site, plan, prefix=prefix, namespace=namespace)
        finally:
            await plan.aclose()
