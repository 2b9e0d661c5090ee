"""Servers for tests and benchmarks: where the shared ones are, and throwaway ones started here.

- The shared Redis and Postgres (`REDIS_URL`, `POSTGRES_DSN`), and how a test gets them or skips
  (fails under CI=true): `require`, `missing`.
- Throwaway `redis-server`s (`RedisProcess`, `redis_process`), a three-primary Redis Cluster
  (`redis_cluster`) and a Sentinel-watched primary with replicas (`redis_sentinel`), killed
  (process group, SIGKILL) on exit even when the test fails.
- A throwaway PostgreSQL cluster (`PostgresCluster`, `postgres_cluster`): initdb, start, restart,
  freeze, stop, remove.
- uvicorn: in a subprocess of its own process group (`UvicornProcess`), or in this event loop
  (`serving`).
- `free_port`, `reachable`, `ping`, `wait_until`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlparse

import pytest
import uvicorn

REDIS_URL = os.environ.get("IDEM_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_DSN = os.environ.get("IDEM_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ROOT = Path(__file__).resolve().parents[2]
"""The checkout: the working directory of every server started here."""


# -- the shared servers ---------------------------------------------------------------------------


def missing(message: str, what: str = "tool") -> NoReturn:
    """Skip (on a laptop) or fail (under CI=true: a missing server or tool fails the run)."""
    if IN_CI:
        pytest.fail(f"{message} (CI=true: a missing {what} fails the run)")
    pytest.skip(message)


def reachable(url: str) -> bool:
    """True when a TCP connection to the URL's host and port succeeds."""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 0), timeout=1):
            return True
    except OSError:
        return False


def require(name: str, url: str) -> None:
    """Skip (on a laptop) or fail (under CI=true) when the server is not reachable."""
    if reachable(url):
        return
    variable = "IDEM_POSTGRES_DSN" if name == "postgres" else f"IDEM_{name.upper()}_URL"
    start = "start it with `bash services/start-services.sh`"
    missing(f"{name} not reachable at {url}; {start} or set {variable}", "server")


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until(condition: Callable[[], bool], within: float) -> None:
    """Poll `condition` every 50 ms for at most `within` seconds."""
    deadline = time.monotonic() + within
    while not condition() and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded poll of plain state
        await asyncio.sleep(0.05)


# -- throwaway redis-servers ----------------------------------------------------------------------


def need_redis_server() -> None:
    """Skip (laptop) or fail (CI) when the redis-server binary is missing."""
    if shutil.which("redis-server") is None:
        missing("redis-server not on PATH")


def ping(*, port: int | None = None, path: str | None = None, timeout: float = 0.2) -> bool:
    """True when a server answers PING on the TCP port or unix socket."""
    try:
        if path is not None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(path)
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        with socket.create_connection(("127.0.0.1", port or 0), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    """One `redis-server` in its own process group, on a fixed port (so it restarts where it was)."""

    def __init__(self, workdir: Path, *, port: int | None = None, args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.unixsocket: str | None = None
        if "--unixsocket" in self.args:
            self.unixsocket = self.args[self.args.index("--unixsocket") + 1]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--enable-debug-command",
            "local",
            "--repl-diskless-sync-delay",  # a replica syncs at once, not after 5 s
            "0",
            "--daemonize",
            "no",
            "--dir",
            str(self.workdir),
            *self.args,
        ]
        with (self.workdir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
            if ping(port=None if self.port == 0 else self.port, path=self.unixsocket if self.port == 0 else None):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer PING within {timeout}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.workdir / "server.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None and self.proc.poll() is None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group (also if it is stopped), and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def redis_process(workdir: Path, *, port: int | None = None, args: Sequence[str] = ()) -> Iterator[RedisProcess]:
    """A started throwaway server, killed on exit whatever happened."""
    need_redis_server()
    server = RedisProcess(workdir, port=port, args=args)
    try:
        server.start()
        yield server
    finally:
        server.kill()


def cluster_port() -> int:
    """A free port N with N + 10000 (the cluster bus) free too, so N <= 55535."""
    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def redis_cli(*args: str, timeout: float = 30) -> str:
    done = subprocess.run(["redis-cli", *args], capture_output=True, timeout=timeout, check=True)
    return done.stdout.decode(errors="replace")


@contextlib.contextmanager
def redis_cluster(base: Path, *, replicas: int = 0) -> Iterator[list[RedisProcess]]:
    """Three primaries (and `replicas` replicas each, in sync), all slots assigned, under `base`;
    killed on exit. The first three nodes are the primaries."""
    need_redis_server()
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not on PATH")
    with ExitStack() as stack:
        nodes = []
        for i in range(3 * (1 + replicas)):
            workdir = base / f"node{i}"
            args = ["--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf")]
            nodes.append(stack.enter_context(redis_process(workdir, port=cluster_port(), args=args)))
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        redis_cli("--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes")
        deadline = time.monotonic() + 20
        while True:
            infos = [redis_cli("-p", str(n.port), "cluster", "info", timeout=5) for n in nodes]
            if all("cluster_state:ok" in info for info in infos) and all(
                replicas_confirm(n, replicas) for n in nodes[:3]
            ):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"cluster did not reach cluster_state:ok: {infos}")
            time.sleep(0.1)
        yield nodes


