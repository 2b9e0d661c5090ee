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

import pytest

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


def test_the_history_benchmark_writes_the_figures_the_pages_show(tmp_path: Path) -> None:
    """A tiny run of `benchmarks.bench_history` on the memory store: its summary row has every field
    `benchmarks/figures.py` renders, and no history step was lost (not the numbers: those belong to a
    quiet machine)."""
    import json

    from benchmarks import figures

    summary = tmp_path / "history.jsonl"
    args = ["--stores", "memory", "--keys", "100", "--rounds", "1", "--summary", str(summary)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_history", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "memory: history=16 over history=0, same run" in done.stdout
    (row,) = [json.loads(line) for line in summary.read_text().splitlines()]
    assert row["store"] == "memory" and row["lost"] == 0 and row["floor_new_key_cpu_us"] > 0
    text = "\n".join(figures._history({"history": [{k: v for k, v in row.items() if k != "kind"}]}))
    assert "| memory | x" in text


@pytest.mark.parametrize("store", ["memory", "redis", "postgres"])
def test_the_horizons_benchmark_measures_a_tombstone_smaller_than_its_answer(tmp_path: Path, store: str) -> None:
    """A tiny run of `benchmarks.bench_horizons` per store: it finds every record shrunk (it asserts
    so itself on Redis) and a tombstone smaller than the answer it replaced; its row renders."""
    import json

    from benchmarks import figures

    if store != "memory":
        from tests.support.servers import POSTGRES_DSN

        require(store, REDIS_URL if store == "redis" else POSTGRES_DSN)
    summary = tmp_path / "horizons.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_horizons",
            "--stores",
            store,
            "--keys",
            "50",
            "--summary",
            str(summary),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [json.loads(line) for line in summary.read_text().splitlines()]
    assert row["store"] == store and 0 < row["tombstone_bytes"] < row["full_bytes"] / 1.5, row
    assert row["gb_two_horizons"] < row["gb_one_horizon"]
    assert f"| {figures.NAMES[store]} | " in "\n".join(figures._horizons({"horizons": [row]}))


def test_the_large_table_benchmark_measures_claims_during_its_purge(tmp_path: Path) -> None:
    """A tiny run of `benchmarks.bench_postgres_table`: the purge deletes the expired 1 %, claims were
    timed while it ran, and the summary row renders into docs/postgres.md's block."""
    import json

    from benchmarks import figures
    from tests.support.servers import POSTGRES_DSN

    require("postgres", POSTGRES_DSN)
    summary = tmp_path / "postgres-table.jsonl"
    args = ["--rows", "20000", "--samples", "100", "--summary", str(summary)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_postgres_table", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [json.loads(line) for line in summary.read_text().splitlines()]
    assert row["purge"]["rows"] == 200, "1 % of the rows were expired"
    assert row["latency"]["during_purge"]["new"]["n"] >= 10
    text = "\n".join(figures._postgres_table({"postgres_table": [row]}))
    assert "| 20,000 | " in text and "200 rows in" in text


def test_the_outbox_benchmark_times_the_write_and_both_relays(tmp_path: Path) -> None:
    """A tiny run of `benchmarks.bench_outbox`: a write row and a relay row per broker, each relay
    having published every message (it waits for them), rendered into docs/outbox.md's block."""
    import json

    from benchmarks import figures
    from tests.support.servers import POSTGRES_DSN

    require("postgres", POSTGRES_DSN)
    require("nats", "nats://127.0.0.1:4222")
    require("rabbitmq", "amqp://guest:guest@127.0.0.1:5672/")
    summary = tmp_path / "outbox.jsonl"
    args = ["--n", "100", "--messages", "200", "--keys", "10", "--rounds", "1", "--summary", str(summary)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_outbox", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [json.loads(line) for line in summary.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["write", "relay", "relay"]
    assert rows[0]["floor_us"] > 0 and rows[0]["outbox_us"] > 0
    assert {r["broker"] for r in rows[1:]} == {"nats", "rabbitmq"} and all(r["relay_msg_s"] > 0 for r in rows[1:])
    text = "\n".join(figures._outbox({"outbox": rows}))
    assert "| ledger `INSERT` only (the floor) |" in text and "| nats | 200 (10) |" in text
