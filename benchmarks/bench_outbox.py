"""What the outbox costs: the write inside a payment's transaction, and the relay's rate beside a
bare publisher.

- **Write**: `--n` transactions, `--concurrency` at a time, each `INSERT`s a ledger row through
  `backend.transaction()` (the floor), or the same plus `outbox.add(...)` (one statement more);
  µs per transaction (wall clock / n), the median of `--rounds` alternating rounds.
- **Relay**: `--messages` rows over `--keys` keys published by one `Relay` (`batch=100`) to NATS
  JetStream and to RabbitMQ, against a bare publisher (the same messages, the same shape: each
  key's messages one after the other, keys side by side, each publish awaited until the broker
  confirmed it, no database); messages per second, the median of `--rounds` alternating rounds.

    python -m benchmarks.bench_outbox
    python -m benchmarks.bench_outbox --n 2000 --messages 5000 --summary out.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from idem_asgi.backends import PostgresBackend
from idem_asgi.outbox import NatsPublisher, Outbox, OutboxMessage, Publisher, RabbitPublisher, Relay
from tests.support.servers import POSTGRES_DSN, reachable

from .figures import append

NATS = "nats://127.0.0.1:4222"
AMQP = "amqp://guest:guest@127.0.0.1:5672/"
BODY = b'{"order": "o-123456", "amount": 1250, "currency": "EUR", "charge": "ch_3Pq8x2LkdIyH"}'


async def _writes(backend: PostgresBackend, outbox: Outbox | None, n: int, concurrency: int, ledger: str) -> float:
    """µs per transaction, `n` of them, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate, backend.transaction() as conn:
            await conn.execute(f"INSERT INTO {ledger} (order_id, amount) VALUES ($1, $2)", f"o-{i}", 1250)
            if outbox is not None:
                await outbox.add(conn, "payments.charged", BODY, key=f"o-{i % 100}")

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return (time.perf_counter() - started) / n * 1e6


async def _fill(outbox: Outbox, messages: int, keys: int, subject: str) -> None:
    async with outbox.backend.transaction() as conn:
        for i in range(messages):
            await outbox.add(conn, subject, BODY, key=f"k{i % keys}")


async def _relayed(outbox: Outbox, publisher: Any, messages: int) -> float:
    relay = Relay(outbox, publisher, batch=100, poll=0.05)
    started = time.perf_counter()
    async with relay:
        while relay.stats.published < messages:  # noqa: ASYNC110 - a benchmark's bounded wait
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
    return messages / elapsed


async def _bare(publisher: Any, messages: int, keys: int, subject: str) -> float:
    by_key: dict[int, list[OutboxMessage]] = {}
    for i in range(messages):
        by_key.setdefault(i % keys, []).append(
            OutboxMessage(i, str(uuid.uuid4()), f"k{i % keys}", subject, BODY, {}, 0)
        )

    async def chain(batch: list[OutboxMessage]) -> None:
        for message in batch:
            await publisher.publish(message)

    await publisher.publish(OutboxMessage(0, str(uuid.uuid4()), "warm", subject, BODY, {}, 0))  # connect first
    started = time.perf_counter()
    await asyncio.gather(*(chain(batch) for batch in by_key.values()))
    elapsed = time.perf_counter() - started
    await publisher.aclose()
    return messages / elapsed


