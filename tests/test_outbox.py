"""idem_asgi.outbox on real PostgreSQL and RabbitMQ: a message commits with its transaction or not at
all, one key's messages are added and published in order, a refused or unreachable broker is retried
with a backoff while other keys go on, one relay leads and another takes over, sent rows are purged,
and `idem-asgi relay` publishes and exits. (tests/test_outbox_chain.py SIGKILLs the whole chain.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import PostgresBackend
from idem_asgi.errors import ConfigurationError
from idem_asgi.ops.cli import run as cli
from idem_asgi.outbox import NatsPublisher, Outbox, OutboxMessage, RabbitPublisher, Relay, publisher_for
from tests.support.servers import POSTGRES_DSN, ROOT, free_port, require, wait_until

AMQP = os.environ.get("IDEM_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")


@pytest.fixture
async def outbox() -> AsyncIterator[Outbox]:
    require("postgres", POSTGRES_DSN)
    table = f"ob_{uuid.uuid4().hex[:8]}"
    backend = PostgresBackend.from_dsn(POSTGRES_DSN, table=table, min_size=1, max_size=8)
    await backend.setup()
    box = Outbox(backend)
    await box.setup()
    try:
        yield box
    finally:
        pool = await backend._get_pool()
        async with pool.acquire() as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {box.table}")
            await conn.execute(f"DROP TABLE IF EXISTS {backend.table}")
        await backend.aclose()


@pytest.fixture
async def channel() -> AsyncIterator[Any]:
    require("rabbitmq", AMQP)
    connection = await aio_pika.connect(AMQP)
    yield await connection.channel()
    await connection.close()


@contextlib.asynccontextmanager
async def queue(channel: Any, name: str | None = None) -> AsyncIterator[Any]:
    declared = await channel.declare_queue(name or f"ob-{uuid.uuid4().hex[:8]}", durable=False, auto_delete=False)
    try:
        yield declared
    finally:
        await declared.delete(if_unused=False, if_empty=False)


async def drained(q: Any) -> list[Any]:
    got = []
    while (message := await q.get(no_ack=True, fail=False)) is not None:
        got.append(message)
    return got


async def rows(box: Outbox) -> list[Any]:
    pool = await box._pool()
    async with pool.acquire() as conn:
        return list(await conn.fetch(f"SELECT seq, id::text, key, sent_at, attempts FROM {box.table} ORDER BY seq"))


async def test_a_message_commits_with_its_transaction_or_not_at_all(outbox: Outbox) -> None:
    backend = outbox.backend
    async with backend.transaction() as conn:
        kept = await outbox.add(conn, "payments", b'{"id": 1}', headers={"Trace": "t1"})
    with pytest.raises(RuntimeError):
        async with backend.transaction() as conn:
            await outbox.add(conn, "payments", b'{"id": 2}')
            raise RuntimeError("the effect failed")
    assert [row[1] for row in await rows(outbox)] == [kept]
    pool = await backend._get_pool()
    async with pool.acquire() as conn:
        with pytest.raises(ConfigurationError, match="inside a transaction"):
            await outbox.add(conn, "payments", b"{}")  # autocommit: it would commit without its effect
    assert (await outbox.backlog()).unsent == 1


async def test_a_protected_requests_messages_are_ordered_by_its_claim_not_its_raw_key(outbox: Outbox) -> None:
    backend = outbox.backend

    async def api(scope: Any, receive: Any, send: Any) -> None:
        async with backend.transaction() as conn:
            await outbox.add(conn, "a", b"1")
            await outbox.add(conn, "b", b"2")
            await outbox.add(conn, "c", b"3", key="order-7")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    policy = RoutePolicy("/pay", methods=["POST"], single_tenant=True)
    app = IdempotencyMiddleware(api, backend=backend, routes=[policy])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://api") as client:
        response = await client.post("/pay", headers={"Idempotency-Key": "secret-key-1"})
    assert response.status_code == 201
    keys = [row[2] for row in await rows(outbox)]
    assert keys[0] == keys[1] != "secret-key-1" and len(keys[0]) >= 32  # the record's digest
    assert keys[2] == "order-7"
    async with backend.transaction() as conn:  # no claim: the subject orders
        await outbox.add(conn, "refunds", b"4")
    assert (await rows(outbox))[-1][2] == "refunds"


async def test_one_keys_messages_get_seqs_in_commit_order_under_concurrent_transactions(outbox: Outbox) -> None:
    """Each transaction adds to one of 4 keys, then lingers before COMMIT. Inside it, the key's
    rows it can see (committed ones and its own) must be exactly those with a smaller or equal seq:
    a later seq committed earlier would break the relay's per-key order."""
    backend = outbox.backend
    seen: list[tuple[str, int, int]] = []

    async def one(i: int) -> None:
        key = f"k{i % 4}"
        async with backend.transaction() as conn:
            await outbox.add(conn, "s", str(i).encode(), key=key)
            seq, visible = await conn.fetchrow(f"SELECT max(seq), count(*) FROM {outbox.table} WHERE key = $1", key)
            await asyncio.sleep(random.random() / 50)
            seen.append((key, seq, visible))

    await asyncio.gather(*(one(i) for i in range(40)))
    by_key: dict[str, list[int]] = {}
    for row in await rows(outbox):
        by_key.setdefault(row[2], []).append(row[0])
    for key, seq, visible in seen:
        assert by_key[key].index(seq) + 1 == visible, (key, seq, visible, by_key[key])


