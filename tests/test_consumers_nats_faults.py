"""`nats_handler` when the store or the broker fails, and its checks against the consumer's own
config: a Redis restart mid-stream (a throwaway redis-server, every write fsynced), a NATS server
restart mid-stream (a throwaway nats-server with its store directory), an ephemeral or ordered
consumer without `namespace=`, and `progress_every` against the consumer's `ack_wait`. The rig
(stream, durable `workers` with `ack_wait` 2 s and `max_deliver` 3, dead-letter stream) is the one
of tests/test_consumers_nats.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.jobs.consumers import nats_handler
from tests.support.leftovers import IGNORE_CLIENT_LEFTOVERS, collect_client_leftovers
from tests.support.nats_server import nats_process
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, ROOT
from tests.support.store_outage import fsynced_redis, late_writes_landed, restart_when
from tests.test_consumers_nats import ACK_WAIT, Consumer, Rig, rig, until

pytestmark = [pytest.mark.redis, IGNORE_CLIENT_LEFTOVERS]
__all__ = ["collect_client_leftovers", "rig"]  # the fixture, shared with tests/test_consumers_nats.py


async def test_a_redis_restart_mid_stream_applies_every_message_once_and_dead_letters_none(
    rig: Rig, tmp_path: Path
) -> None:
    # Nak'd at once (the first version), a message whose claim met the stopped store spent its
    # max_deliver inside a second and JetStream gave up on it (MAX_DELIVERIES), never applied.
    ids = [f"pay-{i}" for i in range(40)]

    async def handle(msg: Any) -> None:
        await rig.effects.incr(rig.counter + msg.headers["Nats-Msg-Id"])
        await asyncio.sleep(0.02)

    with fsynced_redis(tmp_path / "store") as server:
        async with (
            Consumer(rig, handle, store_url=server.url) as first,
            Consumer(rig, handle, store_url=server.url) as second,
        ):
            for message_id in ids:
                await rig.publish({"Nats-Msg-Id": message_id})

            async def some_applied() -> bool:
                return sum(await rig.counts(ids)) >= 8

            started = time.monotonic()
            await restart_when(server, some_applied, down=3.0)

            async def drained() -> bool:  # every message applied or given up on
                settled = sum(await rig.counts(ids)) + len(await rig.dead_letters())
                return await rig.settled() and settled >= len(ids)

            await until(drained, 60)
            took = time.monotonic() - started
            await asyncio.sleep(0.5)  # a late duplicate would show now
            await late_writes_landed([first.store, second.store])
    counts = await rig.counts(ids)
    dead = await rig.dead_letters()
    deliveries = first.deliveries + second.deliveries
    report(
        {
            "test": "nats_redis_restart",
            "messages": len(ids),
            "down_s": 3.0,
            "effects": sum(counts),
            "dead_lettered": len(dead),
            "redelivered": sum(1 for _, n in deliveries if n > 1),
            "seconds": round(took, 1),
        },
        tag="CONSUMER",
    )
    assert counts == [1] * len(ids), {i: c for i, c in zip(ids, counts, strict=True) if c != 1}
    assert dead == []
    assert all(n == 1 for _, n in deliveries), "held with in_progress(), never nak'd: no delivery counted"


async def _publish_all(js: Any, subject: str, ids: list[str]) -> None:
    """Publish each id as `Nats-Msg-Id`, retrying one the server did not acknowledge (down, or a
    lost answer: the stream's duplicate window drops the second copy of one that landed)."""
    for message_id in ids:
        while True:
            try:
                await js.publish(subject, b'{"amount": 100}', headers={"Nats-Msg-Id": message_id}, timeout=0.5)
                break
            except Exception:  # the server is restarting: publish it again
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.01)


