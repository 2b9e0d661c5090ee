"""NATS JetStream consumers apply each message once (`idem_asgi.jobs.consumers.nats_handler`), against
the real server on this machine (127.0.0.1:4222, JetStream on) and the shared Redis as the store;
effects are counted by INCR in Redis, outside the adapter. Each test has its own stream, a durable
pull consumer (`ack_wait` 2 s, `max_deliver` 3) and a dead-letter stream that keeps JetStream's
MAX_DELIVERIES and MSG_TERMINATED advisories for that stream, all deleted afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats
import pytest
import redis.asyncio as aioredis
from nats.errors import TimeoutError as FetchTimeout
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from idem_asgi.backends.redis import RedisBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.jobs.consumers import nats_handler
from idem_asgi.jobs.decorator import current_job
from tests.support.scorecard import report
from tests.support.servers import REDIS_URL, ROOT, require

NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")
pytestmark = [pytest.mark.redis]
MAX_DELIVER = 3
ACK_WAIT = 2.0


class Rig:
    def __init__(self, run: str, connection: Any) -> None:
        self.run = run
        self.stream = f"IDEM_TEST_{run}"
        self.dead = f"IDEM_TEST_{run}_DEAD"
        self.subject = f"idem-test.{run}.payments"
        self.durable = "workers"
        self.prefix = f"idem-test:{run}:"
        self.counter = f"idem-test-effects:{run}:"
        self.connection = connection
        self.js = connection.jetstream()
        self.effects = aioredis.Redis.from_url(REDIS_URL)

    async def publish(self, headers: dict[str, str], body: bytes = b'{"amount": 100}') -> int:
        ack = await self.js.publish(self.subject, body, headers=headers)
        return int(ack.seq)

    async def counts(self, ids: list[str]) -> list[int]:
        return [int(v or 0) for v in await self.effects.mget([self.counter + i for i in ids])]

    async def settled(self) -> bool:
        info = await self.js.consumer_info(self.stream, self.durable)
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)

    async def dead_letters(self) -> list[dict[str, Any]]:
        info = await self.js.stream_info(self.dead)
        first = int(info.state.first_seq)
        found = []
        for seq in range(first, first + int(info.state.messages)):
            raw = await self.js.get_msg(self.dead, seq)
            found.append(json.loads(raw.data or b"{}"))
        return found


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    require("nats", NATS)
    require("redis", REDIS_URL)
    run = uuid.uuid4().hex[:10]
    connection = await nats.connect(NATS)
    r = Rig(run, connection)
    await r.js.add_stream(StreamConfig(name=r.stream, subjects=[f"idem-test.{run}.>"]))
    advisories = [
        f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{r.stream}.*",
        f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{r.stream}.*",
    ]
    await r.js.add_stream(StreamConfig(name=r.dead, subjects=advisories))
    config = ConsumerConfig(
        durable_name=r.durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT, max_deliver=MAX_DELIVER
    )
    await r.js.add_consumer(r.stream, config)
    try:
        yield r
    finally:
        for name in (r.stream, r.dead):
            await r.js.delete_stream(name)
        keys = [k async for k in r.effects.scan_iter(match=f"idem-test*{run}*")]
        if keys:
            await r.effects.delete(*keys)
        await r.effects.aclose()
        await connection.close()


async def until(condition: Callable[[], Awaitable[bool]], within: float) -> None:
    deadline = time.monotonic() + within
    while not await condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


class Consumer:
    """One competing consumer: its own connection and store, fetching batches from the shared
    durable pull consumer and settling each message through `nats_handler`, concurrently."""

    def __init__(self, rig: Rig, handle: Any, *, store_url: str = REDIS_URL, **options: Any) -> None:
        self.rig, self.handle, self.options, self.store_url = rig, handle, options, store_url
        self.deliveries: list[tuple[str, int]] = []  # (key, num_delivered) of every message fetched

    async def __aenter__(self) -> Consumer:
        self.connection = await nats.connect(NATS)
        self.store = RedisBackend.from_url(self.store_url, prefix=self.rig.prefix)
        self.on_message = nats_handler(self.store, self.handle, **{"namespace": "payments", **self.options})
        sub = await self.connection.jetstream().pull_subscribe_bind(durable=self.rig.durable, stream=self.rig.stream)
        self.task = asyncio.ensure_future(self.loop(sub))
        return self

    async def loop(self, sub: Any) -> None:
        while True:
            try:
                batch = await sub.fetch(10, timeout=0.5)
            except (FetchTimeout, TimeoutError):  # nats-py raises either under load
                continue
            for msg in batch:
                self.deliveries.append(((msg.headers or {}).get("Nats-Msg-Id", ""), msg.metadata.num_delivered))
            await asyncio.gather(*(self.on_message(msg) for msg in batch))

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.store.aclose()
        await self.connection.close()


async def test_each_message_published_twice_is_applied_once_by_two_competing_consumers(rig: Rig) -> None:
    async def handle(msg: Any) -> None:
        await rig.effects.incr(rig.counter + msg.headers["Payment-Id"])
        await asyncio.sleep(0.005)

    # Keyed by a header of our own: JetStream would drop a second publish with the same Nats-Msg-Id
    # inside its duplicate window, and here the broker must really deliver both copies.
    ids = [f"pay-{i}" for i in range(200)]
    async with (
        Consumer(rig, handle, header="Payment-Id") as first,
        Consumer(rig, handle, header="Payment-Id") as second,
    ):
        for payment in ids:
            await rig.publish({"Payment-Id": payment})
        for payment in reversed(ids):  # the duplicates, while the first copies are being applied
            await rig.publish({"Payment-Id": payment})

        async def drained() -> bool:
            return await rig.settled() and sum(await rig.counts(ids)) >= 200

        await until(drained, 60)
        await asyncio.sleep(0.5)  # any late duplicate would show now
    counts = await rig.counts(ids)
    stored = (await rig.js.stream_info(rig.stream)).state.messages
    fetched = len(first.deliveries) + len(second.deliveries)
    redelivered = sum(1 for _, n in first.deliveries + second.deliveries if n > 1)
    report(
        {
            "test": "nats_competing_consumers",
            "published": stored,
            "fetched": fetched,
            "redelivered": redelivered,
            "effects": sum(counts),
            "acked_without_running": fetched - sum(counts),
        },
        tag="CONSUMER",
    )
    assert stored == 400, "both copies of every message reached the stream"
    assert fetched == 400 + redelivered and first.deliveries and second.deliveries
    assert counts == [1] * 200, {i: c for i, c in zip(ids, counts, strict=True) if c != 1}
    assert await rig.dead_letters() == []


async def kill_a_consumer_on(rig: Rig, key: str, **env: str) -> None:
    """Run tests/consumer_process.py, publish one message keyed `key`, and see it die by SIGKILL."""
    env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "tests.consumer_process", "nats", rig.stream, rig.durable, rig.prefix, rig.counter]
    dying = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)  # noqa: ASYNC220 - read in a thread below
    try:
        assert dying.stdout is not None
        assert (await asyncio.to_thread(dying.stdout.readline)).strip() == b"ready"
        await rig.publish({"Nats-Msg-Id": key})  # keyed by the default, Nats-Msg-Id
        code = await asyncio.to_thread(dying.wait, 30)
        assert code == -9, "the first consumer died by SIGKILL, after its effect, before its ack"
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait(10)
        if dying.stdout is not None:
            dying.stdout.close()
    assert await rig.counts([key]) == [1]


async def test_a_consumer_killed_after_the_effect_before_the_ack_never_applies_twice(rig: Rig) -> None:
    await kill_a_consumer_on(rig, "pay-killed", IDEM_DIE_AFTER_STORE="1")
    ran: list[str] = []

    async def handle(msg: Any) -> None:
        ran.append(msg.headers["Nats-Msg-Id"])
        await rig.effects.incr(rig.counter + msg.headers["Nats-Msg-Id"])

    async with Consumer(rig, handle) as second:  # JetStream redelivers to it once ack_wait passes
        await until(lambda: rig.settled(), 30)
    report(
        {"test": "nats_sigkill_before_ack", "effects": (await rig.counts(["pay-killed"]))[0], "redeliveries": 1},
        tag="CONSUMER",
    )
    assert second.deliveries == [("pay-killed", 2)], "the second consumer got the redelivery"
    assert ran == [], "the redelivery was acked without running the handler"
    assert await rig.counts(["pay-killed"]) == [1]


async def test_a_poison_message_is_dead_lettered_after_max_deliver_attempts(rig: Rig) -> None:
    attempts = 0

    async def handle(msg: Any) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError("always fails")

    async with Consumer(rig, handle):
        seq = await rig.publish({"Nats-Msg-Id": "pay-poison"})

        async def dead() -> bool:
            return len(await rig.dead_letters()) == 1

        await until(dead, 30)
        await asyncio.sleep(ACK_WAIT + 0.5)  # a redelivery past the bound would show now
    (advisory,) = await rig.dead_letters()
    report({"test": "nats_poison", "attempts": attempts, "dead_lettered": 1}, tag="CONSUMER")
    assert attempts == MAX_DELIVER, attempts
    assert advisory["type"] == "io.nats.jetstream.advisory.v1.max_deliver"
    assert advisory["stream_seq"] == seq and advisory["deliveries"] == MAX_DELIVER
    kept = await rig.js.get_msg(rig.stream, seq)  # still in the stream, for a person to look at
    assert kept.headers is not None and kept.headers["Nats-Msg-Id"] == "pay-poison"


async def test_keyless_and_reused_messages_are_terminated_at_once(rig: Rig) -> None:
    ran: list[bytes] = []

    async def handle(msg: Any) -> None:
        ran.append(msg.data)

    async with Consumer(rig, handle, header="Payment-Id"):
        await rig.publish({"Payment-Id": "pay-1"}, b'{"amount": 100}')
        await until(lambda: rig.settled(), 10)
        await rig.publish({"Other": "x"}, b'{"amount": 1}')  # no key
        await rig.publish({"Payment-Id": "pay-1"}, b'{"amount": 999}')  # the same key, another body

        async def both_dead() -> bool:
            return len(await rig.dead_letters()) == 2

        await until(both_dead, 10)
    kinds = {letter["type"] for letter in await rig.dead_letters()}
    assert ran == [b'{"amount": 100}']
    assert kinds == {"io.nats.jetstream.advisory.v1.terminated"}


async def test_a_handler_longer_than_ack_wait_is_not_redelivered_meanwhile(rig: Rig) -> None:
    async def handle(msg: Any) -> None:
        await rig.effects.incr(rig.counter + msg.headers["Nats-Msg-Id"])
        await asyncio.sleep(ACK_WAIT * 1.6)

    async with Consumer(rig, handle, lease=1.2) as first, Consumer(rig, handle, lease=1.2) as second:
        await rig.publish({"Nats-Msg-Id": "pay-slow"})
        await asyncio.sleep(0.3)
        await until(lambda: rig.settled(), 15)
    deliveries = first.deliveries + second.deliveries
    assert deliveries == [("pay-slow", 1)], "in_progress() kept JetStream from redelivering it"
    assert await rig.counts(["pay-slow"]) == [1]


async def test_a_duplicate_of_a_slow_message_waits_for_it_instead_of_being_dead_lettered(rig: Rig) -> None:
    # Handed back at once, the duplicate would come round max_deliver times while the first copy
    # still runs, and JetStream would give up on it: a dead letter for a message that was applied.
    async def handle(msg: Any) -> None:
        await rig.effects.incr(rig.counter + msg.headers["Payment-Id"])
        await asyncio.sleep(1.0)

    async with (
        Consumer(rig, handle, header="Payment-Id") as first,
        Consumer(rig, handle, header="Payment-Id") as second,
    ):
        await rig.publish({"Payment-Id": "pay-slow"})
        await rig.publish({"Payment-Id": "pay-slow"})
        await asyncio.sleep(0.3)
        await until(lambda: rig.settled(), 15)
    assert sorted(first.deliveries + second.deliveries) == [("", 1), ("", 1)], "each copy delivered once"
    assert await rig.counts(["pay-slow"]) == [1]
    assert await rig.dead_letters() == []


async def test_a_handler_that_failed_after_its_effect_is_dead_lettered_never_run_again(rig: Rig) -> None:
    async def handle(msg: Any) -> None:
        await rig.effects.incr(rig.counter + msg.headers["Nats-Msg-Id"])
        job = current_job()
        assert job is not None, "the handler runs inside the message's claim"
        job.mark_effect()  # the charge happened: from here on a failure must not run it again
        raise RuntimeError("lost the provider's answer")

    async with Consumer(rig, handle):
        await rig.publish({"Nats-Msg-Id": "pay-unknown"})

        async def dead() -> bool:
            return len(await rig.dead_letters()) == 1

        await until(dead, 15)
    (letter,) = await rig.dead_letters()
    assert letter["type"] == "io.nats.jetstream.advisory.v1.terminated"
    assert letter["deliveries"] == 1, "terminated at once: its outcome is unknown"
    assert await rig.counts(["pay-unknown"]) == [1]


async def test_a_result_that_cannot_be_stored_is_terminated_after_one_effect(rig: Rig) -> None:
    # Handed back, every redelivery would run the effect again (max_deliver 3: 3 effects).
    async def handle(msg: Any) -> object:
        await rig.effects.incr(rig.counter + msg.headers["Nats-Msg-Id"])
        return object()  # msgspec cannot encode it: the effect happened, the result cannot be stored

    async with Consumer(rig, handle) as only:
        await rig.publish({"Nats-Msg-Id": "pay-opaque"})

        async def dead() -> bool:
            return len(await rig.dead_letters()) == 1

        await until(dead, 15)
        await asyncio.sleep(ACK_WAIT + 0.5)  # a redelivery would show now
    (letter,) = await rig.dead_letters()
    assert letter["type"] == "io.nats.jetstream.advisory.v1.terminated"
    assert only.deliveries == [("pay-opaque", 1)]
    assert await rig.counts(["pay-opaque"]) == [1]


async def test_a_consumer_killed_inside_its_handler_leaves_the_message_dead_lettered_not_rerun(rig: Rig) -> None:
    await kill_a_consumer_on(rig, "pay-midway", IDEM_DIE_IN_HANDLER="1", IDEM_LEASE="1")
    ran: list[str] = []

    async def handle(msg: Any) -> None:
        ran.append(msg.headers["Nats-Msg-Id"])

    async with Consumer(rig, handle, lease=1) as second:  # redelivered after ack_wait; the lease is over

        async def dead() -> bool:
            return len(await rig.dead_letters()) == 1

        await until(dead, 20)
    (letter,) = await rig.dead_letters()
    assert ran == [], "outcome unknown: never run again on a guess"
    assert [n for _, n in second.deliveries] == [2]
    assert letter["type"] == "io.nats.jetstream.advisory.v1.terminated"
    assert await rig.counts(["pay-midway"]) == [1]


async def test_the_push_subscription_form_of_the_docs_applies_each_message_once(rig: Rig) -> None:
    """`js.subscribe(subject, durable=..., config=..., manual_ack=True, cb=nats_handler(...))`, as
    docs/jobs.md shows it: two subscribers in one queue group, every message published twice."""
    ids = [f"push-{i}" for i in range(50)]
    applied_by: Counter[int] = Counter()

    def handler(subscriber: int) -> Any:
        async def handle(msg: Any) -> None:
            applied_by[subscriber] += 1
            await rig.effects.incr(rig.counter + msg.headers["Payment-Id"])

        return handle

    config = ConsumerConfig(
        durable_name="charge",
        deliver_group="charge",  # a queue group (its name is the durable's): the subscribers compete
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT,
        max_deliver=MAX_DELIVER,
    )
    stores = [RedisBackend.from_url(REDIS_URL, prefix=rig.prefix) for _ in range(2)]
    subscriptions = [
        await rig.js.subscribe(
            rig.subject,
            queue="charge",
            durable="charge",
            config=config,
            manual_ack=True,
            cb=nats_handler(store, handler(i), namespace="charge", header="Payment-Id"),
        )
        for i, store in enumerate(stores)
    ]
    for payment in ids + ids:
        await rig.publish({"Payment-Id": payment})

    async def applied() -> bool:
        info = await rig.js.consumer_info(rig.stream, "charge")
        return info.num_pending == 0 and info.num_ack_pending == 0 and sum(await rig.counts(ids)) >= 50

    await until(applied, 30)
    await asyncio.sleep(0.3)
    for subscription in subscriptions:
        await subscription.unsubscribe()
    for store in stores:
        await store.aclose()
    assert await rig.counts(ids) == [1] * 50
    assert applied_by[0] > 0 and applied_by[1] > 0, applied_by
    assert await rig.dead_letters() == []


async def test_the_key_space_is_the_work_not_the_durable(rig: Rig) -> None:
    """The key space is the `namespace` the consumer names, never the stream or durable: a second
    durable doing other work (the ledger next to the charge) applies every message under its own,
    and the charge moved to a new durable (renamed, push to pull, a mirror) applies none again (the
    first version derived `nats:<stream>:<durable>`, and a new durable applied 10 of 10 again)."""
    for durable in ("ledger", "charge-v2"):
        await rig.js.add_consumer(
            rig.stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT)
        )
    applied: list[tuple[str, str]] = []

    async def handle(msg: Any) -> None:
        applied.append((msg.metadata.consumer, msg.headers["Nats-Msg-Id"]))

    store = RedisBackend.from_url(REDIS_URL, prefix=rig.prefix)  # one store for all, as in an app
    work = {"workers": "charge", "ledger": "ledger", "charge-v2": "charge"}
    connection = await nats.connect(NATS)
    try:
        js = connection.jetstream()
        for i in range(5):
            await rig.publish({"Nats-Msg-Id": f"pay-{i}"})
        for durable, namespace in work.items():  # each durable gets every message
            on_message = nats_handler(store, handle, namespace=namespace)
            sub = await js.pull_subscribe_bind(durable=durable, stream=rig.stream)
            await asyncio.gather(*(on_message(msg) for msg in await sub.fetch(5, timeout=5)))
    finally:
        await store.aclose()
        await connection.close()
    assert sorted(applied) == sorted((d, f"pay-{i}") for d in ("workers", "ledger") for i in range(5))
    with pytest.raises(ConfigurationError, match="namespace"):
        nats_handler(store, handle, namespace="")
