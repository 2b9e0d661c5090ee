"""The ASGI servers people deploy on, each started as its documented command line with 2 workers.

`AsgiServer(name, target, env, log)` runs granian (`--interface asgi`), hypercorn or gunicorn with
uvicorn workers on a free port in its own process group, by the command lines docs/production.md
prints (its `asgi-servers` block, read from the page). It is a `UvicornProcess` in all but the
command: `wait_ready` waits until both workers answer `GET /health`, `stop` ends the group. `terminate` is what a deploy
does on a stop (SIGTERM to the server's own process, never to the workers): the server must
pass it on and every worker must run its lifespan shutdown.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from tests.support.servers import ROOT, UvicornProcess, free_port, missing

SERVERS = ("granian", "hypercorn", "gunicorn")
NEEDS = {"granian": "granian", "hypercorn": "hypercorn", "gunicorn": "uvicorn_worker"}
"""The module each server's command imports (gunicorn's uvicorn workers: the `uvicorn-worker`
package; uvicorn's own `uvicorn.workers` is deprecated)."""
DOC = ROOT / "docs" / "production.md"
WORKERS = 2
HTTP2 = ("granian", "hypercorn")
"""The servers that serve HTTP/2 over plain TCP (h2c with prior knowledge) as started here."""


def documented() -> dict[str, str]:
    """The command lines of docs/production.md's `asgi-servers` block, by server."""
    found = re.search(r"<!-- test: asgi-servers -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    assert found is not None, "docs/production.md lost its asgi-servers block"
    return {line.split()[0]: line for line in found.group(1).splitlines() if line.strip()}


def command(name: str, target: str, port: int) -> list[str]:
    """The server's documented command line for `target` on `port`, quieter (`--log-level warning`)."""
    line = documented()[name]
    assert line.count("8000") == 1 and line.endswith(" app:app"), line
    *args, _ = shlex.split(line.replace("8000", str(port)))
    return [*args, "--log-level", "warning", target]


def need(name: str) -> None:
    """Skip (laptop) or fail (CI) when the server is not installed (it is in the `dev` extra)."""
    if importlib.util.find_spec(NEEDS[name]) is None:
        missing(f"{name} is not installed: pip install -e '.[dev]'", "server")


class AsgiServer(UvicornProcess):
    """`python -m <server> ...` for `target`, with `env` as its whole environment, output to `log`."""

    def __init__(self, name: str, target: str, env: Mapping[str, str], log: Path) -> None:
        need(name)
        self.name = name
        self.port = free_port()
        self.log = log
        self.workers = WORKERS
        program, *args = command(name, target, self.port)
        path = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", program, *args],
                cwd=ROOT,
                env={**env, "PYTHONPATH": path},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_gone(self, within: float) -> int | None:
        """The server's exit code once it and every worker exited within `within` seconds, else None."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not any_in_group(self.proc.pid):
                return self.proc.returncode
            time.sleep(0.05)
        return None

    def terminate(self, within: float = 20.0) -> int | None:
        """SIGTERM the server process alone, as a deploy's stop does: `wait_gone(within)`."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        return self.wait_gone(within)


def any_in_group(pgid: int) -> bool:
    """Whether a live (not zombie) process other than the leader is in process group `pgid`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == pgid:
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
