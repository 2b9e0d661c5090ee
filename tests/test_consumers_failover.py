"""`rabbitmq_handler` through a Redis Sentinel failover: the primary SIGKILLed mid-stream while two
competing consumers apply 300 messages, each published twice, against the shared RabbitMQ (quorum
queue, `x-delivery-limit` 3, the rig of tests/test_consumers.py). The store is `redis+sentinel://`
(durable claims by default) on a throwaway topology (tests/support/servers.py: a primary, two
replicas, three sentinels, down after 1 s); effects are counted in the shared Redis."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs.consumers import rabbitmq_handler
from tests.support.leftovers import IGNORE_CLIENT_LEFTOVERS, collect_client_leftovers
from tests.support.scorecard import report
from tests.support.servers import redis_sentinel
from tests.support.store_outage import late_writes_landed
from tests.test_consumers import Rig, rig, until

pytestmark = [pytest.mark.redis, pytest.mark.slow, IGNORE_CLIENT_LEFTOVERS]
__all__ = ["collect_client_leftovers", "rig"]  # the fixture, shared with tests/test_consumers.py


async def test_a_sentinel_failover_mid_stream_applies_every_message_once_and_dead_letters_none(
    rig: Rig, tmp_path: Path
) -> None:
    # Requeued at once (the first version), the messages whose claims met the failover were
    # dead-lettered by x-delivery-limit, never applied (21 of 300 in the run).
    ids = [f"pay-{i}" for i in range(300)]

    async def handle(message: Any) -> None:
        await rig.effects.incr(rig.counter + message.message_id)
        await asyncio.sleep(0.005)

    with redis_sentinel(tmp_path / "redis") as (primary, _replicas, sentinels):
        url = "redis+sentinel://" + ",".join(s.address for s in sentinels) + "/mymaster/0"
        stores, channels = [], []
        for _ in range(2):
            store = RedisBackend.from_url(url, prefix=rig.prefix)
            channel = await rig.connection.channel()
            await channel.set_qos(prefetch_count=10)
            await (await channel.get_queue(rig.queue)).consume(rabbitmq_handler(store, handle, namespace="payments"))
            stores.append(store)
            channels.append(channel)

        async def publish_all() -> None:
            for message_id in ids + ids:  # every message twice, as a relay that retried would
                await rig.publish(message_id)

        publishing = asyncio.ensure_future(publish_all())

        async def some_applied() -> bool:
            return sum(await rig.counts(ids)) >= 60

        await until(some_applied, 30)
        pending_at_kill = len(ids) - sum(1 for c in await rig.counts(ids) if c)
        started = time.monotonic()
        primary.kill()  # the sentinels notice within 1 s and promote a replica
        await asyncio.wait_for(publishing, 60)

        async def drained() -> bool:
            settled = sum(1 for c in await rig.counts(ids) if c) + await rig.depth(rig.dlq)
            return await rig.depth(rig.queue) == 0 and settled >= len(ids)

        await until(drained, 90)
        took = time.monotonic() - started
        await asyncio.sleep(1.0)  # a late duplicate would show now
        await late_writes_landed(stores)
        for channel in channels:
            await channel.close()
        for store in stores:
            await store.aclose()
    counts = await rig.counts(ids)
    dead = await rig.depth(rig.dlq)
    row = {"test": "rabbitmq_sentinel_failover", "messages": len(ids), "published": 2 * len(ids)}
    row |= {"effects": sum(counts), "dead_lettered": dead, "seconds_after_kill": round(took, 1)}
    row["unapplied_after_kill"] = pending_at_kill
    report(row, tag="CONSUMER")
    assert counts == [1] * len(ids), {i: c for i, c in zip(ids, counts, strict=True) if c != 1}
    assert dead == 0
