"""The FastAPI app the benchmarks serve with uvicorn, bare or behind IdempotencyMiddleware.

Routes:
- `POST /noop`: protected (when the middleware is on); returns a small JSON. The overhead target.
- `POST /open`: the same handler on a path no policy matches (pass-through cost).
- `POST /pay`: protected, key required; sleeps ~10 ms, counts its executions per key in Redis
  (`INCR`, so the count is right across workers) and answers 201 with a fresh charge id, so a
  second execution is visible in the body too.
- `GET /health`: readiness probe.

Selected by environment variables (read once, at start-up):
- `IDEM_BENCH_BACKEND`: empty or `none` for the bare app; else `memory://`, `redis://...` or
  `postgresql://...` for IdempotencyMiddleware on that store.
- `IDEM_BENCH_PREFIX` (Redis key prefix), `IDEM_BENCH_TABLE` (Postgres table), `IDEM_BENCH_TTL`
  (route TTL in seconds, short so benchmark records do not linger in a shared store; the lease
  is min(30 s, TTL)), `IDEM_BENCH_MAX_ENTRIES` (memory store bound).
- `IDEM_BENCH_COUNTER_URL` / `IDEM_BENCH_COUNTER_PREFIX`: where `/pay` counts executions (unset: no count).
- `IDEM_BENCH_PAY_SLEEP`: seconds `/pay` sleeps (default 0.01).

Run: `uvicorn --factory benchmarks.bench_app:create_app`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import idem_asgi
from idem_asgi import IdempotencyMiddleware, RoutePolicy, backend_from_url

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
    async def health() -> dict[str, str]:
        return {"status": "ok", "idem_asgi": os.path.dirname(idem_asgi.__file__)}

    @app.post("/noop")
    async def noop() -> dict[str, Any]:
        return NOOP_BODY

    @app.post("/open")
    async def open_route() -> dict[str, Any]:
        return NOOP_BODY

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


def protect(app: FastAPI, backend_url: str) -> FastAPI:
    """Add IdempotencyMiddleware on `/noop` and `/pay` (POST), backed by `backend_url`."""
    ttl = float(os.environ.get("IDEM_BENCH_TTL", "600"))
    lease = min(30.0, ttl)
    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend_from_url(backend_url, **backend_options(backend_url)),
        routes=[
            RoutePolicy("/noop", methods=["POST"], ttl=ttl, lease=lease, single_tenant=True),
            RoutePolicy("/pay", methods=["POST"], ttl=ttl, lease=lease, required=True, single_tenant=True),
        ],
    )
    return app


def create_app() -> FastAPI:
    """uvicorn factory: bare or protected, as `IDEM_BENCH_BACKEND` says."""
    app = build_bare()
    url = os.environ.get("IDEM_BENCH_BACKEND", "").strip()
    if url and url != "none":
        protect(app, url)
    return app


# --------------------------------------------------------------------------------------------
# Running the app under uvicorn in a subprocess (used by bench_overhead and bench_storm)
# --------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
_RUNNING: set[Server] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    only this server's own process group (the uvicorn master and its workers).
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
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = OUT / f"server-{label}.log"

    @property
    def pinned(self) -> bool:
        return bool(self.cpus) and shutil.which("taskset") is not None

    def start(self, timeout: float = 30.0) -> Server:
        OUT.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "uvicorn", "--factory", self.factory,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", str(self.workers), "--loop", self.loop, "--http", self.http,
            "--no-access-log", "--log-level", "warning",
        ]  # fmt: skip
        cmd = [*self.wrapper, *cmd]
        if self.pinned:
            cmd = ["taskset", "-c", str(self.cpus), *cmd]
        env = {**os.environ, **self.env}
        # this checkout's root last: a PYTHONPATH given in `env` (another idem_asgi to compare) wins
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.env.get("PYTHONPATH", ""), str(ROOT)) if p)
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed when the process is reaped
        try:
            # cwd is OUT, not ROOT: `python -m` puts the cwd first on sys.path, ahead of PYTHONPATH
            self.proc = subprocess.Popen(
                cmd, cwd=OUT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        _RUNNING.add(self)
        deadline = time.monotonic() + timeout
        probe = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"server {self.label} exited with {self.proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {self.label} not ready after {timeout} s (log: {self.log_path})")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(probe)
                    answer = b""
                    while len(answer) < 65536 and (chunk := s.recv(4096)):
                        answer += chunk
                if answer.startswith(b"HTTP/1.1 200"):
                    self.package = json.loads(answer.partition(b"\r\n\r\n")[2]).get("idem_asgi", "?")
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        if self.workers > 1:
            time.sleep(1.0)  # let every worker reach accept()
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
        proc = self.proc
        _RUNNING.discard(self)
        if proc is None or proc.returncode is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)  # the group this server was started in, nothing else
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

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
