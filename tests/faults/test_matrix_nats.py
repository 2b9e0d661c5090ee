"""The fault matrix's NATS cells (tests/support/fault_matrix.py, surfaces `nats_pull` and
`nats_push`): every point of a claim under every kind of fault, on Redis and on Postgres.

One test per (kind, store) runs both surfaces at once, each in a consumer process of its own
(tests/faults/nats_process.py) on a stream of its own: ~2 messages per point (Nats-Msg-Id
`<run>-<point>-<i>`), all published first, so the pull consumer's first fetch holds them all and
the push consumer (`max_ack_pending` 50) has them all in flight. Once every key sits at its point
(tests/support/fault_points.py), the fault is applied to both processes (a store or broker fault to
the throwaway server they share); for a fault that lets the work go on the keys are released (after
the signal, or while the store or broker is down or stalled), the test waits until the process has
no delivery left running and stops it gracefully. Then a consumer in the test (the same durable,
namespace and store, the same kind: a fetch loop or a push subscription) settles what is left,
until JetStream's ack floor passed every message with nothing pending or ack-pending. Dead letters
are JetStream's MSG_TERMINATED / MAX_DELIVERIES advisories for the stream and the adapter's copies
(`dead_letter=`, with `Idem-Dead-Reason`), both kept in a dead-letter stream.

Each key is classified: `once` (effect 1, made before the settle phase, ran once, its redelivery
if any acked without running; an `in_transaction` key rolled back then run again once: killed
before COMMIT and run again by the settle consumer, or its transaction lost with the Postgres
server that was killed under it, its COMMIT failed, and run again by the process once the store was
back), `blocked` (dead-lettered as outcome unknown, never run again, effect 0 after the claim, 1
mid-effect or before the store write), `later` (never ran before the settle phase, run there
once), else what happened; and compared with `expected(...)`. One scorecard-style line per
(surface, kind, store).

How each kind is made here (the process's side is in tests/faults/nats_process.py): sigkill is
SIGKILL; graceful_stop is SIGTERM cancelling the main task (the `async with` block drains); channel_lost is
`unsubscribe()` of the push or the pull subscription; cancelled is the cancellation of the
callback's task by the client: for pull the fetch-loop task awaiting the batch's gather is cancelled
(each `on_message(m)` with it); for push `nc.close()`, which cancels the subscription's callback task
(a push callback has returned already: each delivery runs in a task of its own) and also loses the
acks, so the redeliveries reach the settle consumer; store_outage kills the throwaway store
(redis-server with `appendfsync always`; a throwaway Postgres cluster stopped `-m immediate`) for
3 s; store_stall SIGSTOPs it for two leases; broker_restart SIGKILLs a throwaway nats-server (file
storage) for 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import asyncpg
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from idem_asgi.jobs.consumers import nats_handler
from tests.support import fault_points
from tests.support.fault_matrix import KINDS, POINTS, STORES, Kind, Point, Store, Surface, expected
from tests.support.fault_points import Plan, work
from tests.support.leftovers import IGNORE_CLIENT_LEFTOVERS, collect_client_leftovers
from tests.support.nats_server import NatsProcess, nats_process
from tests.support.scorecard import report
from tests.support.servers import (
    POSTGRES_DSN,
    REDIS_URL,
    ROOT,
    PostgresCluster,
    RedisProcess,
    postgres_cluster,
    require,
)
from tests.support.store_outage import fsynced_redis
from tests.support.stores import TEST_TABLE

NATS: Final = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")
pytestmark = [pytest.mark.slow, pytest.mark.redis, IGNORE_CLIENT_LEFTOVERS]
__all__ = ["collect_client_leftovers"]  # the fixture: the broker restart leaves nats-py's attempts behind

SURFACES: Final[tuple[Surface, ...]] = ("nats_pull", "nats_push")
PER_POINT: Final = 2
LEASE: Final = 2.0
ACK_WAIT: Final = 2.0
MAX_DELIVER: Final = 10
"""Enough for a dead holder's redeliveries (nak'd 0.5 s, 1 s, 2 s ...) to outlast its lease and grace."""
DOWN: Final = 3.0
"""Seconds a killed store stays down."""
BROKER_DOWN: Final = 2.0
QUIET: Final = 0.5
"""Seconds to look again once everything settled: a late redelivery or dead letter would show."""
STORE_FAULTS: Final = ("store_outage", "store_stall")
BLOCKED_EFFECT: Final[dict[str, int]] = {"after_claim": 0, "mid_effect": 1, "before_store": 1}
"""A blocked key's effect count, by its point: the holder died before its effect, or after it."""