async def test_the_relay_publishes_with_the_rows_id_and_marks_it_sent(outbox: Outbox, channel: Any) -> None:
    async with queue(channel) as q:
        ids = []
        for i in range(5):
            async with outbox.backend.transaction() as conn:
                ids.append(await outbox.add(conn, q.name, f"m{i}".encode(), headers={"N": str(i)}, key="one"))
        relay = Relay(outbox, RabbitPublisher(AMQP), poll=0.1)
        async with relay:
            await wait_until(lambda: relay.stats.published == 5, 10)
        got = await drained(q)
    assert [m.message_id for m in got] == ids
    assert [m.body for m in got] == [f"m{i}".encode() for i in range(5)]
    assert [m.headers["N"] for m in got] == ["0", "1", "2", "3", "4"]
    assert all(row[3] is not None for row in await rows(outbox))
    assert (await outbox.backlog()).unsent == 0


async def test_a_refused_message_holds_its_key_back_while_other_keys_go_on(outbox: Outbox, channel: Any) -> None:
    """RabbitMQ refuses a message no queue takes (mandatory): the relay retries it with a backoff,
    publishes nothing after it for its key, and the other key's messages go out meanwhile; once
    the queue exists, the held key's messages go out in their order."""
    missing = f"ob-late-{uuid.uuid4().hex[:8]}"
    async with queue(channel) as q:
        async with outbox.backend.transaction() as conn:
            await outbox.add(conn, missing, b"a1", key="a")
            await outbox.add(conn, q.name, b"a2", key="a")
            await outbox.add(conn, q.name, b"b1", key="b")
            await outbox.add(conn, q.name, b"b2", key="b")
        relay = Relay(outbox, RabbitPublisher(AMQP), poll=0.1, first_retry=0.2, max_retry=0.4)
        async with relay:
            await wait_until(lambda: relay.stats.failed >= 2, 10)
            early = [m.body for m in await drained(q)]
            backlog = await outbox.backlog()
            async with queue(channel, missing) as late:
                await wait_until(lambda: relay.stats.published == 4, 10)
                late_bodies = [m.body for m in await drained(late)]
            rest = [m.body for m in await drained(q)]
    assert early == [b"b1", b"b2"], "key b went on; a2 waited behind a1"
    assert backlog.unsent == 2 and backlog.failing == 1 and "NO_ROUTE" in (backlog.last_error or "")
    assert late_bodies == [b"a1"] and rest == [b"a2"]
    assert next(row[4] for row in await rows(outbox)) >= 2, "a1 was tried again, with its attempts counted"


async def test_a_broker_that_is_down_is_retried_with_a_backoff_and_nothing_is_lost(
    outbox: Outbox, channel: Any
) -> None:
    async with queue(channel) as q:
        async with outbox.backend.transaction() as conn:
            for i in range(3):
                await outbox.add(conn, q.name, str(i).encode(), key=f"k{i}")
        publisher = RabbitPublisher(f"amqp://guest:guest@127.0.0.1:{free_port()}/", timeout=1)
        relay = Relay(outbox, publisher, poll=0.05, first_retry=0.3, max_retry=5)
        async with relay:
            await asyncio.sleep(2)
            attempts = [row[4] for row in await rows(outbox)]
            assert relay.stats.published == 0 and (await outbox.backlog()).failing == 3
            # 0.3 + 0.6 + 1.2 s of backoff: at most 3 tries each in 2 s, not one per poll (40)
            assert all(1 <= a <= 3 for a in attempts), attempts
            publisher.url = AMQP  # the broker is back
            await wait_until(lambda: relay.stats.published == 3, 15)
        assert sorted(m.body for m in await drained(q)) == [b"0", b"1", b"2"]