async def main(args: argparse.Namespace) -> None:
    if not reachable(POSTGRES_DSN):
        print("Postgres not reachable: nothing measured")
        return
    run = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    tag = uuid.uuid4().hex[:8]
    backend = PostgresBackend.from_dsn(POSTGRES_DSN, table=f"bench_ob_{tag}", min_size=4, max_size=args.concurrency)
    await backend.setup()
    outbox = Outbox(backend)
    await outbox.setup()
    ledger = f"bench_ob_{tag}_ledger"
    async with backend.transaction() as conn:
        await conn.execute(f"CREATE TABLE {ledger} (order_id text, amount int)")
    try:
        floor, ours = [], []
        await _writes(backend, outbox, 200, args.concurrency, ledger)  # warm the pool and the plans
        for _ in range(args.rounds):
            floor.append(await _writes(backend, None, args.n, args.concurrency, ledger))
            ours.append(await _writes(backend, outbox, args.n, args.concurrency, ledger))
        f, o = statistics.median(floor), statistics.median(ours)
        print(f"write: {args.n} transactions x {args.rounds} rounds, {args.concurrency} at a time")
        print(f"  ledger INSERT only (floor)       {f:8.1f} us per transaction")
        print(f"  + outbox.add (one statement)     {o:8.1f} us per transaction  (+{o - f:.1f} us, x{o / f:.2f})")
        if args.summary:
            append(args.summary, {"kind": "write", "run": run, "n": args.n, "concurrency": args.concurrency,
                                  "floor_us": round(f, 1), "outbox_us": round(o, 1)})  # fmt: skip
        async with backend.transaction() as conn:
            await conn.execute(f"TRUNCATE {outbox.table}")
        brokers: list[tuple[str, str, Callable[[], Publisher]]] = [
            ("nats", NATS, lambda: NatsPublisher(NATS)),
            ("rabbitmq", AMQP, lambda: RabbitPublisher(AMQP)),
        ]
        for broker, url, make in brokers:
            if not reachable(url):
                print(f"relay: {broker} not reachable, skipped")
                continue
            subject, cleanup = await _destination(broker, tag)
            relayed, bare = [], []
            try:
                for _ in range(args.rounds):
                    await _fill(outbox, args.messages, args.keys, subject)
                    relayed.append(await _relayed(outbox, make(), args.messages))
                    bare.append(await _bare(make(), args.messages, args.keys, subject))
                    await cleanup(purge=True)
            finally:
                await cleanup(purge=False)
            r, b = statistics.median(relayed), statistics.median(bare)
            print(f"relay to {broker}: {args.messages} messages over {args.keys} keys x {args.rounds} rounds")
            print(f"  bare publisher (floor)  {b:8.0f} msg/s")
            print(f"  relay                   {r:8.0f} msg/s  ({r / b:.2f} of the floor)")
            if args.summary:
                append(args.summary, {"kind": "relay", "run": run, "broker": broker, "messages": args.messages,
                                      "keys": args.keys, "relay_msg_s": round(r), "bare_msg_s": round(b)})  # fmt: skip
    finally:
        async with backend.transaction() as conn:
            await conn.execute(f"DROP TABLE IF EXISTS {ledger}, {outbox.table}, {backend.table}")
        await backend.aclose()


async def _destination(broker: str, tag: str) -> tuple[str, Any]:
    """A subject (NATS: a stream with no duplicate window worth noting) or a queue, and its cleanup."""
    if broker == "nats":
        import nats
        from nats.js.api import StreamConfig

        nc = await nats.connect(NATS)
        js = nc.jetstream()
        stream, subject = f"BENCHOB{tag}", f"bench.ob.{tag}"
        await js.add_stream(StreamConfig(name=stream, subjects=[subject]))

        async def nats_cleanup(*, purge: bool) -> None:
            if purge:
                await js.purge_stream(stream)
            else:
                await js.delete_stream(stream)
                await nc.close()

        return subject, nats_cleanup
    import aio_pika

    connection = await aio_pika.connect(AMQP)
    channel = await connection.channel()
    queue = await channel.declare_queue(f"bench-ob-{tag}", durable=True)

    async def rabbit_cleanup(*, purge: bool) -> None:
        if purge:
            await queue.purge()
        else:
            await queue.delete(if_unused=False, if_empty=False)
            await connection.close()

    return queue.name, rabbit_cleanup


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="transactions per round (2000)")
    p.add_argument("--concurrency", type=int, default=16, help="transactions at a time (16)")
    p.add_argument("--messages", type=int, default=5000, help="messages the relay publishes per round (5000)")
    p.add_argument("--keys", type=int, default=100, help="ordering keys they spread over (100)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported (3)")
    p.add_argument("--summary", default="", help="also append the figures as JSON lines here")
    asyncio.run(main(p.parse_args()))