async def _consume(url: str, stream: str, on_message: Callable[[Any], Awaitable[None]]) -> None:
    """A pull consumer on its own connection that rides out the server's restart."""
    connection = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        sub = await connection.jetstream().pull_subscribe_bind(durable="workers", stream=stream)
        while True:
            try:
                batch = await sub.fetch(10, timeout=0.5)
            except Exception:  # no message yet, or the server is away
                await asyncio.sleep(0.05)
                continue
            await asyncio.gather(*(on_message(msg) for msg in batch), return_exceptions=True)
    finally:
        await connection.close()


async def test_a_nats_server_restart_mid_stream_loses_no_message_and_applies_none_twice(tmp_path: Path) -> None:
    ids = [f"pay-{i}" for i in range(60)]
    run = f"restart-{time.monotonic_ns()}"
    counter = f"idem-test-effects:{run}:"
    effects = aioredis.Redis.from_url(REDIS_URL)
    store = RedisBackend.from_url(REDIS_URL, prefix=f"idem-test:{run}:")

    async def handle(msg: Any) -> None:
        await effects.incr(counter + msg.headers["Nats-Msg-Id"])

    async def applied() -> int:
        return sum(int(v or 0) for v in await effects.mget([counter + i for i in ids]))

    with nats_process(tmp_path / "nats") as server:
        admin = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        js = admin.jetstream()
        await js.add_stream(StreamConfig(name="PAY", subjects=["pay.>"]))
        config = ConsumerConfig(durable_name="workers", ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT, max_deliver=5)
        await js.add_consumer("PAY", config)
        consuming = asyncio.ensure_future(_consume(server.url, "PAY", nats_handler(store, handle, namespace="pay")))
        publishing = asyncio.ensure_future(_publish_all(js, "pay.requested", ids))
        try:

            async def some_applied() -> bool:
                return await applied() >= 15

            await until(some_applied, 30)
            server.kill()  # SIGKILL, mid-stream: some messages applied, some in flight, some unpublished
            await asyncio.sleep(2.0)
            await asyncio.to_thread(server.start)
            await asyncio.wait_for(publishing, 30)

            async def drained() -> bool:
                info = await js.consumer_info("PAY", "workers")
                return info.num_pending == 0 and info.num_ack_pending == 0 and await applied() >= len(ids)

            await until(drained, 30)
            await asyncio.sleep(ACK_WAIT + 0.5)  # a redelivery of a lost ack would show now
            stored = (await js.stream_info("PAY")).state.messages
        finally:
            consuming.cancel()
            publishing.cancel()
            await asyncio.gather(consuming, publishing, return_exceptions=True)
            await admin.close()
    counts = [int(v or 0) for v in await effects.mget([counter + i for i in ids])]
    keys = [k async for k in effects.scan_iter(match=f"idem-test*{run}*")]
    if keys:
        await effects.delete(*keys)
    await effects.aclose()
    await store.aclose()
    row = {"test": "nats_server_restart", "messages": len(ids), "stored": stored, "effects": sum(counts)}
    report(row, tag="CONSUMER")
    assert stored == len(ids), "every message reached the stream once (the duplicate window dropped republishes)"
    assert counts == [1] * len(ids), {i: c for i, c in zip(ids, counts, strict=True) if c != 1}


async def test_an_ephemeral_or_ordered_consumer_keeps_its_records_across_a_restart(rig: Rig) -> None:
    # Keyed by the consumer's random name (the first version), a restarted ephemeral consumer
    # found none of its records and applied every message again. The key space is named now.
    ran: list[str] = []

    async def handle(msg: Any) -> None:
        ran.append(msg.headers["Nats-Msg-Id"])

    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)
    await rig.publish({"Nats-Msg-Id": "pay-1"})
    try:
        for options in ({"manual_ack": True}, {"ordered_consumer": True}, {"manual_ack": True}):
            sub = await rig.js.subscribe(rig.subject, **options)  # a new random name each time
            await nats_handler(store, handle, namespace="replay:payments")(await sub.next_msg(timeout=5))
            await sub.unsubscribe()
    finally:
        await store.aclose()
    assert ran == ["pay-1"], "applied once, by the first of three consumers with random names"


