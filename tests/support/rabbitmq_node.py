"""A throwaway RabbitMQ node (`rabbitmq-server`) on free ports, with its own node name, Mnesia and
log directories and Erlang cookie (HOME) under one directory, in its own process group: SIGKILLed
and started again on the same ports and data (a broker restart). It boots in about 12 s here."""

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

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


class RabbitNode:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.dist_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def _env(self) -> dict[str, str]:
        w = self.workdir
        return {
            **os.environ,
            "HOME": str(w),  # the Erlang cookie is created here
            "RABBITMQ_NODENAME": f"idem-test-{self.port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(w / "mnesia"),
            "RABBITMQ_LOG_BASE": str(w / "log"),
            "RABBITMQ_CONFIG_FILE": str(w / "rabbitmq"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(w / "enabled_plugins"),
            "RABBITMQ_PID_FILE": str(w / "rabbitmq.pid"),
        }

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with (self.workdir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [SERVER], env=self._env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"rabbitmq-server did not listen within {timeout}s")

    def kill(self) -> None:
        """SIGKILL the node's process group (the script and the Erlang VM) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def rabbitmq_node(workdir: Path) -> Iterator[RabbitNode]:
    """A started throwaway node, killed on exit whatever happened."""
    if not os.path.exists(SERVER) and shutil.which("rabbitmq-server") is None:
        missing("rabbitmq-server not installed")
    node = RabbitNode(workdir)
    try:
        node.start()
        yield node
    finally:
        node.kill()
