"""A throwaway PostgreSQL cluster for fault tests: initdb, start, restart, freeze, stop, remove.

The machine's shared server is never touched. The cluster lives in a temporary directory owned
by the `postgres` user (the server refuses to run as root), listens on a free port on 127.0.0.1
with trust authentication, and is stopped with `-m immediate` and deleted on teardown.
`fsync=off` only speeds the tests up: it matters for an OS crash, not for a server crash or
an immediate restart, which still replay the WAL the kernel holds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import IN_CI, free_port

BIN = Path(os.environ.get("IDEM_PG_BIN", "/usr/lib/postgresql/15/bin"))


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"throwaway postgres cluster: {reason} (CI=true: a missing tool fails the run)")
    pytest.skip(f"throwaway postgres cluster: {reason}")


class Cluster:
    """One throwaway cluster; every command runs as the `postgres` user with a bounded timeout."""

    def __init__(self, base: Path, port: int) -> None:
        self.base = base
        self.data = base / "data"
        self.sock = base / "sock"
        self.log = base / "server.log"
        self.port = port
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _pg(self, *args: str, timeout: float = 60) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *args],
            check=True,
            timeout=timeout,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def init(self) -> None:
        self._pg(str(BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

    def _options(self) -> str:
        return f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=60"

    def start(self) -> None:
        self._pg(
            str(BIN / "pg_ctl"),
            "start",
            "-w",
            "-t",
            "30",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-o",
            self._options(),
        )

    def restart(self) -> None:
        """Immediate restart: every backend dies at once, then crash recovery replays the WAL."""
        self._pg(
            str(BIN / "pg_ctl"),
            "restart",
            "-m",
            "immediate",
            "-w",
            "-t",
            "30",
            "-D",
            str(self.data),
            "-o",
            self._options(),
        )

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._pg(str(BIN / "pg_ctl"), "stop", "-m", "immediate", "-w", "-t", "30", "-D", str(self.data))

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
def throwaway_cluster() -> Iterator[Cluster]:
    """Start a cluster; stop it and delete its files afterwards, whatever happened."""
    if not (BIN / "initdb").exists():
        _unavailable(f"no initdb under {BIN}")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        _unavailable("needs root and runuser to run the server as the postgres user")
    base = Path(tempfile.mkdtemp(prefix="idem-pg-"))
    cluster = Cluster(base, free_port())
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