async def test_the_default_progress_interval_keeps_a_message_of_a_short_ack_wait(rig: Rig) -> None:
    # Every 5 s by default (the first version), in_progress() came after the consumer's 2 s ack
    # wait: JetStream redelivered a message that was still running.
    async def handle(msg: Any) -> None:
        await rig.effects.incr(rig.counter + msg.headers["Nats-Msg-Id"])
        await asyncio.sleep(ACK_WAIT * 1.8)

    async with Consumer(rig, handle) as only:  # lease 30: lease / 3 is 10 s, 5 s the cap
        await rig.publish({"Nats-Msg-Id": "pay-long"})
        await asyncio.sleep(0.3)
        await until(lambda: rig.settled(), 15)
    assert only.deliveries == [("pay-long", 1)], "sent in_progress() within the consumer's ack_wait"
    assert await rig.counts(["pay-long"]) == [1]


async def test_a_progress_interval_the_ack_wait_cannot_keep_is_refused(rig: Rig) -> None:
    ran: list[str] = []

    async def handle(msg: Any) -> None:
        ran.append(msg.headers["Nats-Msg-Id"])

    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)
    sub = await rig.js.pull_subscribe_bind(durable=rig.durable, stream=rig.stream)
    await rig.publish({"Nats-Msg-Id": "pay-1"})
    try:
        (msg,) = await sub.fetch(1, timeout=5)
        with pytest.raises(ConfigurationError, match="ack_wait"):
            await nats_handler(store, handle, namespace="pay", progress_every=5)(msg)
        await nats_handler(store, handle, namespace="pay", progress_every=ACK_WAIT / 2)(msg)
    finally:
        await store.aclose()
    assert ran == ["pay-1"]


CRASH_POINTS = ("receipt", "before_effect", "after_effect", "after_store")


def _start(rig: Rig, point: str | None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IDEM_LEASE": "1"}
    if point is not None:
        env["IDEM_DIE_AT"] = point
    argv = [sys.executable, "-m", "tests.consumer_process", "nats", rig.stream, rig.durable, rig.prefix, rig.counter]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_four_consumer_processes_under_a_manager_each_killed_at_one_crash_point(rig: Rig) -> None:
    """Four processes on one durable, each SIGKILLed by itself at one crash point on its first
    message and started again by the "manager" loop below: no message applied twice; a message
    whose consumer died inside its handler (the outcome unknown) is dead-lettered, never re-run."""
    ids = [f"pay-{i}" for i in range(40)]
    procs = {point: _start(rig, point) for point in CRASH_POINTS}
    restarted: list[str] = []
    try:
        await asyncio.sleep(1.5)  # the processes connect
        for message_id in ids:
            await rig.publish({"Nats-Msg-Id": message_id})

        async def settled() -> bool:
            for point, proc in list(procs.items()):
                if proc.poll() is not None:  # the manager: start a dead one again, without its crash
                    restarted.append(point)
                    procs[point] = _start(rig, None)
            done = sum(1 for c in await rig.counts(ids) if c) + len(await rig.dead_letters())
            return await rig.settled() and done >= len(ids)

        await until(settled, 60)
        await asyncio.sleep(ACK_WAIT + 0.5)  # a redelivery would show now
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(10)
    counts = dict(zip(ids, await rig.counts(ids), strict=True))
    dead = await rig.dead_letters()
    row = {"test": "nats_four_processes_crash_points", "messages": len(ids), "killed": sorted(restarted)}
    row |= {"effects": sum(counts.values()), "dead_lettered": len(dead)}
    report(row, tag="CONSUMER")
    assert sorted(restarted) == sorted(CRASH_POINTS), "each process died once, at its crash point"
    assert max(counts.values()) == 1, {i: c for i, c in counts.items() if c > 1}
    assert {d["type"] for d in dead} <= {"io.nats.jetstream.advisory.v1.terminated"}
    assert len(dead) <= 2, "only the two deaths inside a handler leave an outcome unknown"
    assert sum(1 for c in counts.values() if c == 0) <= len(dead), "every other message was applied"
