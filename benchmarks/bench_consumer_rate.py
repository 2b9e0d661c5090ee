"""Messages/s through `rabbitmq_handler` and `nats_handler`, beside a bare consumer in the same run.

Issue #36 (item 6): the adapters should reach at least 0.80 of a bare consumer's messages/s on both
brokers. Each round publishes N messages first (a fresh RabbitMQ quorum queue; a fresh JetStream
stream with a durable pull consumer), then starts P consumer processes (`--worker` subprocesses of
this module, each with its own broker connection and, for "ours", its own Redis store), which
connect and wait; at one start signal they consume:

- RabbitMQ: `set_qos(prefetch_count=W)` and `queue.consume(callback)` (aio-pika runs each delivery's
  callback in a task of its own: up to W at once per process);
- NATS: `fetch(W)` in a loop, each fetched batch handled at once (`asyncio.gather`).

msg/s = N / (seconds from the start signal until the last ack, in any process). Two sides:

- bare: the callback only acks (`message.ack()` / `msg.ack()`);
- ours: the adapter (`async with rabbitmq_handler(...)` / `nats_handler(...)`, with `namespace=`)
  around a handler that does nothing (returns None), on the local Redis (`RedisBackend.from_url`,
  a fresh prefix per round, its keys deleted after the round).

Bare and ours rounds alternate (bare first in odd rounds, ours first in even ones), `--rounds` of
each per broker. Per round: msg/s, and CPU µs per message from the start signal until every ack was
seen: the consumers' (their processes' CPU time, summed), the broker's and Redis's (their threads'
`/proc/<pid>/task/*/schedstat`; the servers are found by name, and shared servers also count other
users' work). Per broker: the median over rounds of ours/bare (round r's ours over round r's bare),
its min-max, and a `TARGET` line (>= 0.80). Every round checks that nothing was left unacked (exit
status 1 otherwise). Worker stderr goes to benchmarks/out/bench_consumer_rate.log. One default run
takes about 25 s here (most of it starting processes and publishing).

    python -m benchmarks.bench_consumer_rate                       # 2000 messages, 2 processes, W=100, 3+3 rounds
    python -m benchmarks.bench_consumer_rate --brokers nats --rounds 5 --json
    python -m benchmarks.bench_consumer_rate --pythonpath /tmp/old  # consumers import another idem_asgi
    # where ours spends its CPU: one process, more messages, a cProfile dump per consumer process
    python -m benchmarks.bench_consumer_rate --procs 1 --n 20000 --rounds 1 --cprofile benchmarks/out/prof
    py-spy record --subprocesses --rate 500 --format speedscope -o benchmarks/out/ours.json -- \\
        python -m benchmarks.bench_consumer_rate --procs 1 --n 20000 --rounds 1 --sides ours --brokers rabbitmq
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
AMQP = os.environ.get("IDEM_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("IDEM_NATS_URL", "nats://127.0.0.1:4222")
REDIS = os.environ.get("IDEM_REDIS_URL", "redis://127.0.0.1:6379/0")
BODY = b'{"amount": 100}'
TARGET = 0.80
DURABLE = "bench"
ROUND_TIMEOUT = 60.0  # seconds a round may take to ack every message
PROGRESS_EVERY = 0.05  # how often a worker reports its ack count (only the stop signal waits for it)


# -- the consumer process (`--worker`) ------------------------------------------------------------


class _Tally:
    """Acks made by this process, and when the first and last were."""

    __slots__ = ("count", "first", "last")

    def __init__(self) -> None:
        self.count = 0
        self.first = 0.0
        self.last = 0.0


class _Signals:
    """The parent's start and stop signals, read from stdin; what this process reports on stdout."""

    def __init__(self, tally: _Tally, profile: Any) -> None:
        self.tally = tally
        self.profile = profile  # a cProfile.Profile, or None
        self.go = asyncio.Event()
        self.stop = asyncio.Event()
        self.cpu = 0.0

    async def listen(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            if line.strip() == b"go":
                self.go.set()
            elif line.strip() == b"stop":
                break
        self.stop.set()  # "stop", or the parent is gone (EOF)

    async def started(self) -> None:
        """Say ready, and wait for the start signal."""
        _say("ready")
        await self.go.wait()
        self.cpu = time.process_time()
        if self.profile is not None:
            self.profile.enable()

    async def stopped(self) -> None:
        """Wait for the stop signal; the CPU time spent since the start."""
        await self.stop.wait()
        self.cpu = time.process_time() - self.cpu
        if self.profile is not None:
            self.profile.disable()

    async def progress(self) -> None:
        told = -1
        while not self.stop.is_set():
            if self.tally.count != told:
                told = self.tally.count
                _say(f"n {told}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop.wait(), PROGRESS_EVERY)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _nothing(message: Any) -> None:
    return None


def _counted(tally: _Tally, settle: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[None]]:
    """The callback: settle one delivery (bare ack, or the adapter), then count its ack."""

    async def counted(message: Any) -> None:
        await settle(message)
        now = time.monotonic()
        if not tally.count:
            tally.first = now
        tally.count += 1
        tally.last = now

    return counted


async def _bare_rabbitmq(message: Any) -> None:
    await message.ack()


async def _bare_nats(msg: Any) -> None:
    await msg.ack()


async def _store(opts: argparse.Namespace, stack: contextlib.AsyncExitStack) -> Any:
    """Ours: a Redis store of this round's prefix, connected (and its scripts loaded) before the start."""
    from idem_asgi.backends.redis import RedisBackend

    store = RedisBackend.from_url(REDIS, prefix=opts.prefix)
    stack.push_async_callback(store.aclose)
    await store.check()
    return store


async def _rabbitmq_worker(opts: argparse.Namespace, signals: _Signals) -> None:
    import aio_pika

    connection = await aio_pika.connect(AMQP)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=opts.window)
        queue = await channel.declare_queue(opts.name, passive=True)
        async with contextlib.AsyncExitStack() as stack:
            settle: Callable[[Any], Awaitable[Any]] = _bare_rabbitmq
            if opts.side == "ours":
                from idem_asgi.jobs.consumers import rabbitmq_handler

                store = await _store(opts, stack)
                adapter = rabbitmq_handler(store, _nothing, namespace=opts.namespace)
                settle = await stack.enter_async_context(adapter)
            await signals.started()
            tag = await queue.consume(_counted(signals.tally, settle))
            await signals.stopped()
            await queue.cancel(tag)
    finally:
        await connection.close()


async def _nats_worker(opts: argparse.Namespace, signals: _Signals) -> None:
    import nats
    from nats.errors import TimeoutError as FetchTimeout

    connection = await nats.connect(NATS)
    try:
        sub = await connection.jetstream().pull_subscribe_bind(durable=DURABLE, stream=opts.name)
        async with contextlib.AsyncExitStack() as stack:
            settle: Callable[[Any], Awaitable[Any]] = _bare_nats
            if opts.side == "ours":
                from idem_asgi.jobs.consumers import nats_handler

                store = await _store(opts, stack)
                adapter = nats_handler(store, _nothing, namespace=opts.namespace)
                settle = await stack.enter_async_context(adapter)
            counted = _counted(signals.tally, settle)

            async def pull() -> None:
                while True:
                    try:
                        batch = await sub.fetch(opts.window, timeout=1.0)
                    except FetchTimeout:
                        continue
                    await asyncio.gather(*(counted(msg) for msg in batch))

            await signals.started()
            puller = asyncio.ensure_future(pull())
            await signals.stopped()
            puller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await puller
    finally:
        await connection.close()


def _dump(profile: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(path)


async def worker(opts: argparse.Namespace) -> int:
    """One consumer process: connect, say ready, consume from the start signal until the stop one,
    then report its acks and CPU as `done {json}`."""
    tally = _Tally()
    profile: Any = None
    if opts.cprofile:
        import cProfile

        profile = cProfile.Profile()
    signals = _Signals(tally, profile)
    listening = asyncio.ensure_future(signals.listen())
    reporting = asyncio.ensure_future(signals.progress())
    serve = _rabbitmq_worker if opts.worker == "rabbitmq" else _nats_worker
    try:
        await serve(opts, signals)
    finally:
        reporting.cancel()
        listening.cancel()
    if profile is not None:
        _dump(profile, Path(opts.cprofile) / f"{opts.worker}-{opts.side}-{os.getpid()}.prof")
    done = {"count": tally.count, "first": tally.first, "last": tally.last, "cpu_s": signals.cpu}
    _say(f"n {tally.count}")
    _say("done " + json.dumps(done))
    return 0


# -- the parent: rounds -----------------------------------------------------------------------------


class _Proc:
    """A consumer process as the parent sees it: ready, its ack count, its final report."""

    def __init__(self, proc: asyncio.subprocess.Process, progress: asyncio.Event) -> None:
        self.proc = proc
        self.progress = progress
        self.ready = asyncio.Event()
        self.count = 0
        self.done: dict[str, Any] | None = None
        self.reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            word, _, rest = raw.decode().strip().partition(" ")
            if word == "ready":
                self.ready.set()
            elif word == "n":
                self.count = int(rest)
            elif word == "done":
                self.done = json.loads(rest)
            self.progress.set()
        self.progress.set()  # EOF: exited

    def send(self, line: str) -> None:
        if self.proc.stdin is not None and self.proc.returncode is None:
            with contextlib.suppress(ConnectionError):
                self.proc.stdin.write(line.encode() + b"\n")


async def _until(check: Callable[[], bool], progress: asyncio.Event, deadline: float, what: str) -> None:
    while not check():
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"timed out waiting for {what}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(progress.wait(), left)
        progress.clear()


class _Broker:
    """One broker's fresh queue (stream) per round: set up, publish, count what is left, delete."""

    name = ""

    async def setup(self, run: str) -> str:
        raise NotImplementedError

    async def publish(self, target: str, run: str, n: int) -> None:
        raise NotImplementedError

    async def left(self, target: str) -> int:
        raise NotImplementedError

    async def delete(self, target: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class _RabbitMQ(_Broker):
    name = "rabbitmq"

    def __init__(self, connection: Any, channel: Any) -> None:
        self.connection = connection
        self.channel = channel

    @classmethod
    async def connect(cls) -> _RabbitMQ:
        import aio_pika

        connection = await aio_pika.connect(AMQP)
        return cls(connection, await connection.channel())  # publisher confirms on

    async def setup(self, run: str) -> str:
        queue = f"idem-bench-rate-{run}"
        await self.channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
        return queue

    async def publish(self, target: str, run: str, n: int) -> None:
        import aio_pika

        exchange = self.channel.default_exchange
        for start in range(0, n, 250):
            sends = (
                exchange.publish(aio_pika.Message(BODY, message_id=f"{run}-{i}"), routing_key=target)
                for i in range(start, min(start + 250, n))
            )
            await asyncio.gather(*sends)
        ready = await self.left(target)
        if ready != n:
            raise RuntimeError(f"published {n} messages but queue {target} holds {ready}")

    async def left(self, target: str) -> int:
        queue = await self.channel.declare_queue(target, passive=True)
        return int(queue.declaration_result.message_count or 0)

    async def delete(self, target: str) -> None:
        await self.channel.queue_delete(target)

    async def close(self) -> None:
        await self.connection.close()


class _Nats(_Broker):
    name = "nats"

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.js = connection.jetstream()

    @classmethod
    async def connect(cls) -> _Nats:
        import nats

        return cls(await nats.connect(NATS))

    async def setup(self, run: str) -> str:
        from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

        stream = f"IDEM_BENCH_RATE_{run}"
        await self.js.add_stream(StreamConfig(name=stream, subjects=[f"idem-bench-rate.{run}"]))
        config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
        await self.js.add_consumer(stream, config)
        return stream

    async def publish(self, target: str, run: str, n: int) -> None:
        subject = f"idem-bench-rate.{run}"
        for start in range(0, n, 250):
            sends = (
                self.js.publish(subject, BODY, headers={"Nats-Msg-Id": f"{run}-{i}"})
                for i in range(start, min(start + 250, n))
            )
            await asyncio.gather(*sends)
        held = (await self.js.stream_info(target)).state.messages
        if held != n:
            raise RuntimeError(f"published {n} messages but stream {target} holds {held}")

    async def left(self, target: str) -> int:
        info = await self.js.consumer_info(target, DURABLE)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def delete(self, target: str) -> None:
        await self.js.delete_stream(target)

    async def close(self) -> None:
        await self.connection.close()


def _server_pids() -> dict[str, list[int]]:
    """The local servers' processes, by role, found by name in /proc (none found: not measured)."""
    port = f":{urlparse(REDIS).port or 6379}"
    found: dict[str, list[int]] = {"rabbitmq": [], "nats": [], "redis": []}
    if not os.path.isdir("/proc"):
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
            if comm == "redis-server":
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if port.encode() not in f.read():
                        continue
        except OSError:
            continue
        role = {"beam.smp": "rabbitmq", "nats-server": "nats", "redis-server": "redis"}.get(comm)
        if role is not None:
            found[role].append(int(entry))
    return found


def _cpu_ns(pids: list[int]) -> int:
    """CPU time the processes' threads have used (/proc/<pid>/task/<tid>/schedstat), ns."""
    total = 0
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


async def _delete_keys(prefix: str) -> int:
    import redis.asyncio as redis

    client = redis.Redis.from_url(REDIS)
    deleted = 0
    try:
        names = [name async for name in client.scan_iter(match=prefix + "*", count=1000)]
        for start in range(0, len(names), 1000):
            deleted += await client.unlink(*names[start : start + 1000])
    finally:
        await client.aclose()
    return deleted


def _worker_argv(opts: argparse.Namespace, broker: str, side: str, target: str, run: str) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.bench_consumer_rate", "--worker", broker, "--side", side]
    argv += ["--name", target, "--window", str(opts.window), "--prefix", f"idem-bench-rate:{run}:"]
    argv += ["--namespace", f"bench-rate-{run}"]
    if opts.pythonpath:
        argv += ["--pythonpath", opts.pythonpath]
    if opts.cprofile:
        argv += ["--cprofile", opts.cprofile]
    return argv


async def one_round(broker: _Broker, side: str, number: int, opts: argparse.Namespace, log: IO[str]) -> dict[str, Any]:
    """N messages published, then consumed by P processes from one start signal; msg/s and CPU."""
    run = uuid.uuid4().hex[:10]
    target = await broker.setup(run)
    procs: list[_Proc] = []
    progress = asyncio.Event()
    try:
        for _ in range(opts.procs):
            proc = await asyncio.create_subprocess_exec(
                *_worker_argv(opts, broker.name, side, target, run),
                cwd=ROOT,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
            )
            procs.append(_Proc(proc, progress))
        await broker.publish(target, run, opts.n)  # while the consumers start
        deadline = time.monotonic() + ROUND_TIMEOUT

        def exited() -> bool:
            return any(p.reading.done() for p in procs)

        await _until(lambda: exited() or all(p.ready.is_set() for p in procs), progress, deadline, "ready")
        if exited():
            raise RuntimeError(f"a {broker.name} {side} consumer exited before the start; see {log.name}")
        servers = _server_pids()
        watched = {role: servers[role] for role in (broker.name, "redis") if servers[role]}
        cpu_before = {role: _cpu_ns(pids) for role, pids in watched.items()}
        started = time.monotonic()
        for p in procs:
            p.send("go")
        await _until(lambda: exited() or sum(p.count for p in procs) >= opts.n, progress, deadline, "the acks")
        servers_cpu = {role: (_cpu_ns(pids) - cpu_before[role]) / 1e3 / opts.n for role, pids in watched.items()}
        for p in procs:
            p.send("stop")
        for p in procs:
            await asyncio.wait_for(p.proc.wait(), 30)
            await p.reading
        reports = [p.done for p in procs]
        if any(r is None for r in reports):
            raise RuntimeError(f"a {broker.name} {side} consumer failed; see {log.name}")
        done = [r for r in reports if r is not None]
        left = await broker.left(target)
    finally:
        for p in procs:
            if p.proc.returncode is None:
                p.proc.kill()
                await p.proc.wait()
        with contextlib.suppress(Exception):
            await broker.delete(target)
        keys = await _delete_keys(f"idem-bench-rate:{run}:")
    acked = sum(r["count"] for r in done)
    seconds = max(r["last"] for r in done) - started
    return {
        "row": "round",
        "broker": broker.name,
        "side": side,
        "round": number,
        "messages": opts.n,
        "procs": opts.procs,
        "window": opts.window,
        "acked": acked,
        "left": left,
        "seconds": round(seconds, 4),
        "msg_per_s": round(opts.n / seconds, 1),
        "cpu_us_per_msg": round(sum(r["cpu_s"] for r in done) / opts.n * 1e6, 1),
        "broker_cpu_us_per_msg": _rounded(servers_cpu.get(broker.name)),
        "redis_cpu_us_per_msg": _rounded(servers_cpu.get("redis")),
        "first_ack_ms": round((min(r["first"] for r in done if r["count"]) - started) * 1e3, 1),
        "per_process": [r["count"] for r in done],
        "redis_keys": keys,
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 1) if known else None


def summary(rows: list[dict[str, Any]], broker: str) -> dict[str, Any] | None:
    """The median ratio ours/bare over rounds (round r against round r), or None without both sides."""
    by = {(r["side"], r["round"]): r for r in rows if r["broker"] == broker}
    rounds = sorted({n for side, n in by if ("bare", n) in by and ("ours", n) in by})
    if not rounds:
        return None
    ratios = [by["ours", n]["msg_per_s"] / by["bare", n]["msg_per_s"] for n in rounds]
    bare = [by["bare", n] for n in rounds]
    ours = [by["ours", n] for n in rounds]
    ratio = statistics.median(ratios)
    return {
        "row": "summary",
        "broker": broker,
        "rounds": len(rounds),
        "bare_msg_per_s": round(statistics.median(r["msg_per_s"] for r in bare), 1),
        "ours_msg_per_s": round(statistics.median(r["msg_per_s"] for r in ours), 1),
        "ratio": round(ratio, 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "bare_cpu_us_per_msg": _median(r["cpu_us_per_msg"] for r in bare),
        "ours_cpu_us_per_msg": _median(r["cpu_us_per_msg"] for r in ours),
        "bare_broker_cpu_us_per_msg": _median(r["broker_cpu_us_per_msg"] for r in bare),
        "ours_broker_cpu_us_per_msg": _median(r["broker_cpu_us_per_msg"] for r in ours),
        "ours_redis_cpu_us_per_msg": _median(r["redis_cpu_us_per_msg"] for r in ours),
        "target": TARGET,
        "met": ratio >= TARGET,
    }


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _round_line(r: dict[str, Any]) -> str:
    check = "" if r["left"] == 0 and r["acked"] >= r["messages"] else f"  !! {r['left']} left, {r['acked']} acked"
    return (
        f"{r['broker']:<9} {r['side']:<5} round {r['round']}: {r['msg_per_s']:>8,.0f} msg/s  ({r['seconds']:.3f} s;"
        f" CPU µs/msg: consumers {r['cpu_us_per_msg']:.0f}, {r['broker']} {_us(r['broker_cpu_us_per_msg'])},"
        f" redis {_us(r['redis_cpu_us_per_msg'])}; acks per process {'/'.join(map(str, r['per_process']))}){check}"
    )


async def main_async(opts: argparse.Namespace) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    brokers = opts.brokers.split(",")
    sides = opts.sides.split(",")
    rows: list[dict[str, Any]] = []
    if not opts.json:
        load = os.getloadavg()[0]
        print(
            f"{opts.n} messages per round, {opts.procs} consumer processes, prefetch / fetch batch {opts.window}; "
            f"{opts.rounds} rounds per side; load average {load:.2f}"
        )
    with (OUT / "bench_consumer_rate.log").open("a") as log:
        connected: dict[str, _Broker] = {}
        try:
            for name in brokers:
                connected[name] = await (_RabbitMQ.connect() if name == "rabbitmq" else _Nats.connect())
            for number in range(1, opts.rounds + 1):
                order = sides if number % 2 else sides[::-1]
                for name in brokers:
                    for side in order:
                        row = await one_round(connected[name], side, number, opts, log)
                        rows.append(row)
                        print(json.dumps(row) if opts.json else _round_line(row), flush=True)
        finally:
            for broker in connected.values():
                await broker.close()
    sums = [s for s in (summary(rows, name) for name in brokers) if s is not None]
    if opts.summary:
        from benchmarks import figures  # the parent only: consumer processes may import another checkout

        run = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for s in sums:
            setup = {"kind": "consumer-rate", "run": run, "n": opts.n, "procs": opts.procs, "window": opts.window}
            figures.append(opts.summary, {**setup, **{k: v for k, v in s.items() if k != "row"}})
    if opts.json:
        for s in sums:
            print(json.dumps(s))
        return 0 if all(r["left"] == 0 for r in rows) else 1
    if sums:
        print()
        head = f"{'broker':<9} {'bare msg/s':>10} {'ours msg/s':>10} {'ratio':>6} {'min-max':>10}"
        print(f"{head}  CPU µs/msg, bare -> ours: consumers (extra); broker; redis")
    for s in sums:
        extra = s["ours_cpu_us_per_msg"] - s["bare_cpu_us_per_msg"]
        print(
            f"{s['broker']:<9} {s['bare_msg_per_s']:>10,.0f} {s['ours_msg_per_s']:>10,.0f} {s['ratio']:>6.2f} "
            f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}  {s['bare_cpu_us_per_msg']:.0f} -> "
            f"{s['ours_cpu_us_per_msg']:.0f} (+{extra:.0f}); {_us(s['bare_broker_cpu_us_per_msg'])} -> "
            f"{_us(s['ours_broker_cpu_us_per_msg'])}; {_us(s['ours_redis_cpu_us_per_msg'])}"
        )
    for s in sums:
        verdict = "met" if s["met"] else "MISSED"
        print(f"TARGET {s['broker']} ours/bare >= {TARGET:.2f}: {verdict} ({s['ratio']:.2f})")
    return 0 if all(r["left"] == 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="messages per round")
    parser.add_argument("--procs", type=int, default=2, help="consumer processes")
    parser.add_argument("--window", type=int, default=100, help="RabbitMQ prefetch count / NATS fetch batch")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side and broker")
    parser.add_argument("--brokers", default="rabbitmq,nats")
    parser.add_argument("--sides", default="bare,ours")
    parser.add_argument("--json", action="store_true", help="JSON lines: one per round, one summary per broker")
    parser.add_argument("--summary", default="", help="also append each broker's summary as a JSON line here")
    parser.add_argument("--pythonpath", help="consumers import idem_asgi from this checkout instead")
    parser.add_argument("--cprofile", metavar="DIR", help="each consumer process dumps a cProfile of its consuming")
    # A consumer process (started by the parent):
    parser.add_argument("--worker", choices=("rabbitmq", "nats"), help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("bare", "ours"), help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        if opts.pythonpath:
            sys.path.insert(0, opts.pythonpath)
        return asyncio.run(worker(opts))
    unknown = set(opts.brokers.split(",")) - {"rabbitmq", "nats"} or set(opts.sides.split(",")) - {"bare", "ours"}
    if unknown:
        parser.error(f"unknown broker or side: {', '.join(sorted(unknown))}")
    return asyncio.run(main_async(opts))


if __name__ == "__main__":
    raise SystemExit(main())
