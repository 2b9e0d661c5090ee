#!/usr/bin/env python3
"""Set up a local virtualenv and run a job in it: `python3 dev.py demo|test|bench|soak|wheel|docs`.

Needs nothing but Python 3.11+: it creates `.venv`, installs the package with its `dev`
extra (again only when pyproject.toml changed), then runs the job inside it. `docs` installs the
`docs` extra instead and builds the site with `mkdocs build --strict` into `site/`; `docs --serve`
serves it on 127.0.0.1:8000 (further arguments go to mkdocs, e.g. `-a 127.0.0.1:9000`). `soak` is
`python -m tools.soak` (the retry storms with 20 seeds, time-capped; `python3 dev.py soak --help`).
`wheel` builds `dist/idem_asgi-<version>-py3-none-any.whl` (it needs only `.venv`'s pip, not the
dev install) and prints its path.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"


def setup(extra: str = "dev") -> None:
    """Create .venv and install `.[extra]` unless pyproject.toml is unchanged since its last install."""
    if not PY.exists():
        print("dev.py: creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / (".idem-installed" if extra == "dev" else f".idem-installed-{extra}")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    print(f"dev.py: installing idem-asgi[{extra}] into .venv", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[{extra}]"], check=True)
    stamp.write_text(digest)


def wheel() -> int:
    """Build the wheel into dist/ with pip (hatchling is fetched into pip's build environment)."""
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    dist = ROOT / "dist"
    before = set(dist.glob("*.whl"))
    pip = [str(PY), "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "--no-deps", "-w", str(dist)]
    if (code := subprocess.run([*pip, str(ROOT)], cwd=ROOT).returncode) != 0:
        return code
    built = sorted(set(dist.glob("*.whl")) - before) or sorted(dist.glob("idem_asgi-*.whl"), key=os.path.getmtime)[-1:]
    print(built[-1])
    return 0


def run(*args: str) -> int:
    return subprocess.run([str(PY), *args], cwd=ROOT).returncode


def docs(rest: list[str]) -> int:
    """Build the site strict into site/ (broken links, anchors or references fail), or serve it."""
    setup("docs")
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # Material's banner about its successor
    if "--serve" in rest:
        rest = [a for a in rest if a != "--serve"]
        return run("-m", "mkdocs", "serve", "--strict", "-a", "127.0.0.1:8000", *rest)
    return run("-m", "mkdocs", "build", "--strict", "--site-dir", str(ROOT / "site"), *rest)


def main(argv: list[str]) -> int:
    job = argv[0] if argv else "test"
    rest = argv[1:]
    if job == "wheel":
        return wheel()
    if job == "docs":
        return docs(rest)
    setup()
    if job == "demo":
        return run("-m", "examples.storm_demo", *rest)
    if job == "test":
        for step in (["-m", "ruff", "check", "."], ["-m", "ruff", "format", "--check", "."], ["-m", "mypy"]):
            print("dev.py:", " ".join(step[1:]), flush=True)
            if (code := run(*step)) != 0:
                return code
        return run("-m", "pytest", "--durations=15", *rest)  # the 15 slowest tests, at the end
    if job == "bench":
        setup("bench")  # uvloop and httptools (the servers production runs), matplotlib (the chart)
        return run("-m", "benchmarks.run_all", *rest)
    if job == "soak":
        return run("-m", "tools.soak", *rest)
    print(f"usage: python3 dev.py demo|test|bench|soak|wheel|docs [args...]; unknown job {job!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
