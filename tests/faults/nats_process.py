"""A NATS JetStream consumer process for tests/faults/test_matrix_nats.py: a pull consumer (a fetch
loop) or a push one (`js.subscribe(..., cb=...)`), its handler the fault points' `work`, stopped at
its keys' points (tests/support/fault_points.py; the plan comes in `IDEM_FAULT_RUN` /
`IDEM_FAULT_POINTS`).

    python -m tests.faults.nats_process '<settings as JSON>'

Settings: `surface` ("nats_pull" or "nats_push"), `url` (the NATS server), `stream`, `subject`, `durable` (a
durable consumer made by the test: a pull one, or a push one with `deliver_group` = `durable`),
`dead_letter` (the subject dead letters are copied to, with their reason), `store` ("redis":
`store_url` and key `prefix`; "postgres": `store_url` the DSN, records `table`), `namespace`,
`lease`, `batch` (the pull fetch size: all the run's keys in one batch).

The consumer is the one the docs show: `async with nc, nats_handler(PointStore(store), handle,
namespace=..., lease=...) as on_message:`. A pull consumer hands each fetched batch to
`asyncio.gather(*(on_message(m) for m in batch))`; a push consumer's `cb=` is `on_message`. Signals
from the test, each answered on stdout once done:

- SIGTERM (graceful stop): the usual handler, `main_task.cancel()`; the block drains the running
  deliveries, then the connection closes (prints `stopping`, then `stopped` on the way out);
- SIGUSR1 (the subscription lost): `unsubscribe()` of the push subscription, or of the pull
  subscription (its fetch loop then ends); the connection stays (prints `unsubscribed`);
- SIGUSR2 (the callback cancelled by the client): pull: the fetch-loop task, which awaits the
  batch's gather, is cancelled, so each `on_message(m)` of the batch is; push: `nc.close()`, whose
  cancellation of the subscription's callback task is nats-py's own (prints `cancelled`).

While it runs it sets `fault:<run>:running:<surface>` on the shared Redis to `on_message.running`
(deliveries being worked on) every 50 ms: the test waits for 0 before it stops the process after a
fault that lets the work go on. Prints `ready` once it consumes. SIGQUIT prints every task's stack
on stderr (what still runs, when the test's wait for it timed out).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from typing import Any

import nats

from idem_asgi.jobs.consumers import nats_handler
from tests.support.fault_points import Plan, PointStore, work


async def make_store(settings: dict[str, Any]) -> Any:
    if settings["store"] == "postgres":
        from idem_asgi.backends.postgres import PostgresBackend

        store = PostgresBackend.from_dsn(settings["store_url"], table=settings["table"], min_size=1, max_size=20)
        await store.setup()
        return store
    from idem_asgi.backends.redis import RedisBackend

    return RedisBackend.from_url(settings["store_url"], prefix=settings["prefix"])


def say(line: str) -> None:
    print(line, flush=True)


def dump_tasks() -> None:
    """SIGQUIT: every task's coroutine chain on stderr (the test asks for it when the work did not end in time)."""
    for task in asyncio.all_tasks():
        lines = [f"--- {task.get_name()}"]
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "ag_frame", None)
            if frame is None:
                break
            lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "ag_await", None)
        lines.append(f"    awaiting {awaited!r}"[:300])
        print("\n".join(lines), file=sys.stderr)
    sys.stderr.flush()


async def main(settings: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None

    def stop() -> None:
        say("stopping")
        main_task.cancel()

    loop.add_signal_handler(signal.SIGTERM, stop)
    loop.add_signal_handler(signal.SIGQUIT, dump_tasks)
    plan = Plan()
    surface = settings["surface"]
    store = await make_store(settings)

    async def handle(msg: Any) -> str:
        return await work(plan, msg.headers["Nats-Msg-Id"], store)

    nc = await nats.connect(settings["url"], max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    js = nc.jetstream()
    options = {"namespace": settings["namespace"], "lease": float(settings["lease"])}
    options["dead_letter"] = settings["dead_letter"]
    reporter: asyncio.Task[None] | None = None
    try:
        async with nc, nats_handler(PointStore(store, plan), handle, **options) as on_message:

            async def report_running() -> None:
                while True:
                    with contextlib.suppress(Exception):
                        await plan.redis.set(f"fault:{plan.run}:running:{surface}", on_message.running)
                    await asyncio.sleep(0.05)

            reporter = asyncio.ensure_future(report_running())
            if surface == "nats_pull":
                await pull(settings, js, on_message)
            else:
                await push(settings, nc, js, on_message)
    finally:
        if reporter is not None:
            reporter.cancel()
        await plan.aclose()
        await store.aclose()


async def pull(settings: dict[str, Any], js: Any, on_message: Any) -> None:
    sub = await js.pull_subscribe_bind(durable=settings["durable"], stream=settings["stream"])
    lost = asyncio.Event()

    async def fetching() -> None:
        while not lost.is_set():
            try:
                batch = await sub.fetch(int(settings["batch"]), timeout=1)
            except Exception:  # no message yet (nats-py raises either timeout), or the server is away
                await asyncio.sleep(0.05)
                continue
            await asyncio.gather(*(on_message(msg) for msg in batch))

    fetch_loop = asyncio.ensure_future(fetching())

    async def unsubscribe() -> None:
        lost.set()
        await sub.unsubscribe()
        say("unsubscribed")

    def cancel() -> None:
        fetch_loop.cancel()  # it awaits the batch's gather: each on_message(m) is cancelled
        say("cancelled")

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(unsubscribe()))
    loop.add_signal_handler(signal.SIGUSR2, cancel)
    say("ready")
    try:
        await asyncio.Future()  # until SIGTERM cancels the main task
    finally:
        fetch_loop.cancel()
        await asyncio.gather(fetch_loop, return_exceptions=True)


async def push(settings: dict[str, Any], nc: Any, js: Any, on_message: Any) -> None:
    durable = settings["durable"]
    sub = await js.subscribe(
        settings["subject"], queue=durable, durable=durable, stream=settings["stream"], manual_ack=True, cb=on_message
    )

    async def unsubscribe() -> None:
        await sub.unsubscribe()
        say("unsubscribed")

    async def close() -> None:
        await nc.close()  # cancels the subscription's callback task, as nats-py does on close
        say("cancelled")

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: asyncio.ensure_future(unsubscribe()))
    loop.add_signal_handler(signal.SIGUSR2, lambda: asyncio.ensure_future(close()))
    say("ready")
    await asyncio.Future()  # until SIGTERM cancels the main task


if __name__ == "__main__":
    try:
        asyncio.run(main(json.loads(sys.argv[1])))
    except asyncio.CancelledError:  # SIGTERM's handler cancelled main, after the block drained
        say("stopped")
    except ConnectionError as exc:  # nats-py's close() on a connection that came back from a restarted
        say(f"stopped (the connection's close failed: {exc!r})")  # server; the block had drained first
