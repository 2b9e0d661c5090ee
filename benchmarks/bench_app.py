"""The FastAPI app the benchmarks serve with uvicorn, bare or behind IdempotencyMiddleware.

Routes:
- `POST /noop`: protected (when the middleware is on); returns a small JSON. The overhead target.
- `POST /open`: the same handler on a path no policy matches (pass-through cost).
- `POST /read`: protected; reads the whole body and answers its length (the scale curve's route:
  the bare app pays for reading the body too, as every real endpoint does).
- `POST /pay`: protected, key required; sleeps ~10 ms, counts its executions per key in Redis
  (`INCR`, so the count is right across workers) and answers 201 with a fresh charge id, so a
  second execution is visible in the body too.
- `GET /health`: readiness probe (the worker's pid, and where it imported idem_asgi from).

Selected by environment variables (read once, at start-up):
- `IDEM_BENCH_BACKEND`: empty or `none` for the bare app; else `memory://`, `redis://...` or
  `postgresql://...` for IdempotencyMiddleware on that store; `floor:capture` / `floor:forward` /
  `floor:naive` for the floors of `benchmarks/floors.py` (a minimal capture middleware, a
  forwarding one, a naive Redis one), added where ours is (`app.add_middleware`).
- `IDEM_BENCH_REDIS_CLIENT=1`: the Redis store over the user's own `redis.asyncio.Redis` client.
- `IDEM_BENCH_PREFIX` (Redis key prefix), `IDEM_BENCH_TABLE` (Postgres table), `IDEM_BENCH_TTL`
  (route TTL in seconds, short so benchmark records do not linger in a shared store; the lease
  is min(30 s, TTL)), `IDEM_BENCH_MAX_ENTRIES` (memory store bound).
- `IDEM_BENCH_COUNTER_URL` / `IDEM_BENCH_COUNTER_PREFIX`: where `/pay` counts executions (unset: no count).
- `IDEM_BENCH_PAY_SLEEP`: seconds `/pay` sleeps (default 0.01).
- `IDEM_BENCH_WAIT`: `wait=` (seconds) on `/pay`: repeats of a running payment are held, not 409.
- `IDEM_BENCH_ROUTE_REDIS`: a Redis URL; `/noop` and `/open` then do one `GET` there themselves (the
  app's own redis-py client), as a real endpoint does some I/O: the route the outside measurements
  of issue #29 used. Unset: they do nothing.

Run: `uvicorn --factory benchmarks.bench_app:create_app`.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import idem_asgi
from idem_asgi import IdempotencyMiddleware, RoutePolicy, backend_from_url

if TYPE_CHECKING:
    from tests.support.servers import UvicornProcess

NOOP_BODY = {"ok": True, "id": 42}


def backend_options(url: str) -> dict[str, Any]:
    """Store options from the environment: own key prefix / table so shared servers stay clean."""
    scheme = url.partition("://")[0].lower()
    if scheme in ("redis", "rediss", "unix"):
        return {"prefix": os.environ.get("IDEM_BENCH_PREFIX", "idem-bench:")}
    if scheme in ("postgres", "postgresql"):
        return {"table": os.environ.get("IDEM_BENCH_TABLE", "idem_bench_app_records")}
    if scheme == "memory" and os.environ.get("IDEM_BENCH_MAX_ENTRIES"):
        return {"max_entries": int(os.environ["IDEM_BENCH_MAX_ENTRIES"])}
    return {}


def build_bare() -> FastAPI:
    """The app without any idempotency middleware."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    counter_url = os.environ.get("IDEM_BENCH_COUNTER_URL", "")
    counter_prefix = os.environ.get("IDEM_BENCH_COUNTER_PREFIX", "idem-bench-count:")
    counter_ttl = int(float(os.environ.get("IDEM_BENCH_TTL", "600")))
    pay_sleep = float(os.environ.get("IDEM_BENCH_PAY_SLEEP", "0.01"))
    counter: dict[str, Any] = {}

    def counter_client() -> Any:
        if "client" not in counter:
            import redis.asyncio as aioredis

            # A blocking pool: a storm must wait for a connection, not fail (see field notes).
            pool = aioredis.BlockingConnectionPool.from_url(counter_url, max_connections=64, timeout=10)
            counter["client"] = aioredis.Redis(connection_pool=pool)
        return counter["client"]

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "idem_asgi": os.path.dirname(idem_asgi.__file__), "pid": os.getpid()}

    route_redis = os.environ.get("IDEM_BENCH_ROUTE_REDIS", "")
    if route_redis:
        import redis.asyncio as aioredis

        own = aioredis.Redis.from_url(route_redis)  # the app's own client, as an app makes one

        @app.post("/noop")
        async def noop_io() -> dict[str, Any]:
            await own.get("idem-bench-route-io")
            return NOOP_BODY

        @app.post("/open")
        async def open_io() -> dict[str, Any]:
            await own.get("idem-bench-route-io")
            return NOOP_BODY
    else:

        @app.post("/noop")
        async def noop() -> dict[str, Any]:
            return NOOP_BODY

        @app.post("/open")
        async def open_route() -> dict[str, Any]:
            return NOOP_BODY

    @app.post("/read")
    async def read(request: Request) -> dict[str, Any]:
        return {"ok": True, "bytes": len(await request.body())}  # as every real endpoint does

    @app.post("/pay")
    async def pay(request: Request) -> JSONResponse:
        order = await request.json()
        key = request.headers.get("idempotency-key", "")
        await asyncio.sleep(pay_sleep)  # the card network takes a moment
        executions = 0
        if counter_url and key:
            pipe = counter_client().pipeline(transaction=False)
            pipe.incr(counter_prefix + key)
            pipe.expire(counter_prefix + key, counter_ttl)
            executions = (await pipe.execute())[0]
        body = {"charge_id": uuid.uuid4().hex, "amount": order.get("amount"), "execution": executions}
        return JSONResponse(body, status_code=201)

    return app