async def until(condition: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, f"timed out after {within}s waiting for {what}"
        await asyncio.sleep(0.05)


# --- the servers of a run: shared ones, or throwaway ones a fault breaks -------------------------------


class StoreServer:
    """Where the runs' records live: the shared Redis or Postgres, or a throwaway server the fault breaks."""

    def __init__(
        self,
        kind: Store,
        url: str,
        *,
        redis: RedisProcess | None = None,
        cluster: PostgresCluster | None = None,
    ) -> None:
        self.kind = kind
        self.url = url
        self.redis = redis
        self.cluster = cluster

    def down(self) -> None:
        if self.redis is not None:
            self.redis.kill()
        else:
            assert self.cluster is not None
            self.cluster.stop()  # `pg_ctl stop -m immediate`: every backend dies, crash recovery on start

    def up(self) -> None:
        if self.redis is not None:
            self.redis.start()
        else:
            assert self.cluster is not None
            self.cluster.start()

    def freeze(self) -> None:
        if self.redis is not None:
            self.redis.signal(signal.SIGSTOP)
        else:
            assert self.cluster is not None
            self.cluster.freeze()

    def thaw(self) -> None:
        if self.redis is not None:
            self.redis.signal(signal.SIGCONT)
        else:
            assert self.cluster is not None
            self.cluster.thaw()

    def store(self, prefix: str) -> Any:
        """A store on this server for the test's own consumer (not set up: `setup()` for Postgres)."""
        if self.kind == "postgres":
            from idem_asgi.backends.postgres import PostgresBackend

            return PostgresBackend.from_dsn(self.url, table=TEST_TABLE, min_size=1, max_size=20)
        from idem_asgi.backends.redis import RedisBackend

        return RedisBackend.from_url(self.url, prefix=prefix)

    async def ledger(self) -> Any:
        """A connection to the database whose `fault_ledger` holds the `in_transaction` effects."""
        return await asyncpg.connect(self.url)


@pytest.fixture(scope="module")
def throwaway_postgres() -> Iterator[PostgresCluster]:
    """One throwaway cluster for the Postgres store faults (each run has its own namespace)."""
    with postgres_cluster() as cluster:
        yield cluster


@contextlib.contextmanager
def store_server(kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StoreServer]:
    if store == "redis":
        require("redis", REDIS_URL)
        if kind not in STORE_FAULTS:
            yield StoreServer("redis", REDIS_URL)
            return
        with fsynced_redis(tmp_path / "redis") as server:  # every write fsynced: a kill loses nothing
            yield StoreServer("redis", server.url, redis=server)
        return
    if kind not in STORE_FAULTS:
        require("postgres", POSTGRES_DSN)
        yield StoreServer("postgres", POSTGRES_DSN)
        return
    cluster: PostgresCluster = request.getfixturevalue("throwaway_postgres")
    cluster.thaw()
    if not (cluster.data / "postmaster.pid").exists():
        cluster.start()
    yield StoreServer("postgres", cluster.dsn, cluster=cluster)


# --- one surface's run: its stream, its process, its keys --------------------------------------------


class Process:
    """tests/faults/nats_process.py with `settings`; its stdout read line by line, its stderr in a file."""

    def __init__(self, log: Path, plan: Plan, settings: dict[str, Any]) -> None:
        self.log = log
        self.plan = plan
        self.settings = settings
        self.lines: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: asyncio.Future[None] | None = None

    async def start(self) -> None:
        argv = [sys.executable, "-m", "tests.faults.nats_process", json.dumps(self.settings)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.plan.env()}
        with self.log.open("wb") as errors:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - its output is read in a thread below
                argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errors
            )
        self.reader = asyncio.ensure_future(self._read())
        await self.said("ready", 30)

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await asyncio.to_thread(self.proc.stdout.readline):
            self.lines.append(line.decode(errors="replace").strip())

    async def said(self, word: str, within: float) -> None:
        deadline = time.monotonic() + within
        while word not in self.lines:
            assert self.proc is not None
            if self.proc.poll() is not None and self.reader is not None and self.reader.done():
                raise AssertionError(f"the consumer exited ({self.proc.returncode}) before {word!r}: {self.tail()}")
            assert time.monotonic() < deadline, f"no {word!r} within {within}s: {self.tail()}"
            await asyncio.sleep(0.02)

    def send(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def ended(self, within: float) -> int:
        assert self.proc is not None
        try:
            code = await asyncio.to_thread(self.proc.wait, within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the consumer did not exit within {within}s: {self.tail()}") from None
        if self.reader is not None:
            await self.reader
        return code

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    async def aclose(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)
        if proc.stdout is not None:
            proc.stdout.close()


class Run:
    """One surface's run: its plan (keys at every point of this store), stream, dead-letter stream,
    durable, namespace, its consumer process, and what each key came to."""

    def __init__(self, surface: Surface, kind: Kind, store: Store, server: StoreServer, nats_url: str) -> None:
        self.surface, self.kind, self.store, self.server, self.nats_url = surface, kind, store, server, nats_url
        run = f"{surface.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
        points = [p for p in POINTS if expected(surface, p, kind, store) is not None]
        self.points: dict[str, Point] = {f"{run}-{p}-{i}": p for p in points for i in range(PER_POINT)}
        self.plan = Plan(run, dict(self.points))
        self.keys = list(self.points)
        self.stream = f"IDEM_FAULT_{run.replace('-', '_')}"
        self.dead = f"{self.stream}_DEAD"
        self.subject = f"idem-fault.{run}.payments"
        self.dead_subject = f"idem-fault-dead.{run}"
        self.durable = "workers"
        self.namespace = f"matrix-{run}"
        self.prefix = f"idem-fault-store:{run}:"
        self.seqs: dict[int, str] = {}
        self.process: Process | None = None
        self.before: dict[str, tuple[int, int]] = {}  # key -> (effect, ran) when the settle phase began
        self.dead_letters: dict[str, str] = {}  # key -> why (the copy's reason, or the advisory's kind)
        self.advisories: Counter[str] = Counter()
        self.taken: Counter[str] = Counter()  # deliveries per key to the test's settling consumer
        self.settle_s = 0.0

    @property
    def push(self) -> bool:
        return self.surface == "nats_push"

    async def create(self, js: Any) -> None:
        await js.add_stream(StreamConfig(name=self.stream, subjects=[f"idem-fault.{self.plan.run}.>"]))
        advisories = [
            f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.stream}.*",
            f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{self.stream}.*",
        ]
        await js.add_stream(StreamConfig(name=self.dead, subjects=[*advisories, self.dead_subject]))
        config = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT,
            max_deliver=MAX_DELIVER,
            max_ack_pending=50,
        )
        if self.push:
            config.deliver_subject = f"idem-fault-deliver.{self.plan.run}"
            config.deliver_group = self.durable
        await js.add_consumer(self.stream, config)
        for key in self.keys:
            ack = await js.publish(self.subject, b'{"amount": 100}', headers={"Nats-Msg-Id": key})
            self.seqs[int(ack.seq)] = key

    def settings(self) -> dict[str, Any]:
        return {
            "surface": self.surface,
            "url": self.nats_url,
            "stream": self.stream,
            "subject": self.subject,
            "durable": self.durable,
            "dead_letter": self.dead_subject,
            "store": self.store,
            "store_url": self.server.url,
            "prefix": self.prefix,
            "table": TEST_TABLE,
            "namespace": self.namespace,
            "lease": LEASE,
            "batch": 2 * len(self.keys),
        }

    async def start(self, tmp_path: Path) -> None:
        self.process = Process(tmp_path / f"{self.surface}.log", self.plan, self.settings())
        await self.process.start()

    async def idle(self, within: float) -> None:
        """Wait until the process has no delivery being worked on."""
        name = f"fault:{self.plan.run}:running:{self.surface}"

        async def none_running() -> bool:
            return await self.plan.redis.get(name) in (b"0", "0")

        try:
            await until(none_running, within, f"{self.surface}: every delivery's work done")
        except AssertionError as exc:
            assert self.process is not None
            self.process.send(signal.SIGQUIT)  # its tasks' stacks, into its log
            await asyncio.sleep(0.5)
            raise AssertionError(f"{exc}: {self.process.tail()}") from None

    async def stop(self) -> None:
        """A graceful stop (SIGTERM: the block drains), and its exit."""
        assert self.process is not None
        self.process.send(signal.SIGTERM)
        code = await self.process.ended(40)
        assert code == 0, self.process.tail()

    async def effects(self) -> dict[str, tuple[int, int]]:
        """(effect, ran) per key: the Redis INCR, or the committed ledger row of an `in_transaction` key."""
        effect = await fault_points.counts(self.plan, self.keys)
        ran = await fault_points.counts(self.plan, self.keys, "ran")
        ledgered = [k for k in self.keys if self.points[k] == "in_transaction"]
        if ledgered:
            conn = await self.server.ledger()
            try:
                effect.update(await fault_points.ledger_rows(conn, self.plan, ledgered))
            finally:
                await conn.close()
        return {k: (effect[k], ran[k]) for k in self.keys}

    async def settle(self, within: float) -> None:
        """A consumer in this test on the same durable, namespace and store takes what is left, until
        the ack floor passed every message and nothing is pending or ack-pending."""
        self.before = await self.effects()
        started = time.monotonic()
        store = self.server.store(self.prefix)
        if self.store == "postgres":
            await store.setup()
        unstopped = Plan(self.plan.run, dict(self.points), stops=False)

        async def handle(msg: Any) -> str:
            return await work(unstopped, msg.headers["Nats-Msg-Id"], store)

        on_message = nats_handler(store, handle, namespace=self.namespace, lease=LEASE, dead_letter=self.dead_subject)

        async def deliver(msg: Any) -> None:
            self.taken[msg.headers["Nats-Msg-Id"]] += 1
            await on_message(msg)

        nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = nc.jetstream()
        fetching: asyncio.Future[None] | None = None
        try:
            if self.push:
                await js.subscribe(
                    self.subject, queue=self.durable, durable=self.durable, stream=self.stream, manual_ack=True,
                    cb=deliver,
                )  # fmt: skip
            else:
                sub = await js.pull_subscribe_bind(durable=self.durable, stream=self.stream)

                async def loop() -> None:
                    while True:
                        try:
                            batch = await sub.fetch(20, timeout=0.5)
                        except Exception:  # no message yet (nats-py raises either timeout)
                            continue
                        await asyncio.gather(*(deliver(msg) for msg in batch))

                fetching = asyncio.ensure_future(loop())
            last = max(self.seqs)

            async def settled() -> bool:
                try:
                    info = await js.consumer_info(self.stream, self.durable)
                except Exception:  # the restarted server is not ready yet
                    return False
                floor = int(info.ack_floor.stream_seq if info.ack_floor is not None else 0)
                idle = info.num_pending == 0 and info.num_ack_pending == 0 and on_message.running == 0
                return bool(idle and floor >= last)

            try:
                await until(settled, within, f"{self.surface}: the durable settled")
                await asyncio.sleep(QUIET)
                await until(settled, within, f"{self.surface}: the durable settled")
            except AssertionError as exc:
                info = await js.consumer_info(self.stream, self.durable)
                raise AssertionError(f"{exc}: {info}") from None
            self.settle_s = time.monotonic() - started
            await self.read_dead_letters(js)
        finally:
            if fetching is not None:
                fetching.cancel()
                await asyncio.gather(fetching, return_exceptions=True)
            await on_message.drain(10)
            await nc.close()
            await store.aclose()

    async def read_dead_letters(self, js: Any) -> None:
        info = await js.stream_info(self.dead)
        first = int(info.state.first_seq)
        for seq in range(first, first + int(info.state.messages)):
            raw = await js.get_msg(self.dead, seq)
            if raw.subject == self.dead_subject:
                headers = raw.headers or {}
                self.dead_letters[headers.get("Nats-Msg-Id", "?")] = headers.get("Idem-Dead-Reason", "")
                continue
            advisory = json.loads(raw.data or b"{}")
            kind = str(advisory.get("type", "")).rsplit(".", 1)[-1]
            self.advisories[kind] += 1
            key = self.seqs.get(int(advisory.get("stream_seq", 0)), "?")
            self.dead_letters.setdefault(key, kind)

    def outcome(self, key: str, after: tuple[int, int]) -> str:
        """once / blocked / later, or what happened instead."""
        (effect0, ran0), (effect, ran) = self.before[key], after
        why = self.dead_letters.get(key)
        if why is not None:
            unknown = "outcome unknown" in why and (effect, ran) == (effect0, ran0) and ran == 1
            if unknown and effect == BLOCKED_EFFECT.get(self.points[key]):
                return "blocked"
            return f"dead-lettered ({why}) effect {effect} ran {ran}"
        if (effect, ran) == (1, 1) and effect0 == 1:
            return "once"
        if self.points[key] == "in_transaction" and (effect, ran) == (1, 2) and ran0 >= 1:
            # Rolled back (with its killed holder, or by the store's crash under its open transaction),
            # then run again once: by the settle consumer, or by the process itself once the store was back.
            return "once"
        if (effect, ran) == (1, 1) and ran0 == 0:
            return "later"
        return f"effect {effect0}->{effect} ran {ran0}->{ran}"

    async def cleanup(self, js: Any) -> None:
        if self.process is not None:  # first: a process left running would write its counters again
            await self.process.aclose()
        for name in (self.stream, self.dead):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        await fault_points.cleanup(self.plan)
        if self.store == "redis" and self.server.url == REDIS_URL:
            found = [k async for k in self.plan.redis.scan_iter(match=f"{self.prefix}*", count=1000)]
            if found:
                await self.plan.redis.delete(*found)
        elif self.store == "postgres":
            with contextlib.suppress(Exception):
                conn = await self.server.ledger()
                try:
                    await conn.execute(f"DELETE FROM {TEST_TABLE} WHERE namespace = $1", self.namespace)
                    await conn.execute(f"DELETE FROM {fault_points.LEDGER} WHERE run = $1", self.plan.run)
                finally:
                    await conn.close()
        await self.plan.aclose()