async def test_one_relay_leads_and_another_takes_over_when_it_stops(outbox: Outbox, channel: Any) -> None:
    async with queue(channel) as q:
        first = Relay(outbox, RabbitPublisher(AMQP), poll=0.1, standby_poll=0.1)
        second = Relay(outbox, RabbitPublisher(AMQP), poll=0.1, standby_poll=0.1)
        async with first:
            await wait_until(lambda: first.stats.leader, 5)
            async with second:
                for i in range(20):
                    async with outbox.backend.transaction() as conn:
                        await outbox.add(conn, q.name, str(i).encode(), key=f"k{i % 3}")
                await wait_until(lambda: first.stats.published == 20, 10)
                assert not second.stats.leader and second.stats.published == 0
                await first.aclose()  # a graceful stop: its session's lock goes with it
                await wait_until(lambda: second.stats.leader, 5)
                async with outbox.backend.transaction() as conn:
                    await outbox.add(conn, q.name, b"after", key="k0")
                await wait_until(lambda: second.stats.published == 1, 10)
        bodies = [m.body for m in await drained(q)]
    assert sorted(bodies) == sorted([str(i).encode() for i in range(20)] + [b"after"]), "each published once"
    for k in range(3):  # each key's messages in the order they were added
        mine = [int(b) for b in bodies if b != b"after" and int(b) % 3 == k]
        assert mine == sorted(mine)


async def test_sent_messages_are_purged_after_keep_sent_and_unsent_ones_never(outbox: Outbox, channel: Any) -> None:
    async with queue(channel) as q:
        async with outbox.backend.transaction() as conn:
            await outbox.add(conn, q.name, b"sent")
            await outbox.add(conn, f"nowhere-{uuid.uuid4().hex[:6]}", b"refused", key="other")
        relay = Relay(outbox, RabbitPublisher(AMQP), poll=0.1, keep_sent=0.2, purge_every=0.1)
        async with relay:
            await wait_until(lambda: relay.stats.purged == 1, 10)
        left = await rows(outbox)
    assert len(left) == 1 and left[0][3] is None, "the refused, unsent message stays"
    assert await outbox.purge(0) == 0


async def test_the_relay_command_publishes_what_is_due_and_exits(outbox: Outbox, channel: Any, capsys: Any) -> None:
    backend = outbox.backend
    table = backend.table.strip('"')
    async with queue(channel) as q:
        async with backend.transaction() as conn:
            await outbox.add(conn, q.name, b"by the cli")
        code = await cli(["--backend", POSTGRES_DSN, "--table", table, "--json", "relay", "--to", AMQP, "--once"])
        got = await drained(q)
    assert code == 0, capsys.readouterr().err
    assert '"published": 1' in capsys.readouterr().out
    assert [m.body for m in got] == [b"by the cli"]
    assert await cli(["--backend", POSTGRES_DSN, "--table", table, "relay", "--to", "kafka://x"]) == 2
    assert await cli(["--backend", "memory://", "relay", "--to", AMQP]) == 2
    assert "Postgres outbox" in capsys.readouterr().err


def test_publisher_for_names_the_brokers_it_knows() -> None:
    assert type(publisher_for("amqps://mq/")).__name__ == "RabbitPublisher"
    assert type(publisher_for("nats://n:4222")).__name__ == "NatsPublisher"
    with pytest.raises(ConfigurationError):
        publisher_for("nats://n:4222", exchange="x")
    with pytest.raises(ConfigurationError):
        Outbox(object())
    with pytest.raises(ConfigurationError):
        Outbox(object(), table="bad name")


