"""Client CPU per script call: the backend's own RESP pool against the well-kept Redis clients.

Every client runs the same `EVALSHA` (a script shaped like a replay: it reads a hash and returns a
short array with a ~300-byte body) `--calls` times with `--concurrency` calls in flight, on one
event loop. Printed per client and concurrency: microseconds of this process's CPU per call (the
figure that decides the middleware's throughput: the client shares the worker's one core with the
app) and calls/s; with `--syscalls` (needs `strace`, Debian's package) the system calls per call,
counted by `strace -c` attached for one extra round (what auto-pipelining saves).
`--concurrency 1,32,256` measures each in turn. Clients that are not installed are skipped with
the line to install them:

    python -m benchmarks.bench_redis_clients
    pip install coredis valkey-glide && python -m benchmarks.bench_redis_clients --calls 20000

`docs/redis.md` quotes the result and the decision that follows from it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

SCRIPT = """
local v = redis.call('HGET', KEYS[1], 'b')
return {'c', ARGV[1], v}
"""
KEY = "idem-bench-clients:{k}"
Call = Callable[[], Awaitable[Any]]


async def resp_pool(url: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    from idem_asgi.backends.redis._resp import RespPool

    pool = RespPool.from_url(url, timeout=2.0, max_connections=512)
    if pool is None:
        raise SystemExit(f"{url}: not a URL the lean pool takes")
    script = pool.script(SCRIPT)
    return (lambda: script([KEY], ("1",))), pool.aclose


async def redis_py(url: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, max_connections=512)
    script = client.register_script(SCRIPT)
    return (lambda: script(keys=[KEY], args=["1"])), client.aclose


async def coredis_client(url: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import coredis  # type: ignore[import-not-found,unused-ignore]

    client = coredis.Redis.from_url(url, max_connections=512)
    await client.__aenter__()  # coredis 6 opens its pool in its context
    script = client.register_script(SCRIPT)

    async def close() -> None:
        await client.__aexit__(None, None, None)

    return (lambda: script(keys=[KEY], args=["1"])), close


async def glide(url: str) -> tuple[Call, Callable[[], Awaitable[None]]]:
    from urllib.parse import urlsplit

    from glide import (  # type: ignore[import-not-found,unused-ignore]
        GlideClient,
        GlideClientConfiguration,
        NodeAddress,
        Script,
    )

    parts = urlsplit(url)
    config = GlideClientConfiguration([NodeAddress(parts.hostname or "127.0.0.1", parts.port or 6379)])
    client = await GlideClient.create(config)
    script = Script(SCRIPT)
    return (lambda: client.invoke_script(script, keys=[KEY], args=["1"])), client.close


CLIENTS: dict[str, tuple[Callable[[str], Awaitable[tuple[Call, Callable[[], Awaitable[None]]]]], str]] = {
    "idem_asgi _resp": (resp_pool, "idem-asgi[redis]"),
    "redis-py + hiredis": (redis_py, "redis[hiredis]"),
    "coredis": (coredis_client, "coredis"),
    "valkey-glide": (glide, "valkey-glide"),
}


async def syscalls_per_call(call: Call, calls: int, concurrency: int) -> float:
    """System calls of this process per call, counted by `strace -c -f` attached for one round."""
    import signal
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        tracer = await asyncio.create_subprocess_exec(
            "strace", "-c", "-f", "-o", out.name, "-p", str(os.getpid()), stderr=subprocess.DEVNULL
        )
        await asyncio.sleep(0.5)  # attached (strace prints nothing we could wait on)
        await measure(call, calls, concurrency, warm=False)
        tracer.send_signal(signal.SIGINT)
        await asyncio.wait_for(tracer.wait(), 10)
        # "% time  seconds  usecs/call  calls  [errors]  total": the calls column
        total = [line.split() for line in out.read().splitlines() if line.rstrip().endswith("total")]
    return int(total[-1][3]) / calls if total else float("nan")


async def measure(call: Call, calls: int, concurrency: int, *, warm: bool = True) -> tuple[float, float]:
    """(client CPU microseconds per call, calls per second) for `calls` calls."""

    async def lane(n: int) -> None:
        for _ in range(n):
            await call()

    for _ in range(200 if warm else 0):  # warm up: connections, script cache
        await call()
    share = [calls // concurrency + (1 if i < calls % concurrency else 0) for i in range(concurrency)]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane(n) for n in share))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu / calls * 1e6, calls / wall


async def main_async(args: argparse.Namespace) -> int:
    import redis.asyncio as aioredis

    setup = aioredis.Redis.from_url(args.redis_url)
    await setup.hset(KEY, "b", b"x" * 300)
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    print(f"# {args.calls} EVALSHA calls per client and concurrency, one event loop, pid {os.getpid()}")
    print(f"{'client':<22}{'in flight':>10}{'CPU us/call':>12}{'syscalls/call':>14}{'calls/s':>10}{'CPU vs _resp':>14}")
    base: dict[int, float] = {}
    try:
        for name, (make, package) in CLIENTS.items():
            try:
                call, close = await make(args.redis_url)
            except ImportError:
                print(f"{name:<22}{'skipped: pip install ' + package:>36}")
                continue
            try:
                for level in levels:
                    per_call, rate = min(
                        [await measure(call, args.calls, level) for _ in range(args.rounds)]
                    )  # the least disturbed round
                    traced = await syscalls_per_call(call, args.calls, level) if args.syscalls else float("nan")
                    first = base.setdefault(level, per_call)
                    row = f"{name:<22}{level:>10}{per_call:>12.1f}{traced:>14.2f}{rate:>10.0f}"
                    print(f"{row}{per_call / first:>13.2f}x")
            finally:
                await close()
    finally:
        await setup.delete(KEY)
        await setup.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--concurrency", default="1,32,256", help="calls in flight; a comma list measures each")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--syscalls", action="store_true", help="also count system calls per call (strace -c)")
    p.add_argument("--redis-url", default=os.environ.get("IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