# --- the faults -----------------------------------------------------------------------------------------


async def release(runs: list[Run]) -> None:
    for run in runs:
        await fault_points.release(run.plan, run.keys)


async def idle_then_stop(runs: list[Run], within: float = 40) -> None:
    await asyncio.gather(*(run.idle(within) for run in runs))
    await asyncio.gather(*(run.stop() for run in runs))


async def apply(kind: Kind, runs: list[Run], server: StoreServer, broker: NatsProcess | None) -> None:
    """The fault, to both surfaces' processes; the keys released where it lets their work go on."""
    processes = [run.process for run in runs]
    assert all(p is not None for p in processes)
    live = [p for p in processes if p is not None]
    if kind == "sigkill":
        for process in live:
            process.send(signal.SIGKILL)
        codes = [await process.ended(10) for process in live]
        assert codes == [-signal.SIGKILL] * len(live)
    elif kind == "graceful_stop":
        for process in live:
            process.send(signal.SIGTERM)
        for process in live:
            await process.said("stopping", 10)
        await release(runs)
        codes = [await process.ended(40) for process in live]
        assert codes == [0] * len(live), [p.tail() for p in live]
    elif kind in ("channel_lost", "cancelled"):
        sig, word = (signal.SIGUSR1, "unsubscribed") if kind == "channel_lost" else (signal.SIGUSR2, "cancelled")
        for process in live:
            process.send(sig)
        for process in live:
            await process.said(word, 10)
        await release(runs)
        await idle_then_stop(runs)
    elif kind == "store_outage":
        await asyncio.to_thread(server.down)
        await release(runs)
        await asyncio.sleep(DOWN)
        await asyncio.to_thread(server.up)
        await idle_then_stop(runs)
    elif kind == "store_stall":
        server.freeze()
        try:
            await release(runs)
            await asyncio.sleep(2 * LEASE)
        finally:
            server.thaw()
        await idle_then_stop(runs)
    else:
        assert kind == "broker_restart" and broker is not None
        broker.kill()
        await release(runs)
        await asyncio.sleep(BROKER_DOWN)
        await asyncio.to_thread(broker.start)
        await idle_then_stop(runs)


