"""A throwaway `nats-server` with JetStream and a store directory of its own, on a free port, in
its own process group: killed and started again on the same port and store (a broker restart)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests.support.servers import free_port, missing


class NatsProcess:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = ["nats-server", "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.workdir / "store")]
        with (self.workdir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                if s.recv(4).startswith(b"INFO"):
                    return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"nats-server did not listen within {timeout}s")

    def kill(self) -> None:
        """SIGKILL the server's process group and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def nats_process(workdir: Path) -> Iterator[NatsProcess]:
    """A started throwaway server, killed on exit whatever happened."""
    if shutil.which("nats-server") is None:
        missing("nats-server not on PATH")
    server = NatsProcess(workdir)
    try:
        server.start()
        yield server
    finally:
        server.kill()
