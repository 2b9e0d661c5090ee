"""A throwaway PgBouncer in front of the shared test Postgres, for the pooler tests.

`pgbouncer(mode)` starts Debian's `pgbouncer` (as the `postgres` user: it refuses to run as root)
on a free port with `pool_mode = <mode>` and nothing else changed from a stock set-up: trust auth,
database `test` on 127.0.0.1:5432, no `ignore_startup_parameters`. It yields the DSN to use
instead of `POSTGRES_DSN`, and stops the process by its PID (SIGKILL if SIGTERM is not enough)
and deletes its directory afterwards, whatever happened. Without the binary, or not as root, the
test skips (fails under CI=true).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

from tests.support.servers import POSTGRES_DSN, free_port, missing, reachable, require

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _config(base: Path, port: int, mode: str) -> str:
    target = urlparse(POSTGRES_DSN)
    return (
        "[databases]\n"
        f"* = host={target.hostname or '127.0.0.1'} port={target.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {base / 'users.txt'}\n"
        f"pool_mode = {mode}\ndefault_pool_size = 20\nmax_client_conn = 500\n"
        f"logfile = {base / 'pgbouncer.log'}\npidfile = {base / 'pgbouncer.pid'}\n"
    )


@contextlib.contextmanager
def pgbouncer(mode: str = "transaction") -> Iterator[str]:
    """A started PgBouncer in `mode` (transaction, statement, session); yields its DSN."""
    require("postgres", POSTGRES_DSN)
    if not Path(PGBOUNCER).exists():
        missing("pgbouncer not installed (apt-get install pgbouncer; .ci/run installs it)")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        missing("pgbouncer: needs root and runuser to run it as the postgres user")
    base = Path(tempfile.mkdtemp(prefix="idem-pgbouncer-"))
    port = free_port()
    user = urlparse(POSTGRES_DSN).username or "postgres"
    (base / "users.txt").write_text(f'"{user}" ""\n')
    (base / "pgbouncer.ini").write_text(_config(base, port, mode))
    for path in (base, base / "users.txt", base / "pgbouncer.ini"):
        shutil.chown(path, "postgres", "postgres")
    proc = subprocess.Popen(
        ["runuser", "-u", "postgres", "--", PGBOUNCER, str(base / "pgbouncer.ini")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    dsn = f"postgresql://{user}@127.0.0.1:{port}/{urlparse(POSTGRES_DSN).path.lstrip('/') or 'test'}"
    try:
        deadline = time.monotonic() + 10
        while not reachable(dsn):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (base / "pgbouncer.log").read_text(errors="replace") if (base / "pgbouncer.log").exists() else ""
                raise RuntimeError(f"pgbouncer did not start: {log[-2000:]}")
            time.sleep(0.05)
        yield dsn
    finally:
        _stop(proc, base / "pgbouncer.pid")
        shutil.rmtree(base, ignore_errors=True)


def _stop(proc: subprocess.Popen[bytes], pidfile: Path) -> None:
    """SIGTERM pgbouncer by its PID (runuser's child, named in its pid file), SIGKILL after 5 s."""
    pids = [proc.pid]
    with contextlib.suppress(OSError, ValueError):
        pids.insert(0, int(pidfile.read_text().split()[0]))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