CASES = [
    pytest.param(kind, store, id=f"{kind}-{store}", marks=[getattr(pytest.mark, store)])
    for kind in KINDS
    for store in STORES
]


@pytest.mark.parametrize(("kind", "store"), CASES)
async def test_nats_pull_and_push_consumers_meet_their_fault_matrix_cells(
    kind: Kind, store: Store, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    require("nats", NATS)
    started = time.monotonic()
    with contextlib.ExitStack() as servers:
        server = servers.enter_context(store_server(kind, store, tmp_path, request))
        broker = servers.enter_context(nats_process(tmp_path / "nats")) if kind == "broker_restart" else None
        nats_url = broker.url if broker is not None else NATS
        admin = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = admin.jetstream()
        runs = [Run(surface, kind, store, server, nats_url) for surface in SURFACES]
        try:
            if store == "postgres":
                conn = await server.ledger()
                try:
                    await fault_points.ensure_ledger(conn)
                finally:
                    await conn.close()
            for run in runs:
                await run.create(js)
            await asyncio.gather(*(run.start(tmp_path) for run in runs))
            for run in runs:
                reached = await fault_points.arrived(run.plan, run.keys, 30)
                assert reached == set(run.keys), f"{run.surface}: never reached {sorted(set(run.keys) - reached)}"
            fault_started = time.monotonic()
            await apply(kind, runs, server, broker)
            fault_s = time.monotonic() - fault_started
            await asyncio.gather(*(run.settle(within=40) for run in runs))
            wrong = []
            for run in runs:
                wrong += await judged(run, fault_s, time.monotonic() - started)
        finally:
            for run in runs:
                await run.cleanup(js)
            await admin.close()
    assert not wrong, "cells that did not behave as the matrix says:\n" + "\n".join(wrong)


async def judged(run: Run, fault_s: float, run_s: float) -> list[str]:
    """Each key's outcome against its cell; one scorecard line for the run; the cells that differ."""
    after = await run.effects()
    got: dict[Point, Counter[str]] = {}
    wrong = []
    for key in run.keys:
        point = run.points[key]
        outcome = run.outcome(key, after[key])
        got.setdefault(point, Counter())[outcome] += 1
        cell = expected(run.surface, point, run.kind, run.store)
        if outcome != cell:
            wrong.append(f"{run.surface} {point} {run.kind} {run.store}: expected {cell}, got {outcome} ({key})")
    report(
        {
            "test": "fault_matrix",
            "surface": run.surface,
            "kind": run.kind,
            "store": run.store,
            "cells": {
                point: {"expected": expected(run.surface, point, run.kind, run.store), "got": dict(outcomes)}
                for point, outcomes in got.items()
            },
            "effects": {p: sum(after[k][0] for k in run.keys if run.points[k] == p) for p in got},
            "dead_lettered": len(run.dead_letters),
            "advisories": dict(run.advisories),
            "settle_deliveries": {p: sum(run.taken[k] for k in run.keys if run.points[k] == p) for p in got},
            "fault_s": round(fault_s, 1),
            "settle_s": round(run.settle_s, 1),
            "run_s": round(run_s, 1),
        },
        tag="FAULT_MATRIX",
    )
    return wrong
