"""The overhead benchmark (what `python3 dev.py bench` reports targets from) runs and says met/MISSED.

A tiny run of the real harness: uvicorn servers for the bare app, ours on the memory store and the
capture floor, load from the benchmark's own client, the route doing one Redis GET of its own.
It checks the report's shape and that every protected request was answered, not the numbers
(those belong to `benchmarks/`, on a quiet machine).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.servers import REDIS_URL, require

ROOT = Path(__file__).resolve().parent.parent


def test_the_overhead_benchmark_reports_each_target_beside_the_floor() -> None:
    require("redis", REDIS_URL)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_overhead",
            "--backends",
            "memory,floor",
            "--cases",
            "new-key,replay",
            "--rounds",
            "1",
            "--duration",
            "0.3",
            "--warmup",
            "0.1",
            "--latency-samples",
            "0",
            "--route-io",
            "redis",
            "--redis-url",
            REDIS_URL,
            "--server-cpus",
            "",
            "--client-cpus",
            "",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "# the benchmarked route does one redis GET itself" in out
    targets = [line for line in out.splitlines() if line.startswith("target")]
    tagged = "target [route does one redis GET] memory"
    for what in ("new-key ours/bare req/s", "replay ours/bare req/s", "new-key ours/floor"):
        assert any(line.startswith(f"{tagged} {what}") for line in targets), (what, targets)
    assert all(re.search(r"\) (met|MISSED)$", line) for line in targets), targets
    assert re.search(r"^floors \(new-key, ratio to bare, same run\): capture floor \d", out, re.M), out
    # Every request of every side got its 200: the last column of the summary rows is non-200 answers.
    rows = [line.split() for line in out.splitlines() if re.match(r"(memory|floor)\s+(new-key|replay)\s+\d", line)]
    assert len(rows) == 4 and all(row[-1] == "0" for row in rows), rows