def test_the_outbox_page_prints_what_its_example_prints() -> None:
    """docs/outbox.md shows docs/outbox/charge_then_publish.py (a snippet line) and its output."""
    require("postgres", POSTGRES_DSN)
    require("nats", NATS)
    page = (ROOT / "docs" / "outbox.md").read_text()
    assert '--8<-- "docs/outbox/charge_then_publish.py"' in page
    block = re.search(r"^```console\n\$ python docs/outbox/charge_then_publish.py\n(.*?)^```$", page, re.S | re.M)
    assert block is not None
    env = {**os.environ, "IDEM_POSTGRES_DSN": POSTGRES_DSN, "IDEM_NATS_URL": NATS}
    done = subprocess.run(
        [sys.executable, "docs/outbox/charge_then_publish.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == block.group(1)


class SlowPublisher:
    """The real RabbitMQ publisher, each publish taking `delay` seconds longer (a slow broker)."""

    def __init__(self, delay: float) -> None:
        self.inner = RabbitPublisher(AMQP)
        self.delay = delay
        self.published = asyncio.Event()  # the broker confirmed the first message

    async def publish(self, message: Any) -> None:
        await self.inner.publish(message)
        self.published.set()
        await asyncio.sleep(self.delay)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_graceful_stop_ends_the_round_in_progress_and_marks_it(outbox: Outbox, channel: Any) -> None:
    """Stopped (`aclose`, SIGTERM for the command) while a round of 4 of one key's 12 messages is
    being published: that round completes and is marked, no later round starts, and the next relay
    publishes only the rest: 12 in the queue, each once, in order."""
    async with queue(channel) as q:
        async with outbox.backend.transaction() as conn:
            for i in range(12):
                await outbox.add(conn, q.name, str(i).encode(), key="one")
        slow = SlowPublisher(0.1)
        relay = Relay(outbox, slow, batch=4, poll=0.1)
        async with relay:
            await asyncio.wait_for(slow.published.wait(), 10)  # inside the first round
        marked = sum(row[3] is not None for row in await rows(outbox))
        got = [int(m.body) for m in await drained(q)]
        assert marked == 4 and got == [0, 1, 2, 3], (marked, got)
        after = Relay(outbox, RabbitPublisher(AMQP), poll=0.1)
        async with after:
            await wait_until(lambda: after.stats.published == 8, 10)
        got += [int(m.body) for m in await drained(q)]
    assert got == list(range(12))


async def test_a_cancelled_relay_marks_what_was_confirmed_and_republishes_at_most_the_one_in_flight(
    outbox: Outbox, channel: Any
) -> None:
    """Cancelled (a timeout around `run()`) mid-round: the publishes that returned are marked sent
    (the mark is shielded); the one in flight when the cancel came may have reached the broker
    unmarked, so the next relay publishes it again with the same id (a consumer keyed by it
    applies it once). Nothing is lost and no other message goes twice."""
    async with queue(channel) as q:
        async with outbox.backend.transaction() as conn:
            for i in range(12):
                await outbox.add(conn, q.name, str(i).encode(), key="one")
        slow = SlowPublisher(0.1)
        relay = Relay(outbox, slow, batch=12, poll=0.1)
        running = asyncio.create_task(relay.run())
        await asyncio.wait_for(slow.published.wait(), 10)
        await asyncio.sleep(0.3)  # a few more publishes, then the cancel lands mid-round
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await relay.publisher.aclose()
        marked = sum(row[3] is not None for row in await rows(outbox))
        first = [m for m in await drained(q)]
        assert 0 < marked < 12 and [int(m.body) for m in first][:marked] == list(range(marked))
        assert len(first) - marked <= 1, "only the publish in flight may be unmarked"
        after = Relay(outbox, RabbitPublisher(AMQP), poll=0.1)
        async with after:
            await wait_until(lambda: after.stats.published == 12 - marked, 10)
        second = [m for m in await drained(q)]
    ids = [m.message_id for m in first + second]
    assert sorted({int(m.body) for m in first + second}) == list(range(12))
    assert len(ids) - len(set(ids)) == len(first) - marked, "a republish carries its first id"


async def test_a_relay_whose_database_session_is_killed_leads_again(outbox: Outbox, channel: Any) -> None:
    async with queue(channel) as q:
        relay = Relay(outbox, RabbitPublisher(AMQP), poll=0.1, first_retry=0.1)
        async with relay:
            await wait_until(lambda: relay.stats.leader, 5)
            pool = await outbox._pool()
            async with pool.acquire() as conn:
                killed = await conn.fetchval(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                    "AND objid::int = hashtext($1) AND granted",
                    outbox.lock_name,
                )
            assert killed
            async with outbox.backend.transaction() as conn:
                await outbox.add(conn, q.name, b"after the kill")
            await wait_until(lambda: relay.stats.published == 1, 10)
            assert relay.stats.leader and "outbox store" in (relay.stats.last_error or "")
        assert [m.body for m in await drained(q)] == [b"after the kill"]


async def test_a_rolled_back_message_is_never_published_and_a_committed_one_within_a_poll(
    outbox: Outbox, channel: Any
) -> None:
    async with queue(channel) as q:
        relay = Relay(outbox, RabbitPublisher(AMQP), poll=0.2)
        async with relay:
            await wait_until(lambda: relay.stats.leader, 5)
            with pytest.raises(RuntimeError):
                async with outbox.backend.transaction() as conn:
                    await outbox.add(conn, q.name, b"rolled back")
                    await asyncio.sleep(0.5)  # the relay looks meanwhile: an uncommitted row is not there
                    raise RuntimeError
            async with outbox.backend.transaction() as conn:
                await outbox.add(conn, q.name, b"committed")
            await wait_until(lambda: relay.stats.published == 1, 2)
            assert relay.stats.published == 1
        assert [m.body for m in await drained(q)] == [b"committed"]


async def held_relay_locks(outbox: Outbox) -> int:
    pool = await outbox._pool()
    async with pool.acquire() as conn:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid::int = hashtext($1) AND granted",
                outbox.lock_name,
            )
        )


