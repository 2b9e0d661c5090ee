"""Held repeats: what 10,000 repeats of one request, held on its key (`wait=`), cost in one process.

The middleware runs in-process around an app whose first call holds until the benchmark lets it
answer. `--repeats` repeats of the same key arrive while it runs and are held on that route
(`RoutePolicy(wait=...)`). For `--hold` seconds nothing happens but waiting: the CPU seconds this
process spends then is what holding costs. Then the first call answers, and every repeat gets its
stored answer handed over: the CPU and wall seconds until the last one has it. Each repeat makes
one store call in all (its claim) while the holder runs in this process.

With `--elsewhere` the repeats come through a second middleware on a store object of its own, as
in another worker process: the holder's end reaches them only through the store (Redis pub/sub,
Postgres LISTEN/NOTIFY; a store without notices is polled). Printed: store calls while held, and
how long after the holder's answer the last repeat had it.

Issue 25 (item 10) measured 2,000 repeats at 1.9 s of CPU over 6 s: every held repeat woke each
second, and removing a waiter scanned the key's whole list.

    python -m benchmarks.bench_held
    python -m benchmarks.bench_held --repeats 2000 --hold 6 --backends memory,redis --json
    python -m benchmarks.bench_held --elsewhere --repeats 200 --hold 3 --backends redis,postgres
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections import Counter
from typing import Any

from benchmarks.bench_roundtrips import call
from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.records import ClaimResult, RecordKey
from tests.support.stores import Counting, make_backend

BATCH = 500


class Held:
    """POST /pay whose first call waits for `gate`, then answers 201; `entered` once it runs."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        self.calls += 1
        self.entered.set()
        await self.gate.wait()
        body = b'{"id":"pay_' + uuid.uuid4().hex.encode() + b'"}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class Answered(Counting):
    """Counting, plus how many claims have been answered (a repeat is held once its claim is)."""

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner)
        self.answered = 0

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        try:
            return await super().claim(key, fingerprint, lease=lease, ttl=ttl)
        finally:
            self.answered += 1


async def until(store: Answered, claims: int, within: float) -> None:
    """Until `claims` claims have been answered (bounded)."""
    deadline = time.monotonic() + within
    while store.answered < claims:
        if time.monotonic() > deadline:
            raise TimeoutError("the repeats were not all held in time")
        await asyncio.sleep(0.01)


async def run(name: str, repeats: int, hold: float, elsewhere: bool = False) -> dict[str, Any]:
    inner: Backend = await make_backend(name, pool=20)
    prefix = getattr(inner, "prefix", None)  # the holder's "process" shares the store, not the object
    holder_store: Backend = await make_backend(name, pool=20, prefix=prefix) if elsewhere else inner
    store = Answered(inner)
    app = Held()
    route = RoutePolicy("/pay", methods=["POST"], single_tenant=True, wait=hold + 120, lease=hold + 60)
    namespace = f"bench-held-{uuid.uuid4().hex[:8]}"
    mw = IdempotencyMiddleware(app, backend=store, routes=[route], namespace=namespace)
    holder = IdempotencyMiddleware(app, backend=holder_store, routes=[route], namespace=namespace) if elsewhere else mw
    key = uuid.uuid4().hex
    try:
        first = asyncio.create_task(call(holder, key))
        await asyncio.wait_for(app.entered.wait(), 10)
        cpu, wall = time.process_time(), time.monotonic()
        tasks: list[asyncio.Task[tuple[int, bool]]] = []
        while len(tasks) < repeats:  # in batches, so a network store's pool is never the bottleneck
            tasks += [asyncio.create_task(call(mw, key)) for _ in range(min(BATCH, repeats - len(tasks)))]
            await until(store, len(tasks) + (0 if elsewhere else 1), 120)  # (+ the holder's claim, if counted)
        await asyncio.sleep(0.05)  # every repeat parked on its future
        setup_cpu, setup_wall = time.process_time() - cpu, time.monotonic() - wall
        calls = Counter(store.calls)

        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(hold)
        held_cpu, held_wall = time.process_time() - cpu, time.monotonic() - wall
        during = store.calls - calls

        cpu, wall = time.process_time(), time.monotonic()
        app.gate.set()
        original = await first
        answers = await asyncio.gather(*tasks)
        answer_cpu, answer_wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        app.gate.set()
        await inner.aclose()
        if holder_store is not inner:
            await holder_store.aclose()
    return {
        "backend": name,
        "elsewhere": elsewhere,
        "repeats": repeats,
        "hold_s": hold,
        "hold_wall_s": round(held_wall, 3),
        "hold_cpu_s": round(held_cpu, 3),
        "store_calls_while_held": sum(during.values()),
        "setup_cpu_s": round(setup_cpu, 3),
        "setup_wall_s": round(setup_wall, 3),
        "answer_cpu_s": round(answer_cpu, 3),
        "answer_wall_s": round(answer_wall, 3),
        "first": original,
        "replays": sum(1 for a in answers if a == (201, True)),
        "executions": app.calls,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10_000)
    parser.add_argument("--hold", type=float, default=6.0, help="seconds the repeats are held before the answer")
    parser.add_argument("--backends", default="memory", help="comma-separated: memory, redis, postgres")
    parser.add_argument("--elsewhere", action="store_true", help="the holder in another process (not memory)")
    parser.add_argument("--json", action="store_true", help="one JSON line per backend")
    args = parser.parse_args(argv)
    for name in args.backends.split(","):
        row = asyncio.run(run(name.strip(), args.repeats, args.hold, args.elsewhere))
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        print(
            f"{row['backend']}{' (holder elsewhere)' if row['elsewhere'] else ''}: "
            f"{row['repeats']} repeats held {row['hold_wall_s']:.1f} s on one key: "
            f"{row['hold_cpu_s']:.3f} s CPU while held ({row['store_calls_while_held']} store calls); "
            f"held in {row['setup_wall_s']:.2f} s ({row['setup_cpu_s']:.2f} s CPU); all answered "
            f"{row['answer_wall_s']:.2f} s after the first ({row['answer_cpu_s']:.2f} s CPU); "
            f"{row['replays']} replays, {row['executions']} execution",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