def make_backend(url: str) -> Any:
    """The store for `url`; with `IDEM_BENCH_REDIS_CLIENT=1`, a Redis store over a client made the way
    a user would make one (`redis.asyncio.Redis.from_url`), instead of `RedisBackend.from_url`."""
    if os.environ.get("IDEM_BENCH_REDIS_CLIENT") == "1":
        import redis.asyncio as aioredis

        from idem_asgi.backends.redis import RedisBackend

        return RedisBackend(aioredis.Redis.from_url(url, socket_timeout=2), **backend_options(url))
    return backend_from_url(url, **backend_options(url))


def protect(app: FastAPI, backend_url: str) -> FastAPI:
    """Add IdempotencyMiddleware on `/noop` and `/pay` (POST), backed by `backend_url`."""
    ttl = float(os.environ.get("IDEM_BENCH_TTL", "600"))
    lease = min(30.0, ttl)
    wait = float(os.environ["IDEM_BENCH_WAIT"]) if os.environ.get("IDEM_BENCH_WAIT") else None
    app.add_middleware(
        IdempotencyMiddleware,
        backend=make_backend(backend_url),
        routes=[
            RoutePolicy("/noop", methods=["POST"], ttl=ttl, lease=lease, single_tenant=True),
            RoutePolicy("/read", methods=["POST"], ttl=ttl, lease=lease, single_tenant=True, max_body=2 << 20),
            RoutePolicy("/pay", methods=["POST"], ttl=ttl, lease=lease, required=True, single_tenant=True, wait=wait),
        ],
    )
    return app


def create_app() -> Any:
    """uvicorn factory: bare, protected, or behind a floor (`floor:capture`, `floor:forward`:
    benchmarks/floors.py), as `IDEM_BENCH_BACKEND` says."""
    app = build_bare()
    url = os.environ.get("IDEM_BENCH_BACKEND", "").strip()
    if url.startswith("floor:"):
        from benchmarks.floors import add_floor

        return add_floor(url.partition(":")[2], app)
    if url and url != "none":
        protect(app, url)
    return app


# --------------------------------------------------------------------------------------------
# Running the app under uvicorn in a subprocess (used by bench_overhead and bench_storm)
# --------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
_RUNNING: set[Server] = set()