class SentinelProcess(RedisProcess):
    """One `redis-server <conf> --sentinel` watching `service` on `primary` (quorum 2, down after 1 s)."""

    def __init__(self, workdir: Path, *, primary: int, service: str = "mymaster") -> None:
        super().__init__(workdir)
        self.primary = primary
        self.service = service

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.workdir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary} 2\n"
            f"sentinel down-after-milliseconds {self.service} 1000\n"
            f"sentinel failover-timeout {self.service} 5000\n"
            f"sentinel parallel-syncs {self.service} 2\n"
        )
        with (self.workdir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                ["redis-server", str(conf), "--sentinel"],
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not ping(port=self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"sentinel did not start: {self.log_tail()}")
            time.sleep(0.02)


def replicas_confirm(primary: RedisProcess, replicas: int) -> bool:
    """A write on `primary` reaches `replicas` replicas (WAIT): the stream flows. Just after a
    replica synced, the primary holds the stream back until the replica's first ACK (up to 1 s)."""
    import redis

    client = redis.Redis(port=primary.port, socket_timeout=2)
    try:
        for i in range(100):  # a cluster node takes only keys of its own slots: find one
            try:
                client.set(f"replication-probe-{i}", time.monotonic())
                break
            except redis.exceptions.MovedError:
                continue
        return int(client.execute_command("WAIT", replicas, 100)) == replicas  # type: ignore[no-untyped-call]
    finally:
        client.close()


def replica_synced(primary: RedisProcess, replica: RedisProcess) -> bool:
    """The replica says its link is up and it confirms the primary's writes (what WAIT counts)."""
    info = redis_cli("-p", str(replica.port), "info", "replication", timeout=5)
    return "master_link_status:up" in info and replicas_confirm(primary, 1)


@contextlib.contextmanager
def redis_sentinel(
    base: Path, *, replicas: int = 2
) -> Iterator[tuple[RedisProcess, list[RedisProcess], list[SentinelProcess]]]:
    """A primary, `replicas` replicas in sync and three sentinels that agree on it (quorum 2),
    as (primary, replicas, sentinels) under `base`; all killed on exit. The service is `mymaster`."""
    need_redis_server()
    with ExitStack() as stack:
        primary = stack.enter_context(redis_process(base / "primary"))
        followers = [
            stack.enter_context(
                redis_process(base / f"replica{i}", args=["--replicaof", "127.0.0.1", str(primary.port)])
            )
            for i in range(replicas)
        ]
        sentinels = [SentinelProcess(base / f"sentinel{i}", primary=primary.port) for i in range(3)]
        for sentinel in sentinels:
            stack.callback(sentinel.kill)
            sentinel.start()
        deadline = time.monotonic() + 30
        while True:
            synced = all(
                "master_link_status:up" in redis_cli("-p", str(f.port), "info", "replication") for f in followers
            )
            synced = synced and replicas_confirm(primary, replicas)
            agreed = all(
                redis_cli("-p", str(s.port), "sentinel", "ckquorum", "mymaster", timeout=5).startswith("OK")
                and f"num-slaves\n{replicas}\n" in redis_cli("-p", str(s.port), "sentinel", "master", "mymaster")
                for s in sentinels
            )
            if synced and agreed:
                break
            if time.monotonic() > deadline:
                pytest.fail("sentinel topology not ready: " + " | ".join(s.log_tail()[-300:] for s in sentinels))
            time.sleep(0.2)
        yield primary, followers, sentinels


# -- a throwaway PostgreSQL cluster ---------------------------------------------------------------
#
# The machine's shared server is never touched. The cluster lives in a temporary directory owned
# by the `postgres` user (the server refuses to run as root), listens on a free port on 127.0.0.1
# with trust authentication, and is stopped with `-m immediate` and deleted on teardown.
# `fsync=off` only speeds the tests up: it matters for an OS crash, not for a server crash or
# an immediate restart, which still replay the WAL the kernel holds.

PG_BIN = Path(os.environ.get("IDEM_PG_BIN", "/usr/lib/postgresql/15/bin"))


class PostgresCluster:
    """One throwaway cluster; every command runs as the `postgres` user with a bounded timeout."""

    def __init__(self, base: Path, port: int, *, options: str = "") -> None:
        self.base = base
        self.data = base / "data"
        self.sock = base / "sock"
        self.log = base / "server.log"
        self.port = port
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        self.options = options  # more `-c name=value` for the server

    def _pg(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *args],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def init(self) -> None:
        self._pg(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"
        )

    def _options(self) -> str:
        common = f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60"
        return f"{common} {self.options}".strip()

    def _ctl(self, *args: str) -> None:
        self._pg(str(PG_BIN / "pg_ctl"), *args, "-w", "-t", "30", "-D", str(self.data))

    def start(self) -> None:
        self._ctl("start", "-l", str(self.log), "-o", self._options())

    def restart(self) -> None:
        """Immediate restart: every backend dies at once, then crash recovery replays the WAL."""
        self._ctl("restart", "-m", "immediate", "-o", self._options())

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._ctl("stop", "-m", "immediate")

    def pids(self) -> list[int]:
        """The postmaster and all its children (to freeze the whole server)."""
        try:
            postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return []
        pids = [postmaster]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = (entry / "stat").read_text()
                    if int(stat.rpartition(")")[2].split()[1]) == postmaster:
                        pids.append(int(entry.name))
        return pids

    def kill(self) -> None:
        """SIGKILL the postmaster (a crashed host): its backends exit on their own."""
        for pid in self.pids()[:1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def freeze(self) -> None:
        """SIGSTOP every server process: connections stay open, nothing answers (a hung host)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def postgres_cluster() -> Iterator[PostgresCluster]:
    """Start a cluster; stop it and delete its files afterwards, whatever happened."""
    if not (PG_BIN / "initdb").exists():
        missing(f"throwaway postgres cluster: no initdb under {PG_BIN}")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        missing("throwaway postgres cluster: needs root and runuser to run the server as the postgres user")
    base = Path(tempfile.mkdtemp(prefix="idem-pg-"))
    cluster = PostgresCluster(base, free_port())
    try:
        shutil.chown(base, "postgres", "postgres")
        base.chmod(0o700)
        cluster.sock.mkdir()
        shutil.chown(cluster.sock, "postgres", "postgres")
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.thaw()
            cluster.stop()
        except (OSError, subprocess.SubprocessError):
            for pid in cluster.pids()[:1]:  # the postmaster; its children exit with it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def postgres_standby_pair(*, synchronous: bool = True) -> Iterator[tuple[PostgresCluster, PostgresCluster]]:
    """A primary and a streaming standby. `synchronous`: the primary commits synchronously to it
    (`synchronous_standby_names`, `synchronous_commit=on`), so every commit it acknowledges is on
    the standby; else replication is asynchronous. Yields (primary, standby); both stopped and
    deleted afterwards."""
    if not (PG_BIN / "initdb").exists():
        missing(f"throwaway postgres cluster: no initdb under {PG_BIN}")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        missing("throwaway postgres cluster: needs root and runuser to run the server as the postgres user")
    base = Path(tempfile.mkdtemp(prefix="idem-pg-pair-"))
    sync = "-c wal_level=replica -c max_wal_senders=5"
    if synchronous:
        sync += " -c synchronous_standby_names=standby1 -c synchronous_commit=on"
    primary = PostgresCluster(base / "primary", free_port(), options=sync)
    standby = PostgresCluster(base / "standby", free_port(), options="-c hot_standby=on")
    try:
        shutil.chown(base, "postgres", "postgres")
        base.chmod(0o700)
        for cluster in (primary, standby):
            cluster.base.mkdir()
            cluster.sock.mkdir()
            for path in (cluster.base, cluster.sock):
                shutil.chown(path, "postgres", "postgres")
        primary.init()
        primary.start()
        primary._pg(
            str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", str(standby.data), "-R", "-X", "stream", "--no-sync",
        )  # fmt: skip
        conninfo = f"host=127.0.0.1 port={primary.port} user=postgres application_name=standby1"
        auto = standby.data / "postgresql.auto.conf"
        auto.write_text(auto.read_text() + f"primary_conninfo = '{conninfo}'\n")
        standby.start()
        deadline = time.monotonic() + 30
        while _sync_state(primary) != ("sync" if synchronous else "async"):
            if time.monotonic() > deadline:
                pytest.fail(f"the standby never became synchronous: {standby.log.read_text()[-1000:]}")
            time.sleep(0.1)
        yield primary, standby
    finally:
        for cluster in (primary, standby):
            try:
                cluster.thaw()
                cluster.stop()
            except (OSError, subprocess.SubprocessError):
                cluster.kill()
        shutil.rmtree(base, ignore_errors=True)


def _sync_state(primary: PostgresCluster) -> str:
    done = subprocess.run(
        ["psql", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres", "-d", "postgres", "-Atc",
         "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby1'"],
        capture_output=True, timeout=10,
    )  # fmt: skip
    return done.stdout.decode().strip()


# -- uvicorn ----------------------------------------------------------------------------------------


def get_health(port: int, *, timeout: float = 2.0) -> dict[str, Any] | None:
    """The JSON of a 200 answer to `GET /health` on a fresh connection to 127.0.0.1:port, or None."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
            answer = b""
            while len(answer) < 65536 and (chunk := s.recv(4096)):
                answer += chunk
    except OSError:
        return None
    head, _, body = answer.partition(b"\r\n\r\n")
    if not head.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")):
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class UvicornProcess:
    """`python -m uvicorn <target>` on 127.0.0.1 in its own process group; always stopped by the caller.

    The app answers `GET /health` with a JSON object holding its `pid`, so `wait_ready` can tell
    when every one of `workers` answers. `env` is the whole environment (PYTHONPATH gets the
    checkout appended, so a PYTHONPATH given in `env` comes first); `args` go after the common
    options; `prefix` before the interpreter (`taskset -c 0`, valgrind). The output is appended to `log`.
    """

    def __init__(
        self,
        target: str,
        env: Mapping[str, str],
        log: Path,
        *,
        workers: int = 1,
        args: Sequence[str] = (),
        prefix: Sequence[str] = (),
        cwd: Path = ROOT,
    ) -> None:
        self.port = free_port()
        self.log = log
        self.workers = workers
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "uvicorn",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            str(workers),
            "--log-level",
            "warning",
            "--no-access-log",
            *args,
        ]
        path = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env={**env, "PYTHONPATH": path},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def health(self) -> dict[str, Any] | None:
        """What one worker answered to GET /health on a fresh connection, or None."""
        return get_health(self.port)

    def _ready_step(self, pids: set[int], deadline: float) -> float | None:
        """One readiness probe: None once `workers` distinct pids answered, else the pause before the next."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"uvicorn exited with {self.proc.returncode}: {self.tail()}")
        doc = self.health()
        if doc is not None:
            pids.add(int(doc["pid"]))
            if len(pids) >= self.workers:
                return None
        if time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn on {self.port}: {len(pids)}/{self.workers} workers ready: {self.tail()}")
        return 0.02 if doc is not None else 0.1

    async def wait_ready(self, *, timeout: float = 30.0) -> set[int]:
        """Until every worker answered /health (their distinct pids), bounded by `timeout`."""
        deadline = time.monotonic() + timeout
        pids: set[int] = set()
        while (pause := await asyncio.to_thread(self._ready_step, pids, deadline)) is not None:  # noqa: ASYNC110 - bounded poll of a subprocess
            await asyncio.sleep(pause)
        return pids

    def wait_ready_blocking(self, *, timeout: float = 30.0) -> set[int]:
        """`wait_ready` for callers without an event loop of their own."""
        deadline = time.monotonic() + timeout
        pids: set[int] = set()
        while (pause := self._ready_step(pids, deadline)) is not None:
            time.sleep(pause)
        return pids

    async def wait_dead(self, timeout: float) -> int | None:
        """The return code once the process exited, or None after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded poll
            await asyncio.sleep(0.02)
        return self.proc.poll()

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        """Send `sig` to the server's process group (the uvicorn master and its workers)."""
        os.killpg(self.proc.pid, sig)

    def _exited(self, timeout: float) -> bool:
        """Wait up to `timeout` for the leader to exit WITHOUT reaping it (its pid keeps the group ours)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                    return True
            except ChildProcessError:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM the group (graceful), SIGKILL what is left after 10 s; a no-op on a reaped server."""
        if self.proc.returncode is not None:
            return  # already reaped (a crash worker: no children)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        self._exited(10)
        # The leader is alive or a zombie, so the group id cannot have been reused: kill what remains.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@contextlib.asynccontextmanager
async def serving(app: Any, *, start_within: float = 10, stop_within: float = 10, **config: Any) -> AsyncIterator[str]:
    """`app` under a real uvicorn in this event loop, on a socket bound before it starts (no
    free-port race); yields its base URL. `config` goes to `uvicorn.Config`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    try:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **{"log_level": "warning", **config}))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            deadline = time.monotonic() + start_within
            while not server.started:
                if task.done():
                    raise RuntimeError(f"uvicorn stopped before serving: {task.exception()!r}")
                assert time.monotonic() < deadline, "uvicorn did not start"
                await asyncio.sleep(0.01)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, stop_within)
    finally:
        sock.close()
