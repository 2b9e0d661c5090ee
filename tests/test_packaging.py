"""The install lines the README prints work: `python3 dev.py wheel` builds a wheel, and a fresh
virtualenv that installs it (bare, then with every extra) imports the package, finds `py.typed`,
runs the console script, and names the missing extra when a store's driver is absent."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.support.servers import ROOT

pytestmark = pytest.mark.slow
EXTRAS = ("redis", "postgres", "client", "prometheus")

BARE = """
import importlib.resources, json, idem_asgi
from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import MemoryBackend
from idem_asgi.errors import MissingExtra
assert importlib.resources.files("idem_asgi").joinpath("py.typed").is_file()
MemoryBackend()
said = {}
def needs(extra, use):
    try:
        use()
    except MissingExtra as exc:
        said[extra] = str(exc)
    else:
        raise AssertionError(f"the {extra} extra is not installed: it must say which extra to install")
def client():
    import idem_asgi.client
def prometheus():
    from idem_asgi.observe import prometheus_observer
    prometheus_observer()
def redis():
    from idem_asgi.backends import RedisBackend
    RedisBackend.from_url("redis://127.0.0.1:6379/0")
def postgres():
    from idem_asgi.backends import PostgresBackend
    PostgresBackend.from_url("postgresql://127.0.0.1/test")
needs("redis", redis)
needs("postgres", postgres)
needs("client", client)
needs("prometheus", prometheus)
print(json.dumps(said))
"""

WITH_EXTRAS = """
import redis.asyncio, asyncpg, httpx, prometheus_client
from idem_asgi.backends import PostgresBackend, RedisBackend
from idem_asgi.client import IdempotentRetryTransport
from idem_asgi.observe import prometheus_observer
RedisBackend.from_url("redis://127.0.0.1:6379/0")
prometheus_observer()
print("extras ok")
"""


def ran(*argv: str, cwd: Path) -> str:
    """Run it outside the checkout (`python -c` would import the checkout's package from cwd)."""
    done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_built_wheel_installs_into_a_fresh_venv_with_each_extra(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "dev.py", "wheel"], cwd=ROOT, capture_output=True, text=True, check=True)
    wheel = Path(built.stdout.strip().splitlines()[-1])
    assert wheel.suffix == ".whl" and wheel.is_file(), built.stdout
    assert f'pip install "dist/{wheel.name}[redis]"' in (ROOT / "README.md").read_text(), "the README names this wheel"
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    python = str(env / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]

    subprocess.run([*pip, str(wheel)], check=True)
    said = json.loads(ran(python, "-c", BARE, cwd=tmp_path))
    assert sorted(said) == sorted(EXTRAS)
    for extra, message in said.items():
        installs = re.findall(r"pip install ((?:\"[^\"]+\" ?)+)", message)
        assert installs[0] == f'".[{extra}]"', message  # from a clone: works today
        assert installs[1] == f'"dist/{wheel.name}[{extra}]"', message  # the wheel dev.py builds
        assert installs[-1] == f'"idem-asgi[{extra}]"' and "Once idem-asgi is on the package index" in message
    # Each way the messages print works in this fresh venv: the wheel form (postgres), the driver
    # alone (prometheus) and, from the clone, the source form (client); the published one cannot yet.
    for extra, form, cwd in (("postgres", 1, ROOT), ("prometheus", 2, tmp_path), ("client", 0, ROOT)):
        line = re.findall(r"pip install ((?:\"[^\"]+\" ?)+)", said[extra])[form]
        subprocess.run([*pip, *shlex.split(line)], check=True, cwd=cwd)
    ran(python, "-c", "import asyncpg, prometheus_client, httpx", cwd=tmp_path)
    assert "usage: idem-asgi" in ran(str(env / "bin" / "idem-asgi"), "--help", cwd=tmp_path)

    subprocess.run([*pip, f"{wheel}[{','.join(EXTRAS)}]"], check=True)
    assert ran(python, "-c", WITH_EXTRAS, cwd=tmp_path) == "extras ok\n"
    # Installed from the wheel, not from this checkout.
    where = ran(python, "-c", "import idem_asgi; print(idem_asgi.__file__)", cwd=tmp_path)
    assert where.startswith(str(env)), where
