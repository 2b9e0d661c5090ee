"""What `nats_handler` costs per message: microseconds and store calls, next to a bare `ack()`.

N messages are published to a fresh JetStream stream, then consumed by one pull subscription
(batches of 100, one message after another, so the figure is the per-message cost, not the
broker's throughput); then the same N are published again under the same keys (another header, so
JetStream's own de-duplication lets them through) and consumed: every one is a duplicate, acked
without running. The handler does nothing. Store calls are counted on the backend (claim,
complete, ...): the contract's cost is 2 per new message (claim + complete) and 1 per duplicate.

The RabbitMQ rows and the cost of a store outage (redeliveries, claim attempts) come from
benchmarks/bench_consumers_outage.py.

    python -m benchmarks.bench_consumers              # 2000 messages, memory and Redis stores
    python -m benchmarks.bench_consumers --n 500 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from benchmarks.bench_consumers_outage import nats_outage, rabbitmq_outage, rabbitmq_row
from idem_asgi.backends import Backend
from idem_asgi.backends.memory import MemoryBackend
from idem_asgi.backends.redis import RedisBackend
from idem_asgi.jobs.consumers import nats_handler
from tests.support.servers import REDIS_URL
from tests.support.stores import Counting

NATS = "nats://127.0.0.1:4222"


async def _nothing(msg: Any) -> None:
    return None


async def consume(js: Any, stream: str, durable: str, n: int, on_message: Any) -> float:
    """Seconds to fetch and settle n messages, one after another."""
    sub = await js.pull_subscribe_bind(durable=durable, stream=stream)
    done = 0
    started = time.perf_counter()
    while done < n:
        for msg in await sub.fetch(min(100, n - done), timeout=10):
            await on_message(msg)
            done += 1
    return time.perf_counter() - started


async def one(kind: str, n: int) -> dict[str, Any]:
    connection = await nats.connect(NATS)
    js = connection.jetstream()
    run = uuid.uuid4().hex[:10]
    stream, subject = f"IDEM_BENCH_{run}", f"idem-bench.{run}"
    await js.add_stream(StreamConfig(name=stream, subjects=[subject]))
    await js.add_consumer(stream, ConsumerConfig(durable_name="bench", ack_policy=AckPolicy.EXPLICIT, ack_wait=30))
    store: Counting | None = None
    try:
        on_message: Callable[[Any], Awaitable[None]]
        if kind == "bare ack":

            async def bare(msg: Any) -> None:
                await msg.ack()

            on_message = bare
        else:
            inner: Backend = (
                MemoryBackend() if kind == "memory" else RedisBackend.from_url(REDIS_URL, prefix=f"idem-bench:{run}:")
            )
            store = Counting(inner)
            on_message = nats_handler(store, _nothing, namespace="bench", header="Payment-Id")
        row: dict[str, Any] = {"store": kind, "messages": n}
        for phase in ("new", "duplicate"):
            for i in range(n):
                await js.publish(subject, b'{"amount": 100}', headers={"Payment-Id": f"p-{i}"})
            before = sum(store.calls.values()) if store else 0
            seconds = await consume(js, stream, "bench", n, on_message)
            row[f"{phase}_us_per_msg"] = round(seconds / n * 1e6, 1)
            if store is not None:
                row[f"{phase}_store_calls_per_msg"] = round((sum(store.calls.values()) - before) / n, 2)
        return row
    finally:
        if store is not None:
            await store.aclose()
        await js.delete_stream(stream)
        await connection.close()


async def main_async(n: int, stores: list[str], as_json: bool, outage: float) -> int:
    rows = [await one(kind, n) for kind in ["bare ack", *stores]]
    rows += [await rabbitmq_row(kind, n) for kind in ["bare ack", "redis"]]
    outages = [await rabbitmq_outage(outage), await nats_outage(outage)] if outage > 0 else []
    if as_json:
        for row in rows + outages:
            print(json.dumps(row))
        return 0
    columns = f"{'new µs/msg':>11} {'calls/msg':>10} {'duplicate µs/msg':>17} {'calls/msg':>10}"
    print(f"{'broker':<9} {'store':<10} {columns}")
    for r in rows:
        calls = (f"{r.get('new_store_calls_per_msg', '-'):>10}", f"{r.get('duplicate_store_calls_per_msg', '-'):>10}")
        head = f"{r.get('broker', 'nats'):<9} {r['store']:<10}"
        print(f"{head} {r['new_us_per_msg']:>11} {calls[0]} {r['duplicate_us_per_msg']:>17} {calls[1]}")
    for broker in ("nats", "rabbitmq"):
        mine = [r for r in rows if r.get("broker", "nats") == broker]
        bare = mine[0]
        for r in mine[1:]:
            extra = r["new_us_per_msg"] - bare["new_us_per_msg"]
            dup = r["duplicate_us_per_msg"] - bare["duplicate_us_per_msg"]
            rates = f"{1e6 / bare['new_us_per_msg']:.0f} msg/s bare, {1e6 / r['new_us_per_msg']:.0f} msg/s new"
            print(f"{broker} {r['store']}: +{extra:.0f} µs per new message, +{dup:.0f} µs per duplicate ({rates})")
    for o in outages:
        print(
            f"{o['broker']}: store down {o['down_s']} s under {o['messages']} messages: {o['deliveries']} deliveries, "
            f"{o['redelivered']} redelivered, {o['claim_attempts']} claim attempts, all {o['applied']} applied "
            f"{o['drain_s']} s after the store started"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--stores", default="memory,redis")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--outage", type=float, default=2.0, help="seconds the store is down (0: skip)")
    args = parser.parse_args(argv)
    return asyncio.run(main_async(args.n, args.stores.split(","), args.json, args.outage))


if __name__ == "__main__":
    raise SystemExit(main())