async def test_a_relay_cancelled_at_any_moment_leaves_no_leader_lock_behind(outbox: Outbox) -> None:
    """Cancelled 30 times at random moments (while asking for the lock, leading, handing the
    connection back): the lock never stays on a pooled connection, so the next relay can lead."""
    for _ in range(30):
        relay = Relay(outbox, RabbitPublisher(AMQP), poll=0.01, standby_poll=0.01)
        running = asyncio.create_task(relay.run())
        await asyncio.sleep(random.random() / 50)
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        await relay.publisher.aclose()
        assert await held_relay_locks(outbox) == 0
    last = Relay(outbox, RabbitPublisher(AMQP), poll=0.05)
    async with last:
        await wait_until(lambda: last.stats.leader, 5)
        assert last.stats.leader


async def test_a_channel_the_broker_closed_is_opened_again(outbox: Outbox, channel: Any) -> None:
    """RabbitMQ closes the publisher's channel (the exchange it publishes to was deleted): the
    message is retried, and once the exchange is back the publisher opens a new channel and it goes."""
    exchange_name = f"ob-x-{uuid.uuid4().hex[:8]}"

    async def exchange_with_queue(q: Any) -> Any:
        exchange = await channel.declare_exchange(exchange_name, aio_pika.ExchangeType.DIRECT)
        await q.bind(exchange, routing_key="charged")
        return exchange

    async with queue(channel) as q:
        exchange = await exchange_with_queue(q)
        relay = Relay(outbox, RabbitPublisher(AMQP, exchange=exchange_name), poll=0.05, first_retry=0.1, max_retry=0.2)
        async with relay:
            async with outbox.backend.transaction() as conn:
                await outbox.add(conn, "charged", b"first")
            await wait_until(lambda: relay.stats.published == 1, 10)
            await exchange.delete()
            async with outbox.backend.transaction() as conn:
                await outbox.add(conn, "charged", b"second")
            await wait_until(lambda: relay.stats.failed >= 2, 10)
            assert relay.stats.published == 1
            await exchange_with_queue(q)
            await wait_until(lambda: relay.stats.published == 2, 10)
            assert relay.stats.published == 2
        assert [m.body for m in await drained(q)] == [b"first", b"second"]
        await channel.exchange_delete(exchange_name)


async def test_headers_must_be_strings(outbox: Outbox) -> None:
    async with outbox.backend.transaction() as conn:
        with pytest.raises(ConfigurationError, match="strings"):
            await outbox.add(conn, "s", b"x", headers={"n": 1})  # type: ignore[dict-item]
    assert (await outbox.backlog()).unsent == 0


async def test_a_nats_publisher_with_no_server_fails_within_its_timeout() -> None:
    publisher = NatsPublisher(f"nats://127.0.0.1:{free_port()}", timeout=1)
    started = asyncio.get_running_loop().time()
    with pytest.raises(Exception):  # noqa: B017 - nats-py's or asyncio's, either is this publish's error
        await publisher.publish(OutboxMessage(1, str(uuid.uuid4()), "k", "s", b"x", {}, 0))
    assert asyncio.get_running_loop().time() - started < 5, "not nats-py's minutes of connect retries"
    await publisher.aclose()


async def test_the_relay_command_once_beside_a_leader_publishes_nothing(
    outbox: Outbox, channel: Any, capsys: Any
) -> None:
    table = outbox.backend.table.strip('"')
    async with queue(channel) as q:
        leader = Relay(outbox, RabbitPublisher(AMQP), poll=0.05)
        async with leader:
            await wait_until(lambda: leader.stats.leader, 5)
            code = await cli(["--backend", POSTGRES_DSN, "--table", table, "relay", "--to", AMQP, "--once"])
            assert code == 0 and "another relay leads" in capsys.readouterr().out
        await drained(q)
    missing = await cli(["--backend", POSTGRES_DSN, "--table", "no_such_records", "relay", "--to", AMQP, "--once"])
    assert missing == 2 and "relay --setup" in capsys.readouterr().err