def pin_self(cpus: str | None) -> str:
    """Pin this process (the load client) to `cpus` ("1", "1,2"); returns what was done."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return "client not pinned"
    wanted = {int(c) for c in cpus.split(",") if c.strip()}
    available = os.sched_getaffinity(0)
    if not wanted <= available or len(available) < 2:
        return f"client not pinned (cpus {sorted(available)} available)"
    os.sched_setaffinity(0, wanted)
    return f"client pinned to cpu {cpus}"


class Server:
    """uvicorn serving `factory` in its own process group, optionally pinned with `taskset -c`.

    Always stopped: by `stop()`, the context manager, or at interpreter exit. Stopping signals
    only this server's own process group (the uvicorn master and its workers). The process is a
    `tests.support.servers.UvicornProcess`, the launcher the tests use too.
    """

    def __init__(
        self,
        env: dict[str, str],
        *,
        label: str,
        workers: int = 1,
        cpus: str | None = "0",
        factory: str = "benchmarks.bench_app:create_app",
        loop: str = "auto",
        http: str = "auto",
        wrapper: tuple[str, ...] = (),
    ) -> None:
        self.env = env
        self.label = label
        self.workers = workers
        self.cpus = cpus
        self.factory = factory
        self.loop = loop
        self.http = http
        self.wrapper = wrapper  # e.g. ("valgrind", "--tool=callgrind", ...): put before the interpreter
        self.port = 0
        self.package = "?"  # where the server imported idem_asgi from (reported by /health)
        self.process: UvicornProcess | None = None
        self.log_path = OUT / f"server-{label}.log"

    @property
    def pinned(self) -> bool:
        return bool(self.cpus) and shutil.which("taskset") is not None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return None if self.process is None else self.process.proc

    def start(self, timeout: float = 30.0) -> Server:
        # Imported here, in the load client only: the server process imports this module for the
        # app, with another checkout's `tests` package perhaps first on its path (PYTHONPATH).
        from tests.support.servers import UvicornProcess

        OUT.mkdir(parents=True, exist_ok=True)
        prefix = ["taskset", "-c", str(self.cpus), *self.wrapper] if self.pinned else [*self.wrapper]
        # the launcher puts this checkout's root last: a PYTHONPATH given in `env` (another idem_asgi to compare) wins
        env = {**os.environ, **self.env, "PYTHONPATH": self.env.get("PYTHONPATH", "")}
        self.log_path.unlink(missing_ok=True)
        args = ["--factory", "--loop", self.loop, "--http", self.http]
        # cwd is OUT, not ROOT: `python -m` puts the cwd first on sys.path, ahead of PYTHONPATH
        self.process = UvicornProcess(
            self.factory, env, self.log_path, workers=self.workers, args=args, prefix=prefix, cwd=OUT
        )
        self.port = self.process.port
        _RUNNING.add(self)
        try:
            self.process.wait_ready_blocking(timeout=timeout)  # every worker answered: all reached accept()
        except RuntimeError as exc:
            self.stop()
            raise RuntimeError(f"server {self.label} not ready (log: {self.log_path}): {exc}") from exc
        self.package = str((self.process.health() or {}).get("idem_asgi", "?"))
        return self

    def cpu_seconds(self) -> float:
        """CPU time used so far by the server's processes (all threads), from /proc; 0.0 elsewhere.

        Noise-resistant cost measure: time other programs steal from the server's CPU is not
        counted, unlike wall-clock requests/s.
        """
        if self.proc is None or not os.path.isdir("/proc"):
            return 0.0
        total = 0
        for pid in self._pids():
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return total / 1e9

    def _pids(self) -> list[int]:
        assert self.proc is not None
        if self.workers == 1:
            return [self.proc.pid]
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[2]) == self.proc.pid:  # process group id == ours
                        pids.append(int(entry))
                except (OSError, ValueError, IndexError):
                    continue
        return pids

    def stop(self) -> None:
        _RUNNING.discard(self)
        if self.process is not None:
            self.process.stop()  # SIGTERM the group, SIGKILL what is left after 10 s

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all() -> None:
    """Stop every server still running (registered at exit; also call it from `finally`)."""
    for server in list(_RUNNING):
        server.stop()


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind through every `finally`, which stops the servers


atexit.register(stop_all)


def install_signal_handlers() -> None:
    """Make SIGTERM unwind like Ctrl-C, so servers are stopped on either."""
    signal.signal(signal.SIGTERM, _on_sigterm)
