"""One command for every benchmark: `python -m benchmarks.run_all` (a few minutes, local Redis and Postgres).

Runs round trips, overhead (quick; again with a route that does one Redis GET itself), the scale
curve, retry storms with the strawman (quick), held repeats (`wait=2`) against 409 at 2 workers,
10,000 repeats held in one process, durable claims, bytes per request and record, the cost of a
NATS consumer adapter per message, fingerprint rules per MiB, the large Postgres table (100,000
rows unless `--rows`), the Redis clients' CPU and system calls per call, and (with valgrind) the
instructions per request of the middleware and the floors, prints every target met/MISSED, writes
every table to `benchmarks/out/report.md` and draws the scale curve to `docs/benchmarks.png`
(matplotlib, the `bench` extra). Each benchmark also runs alone; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks import figures

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "out"
CHART = ROOT / "docs" / "benchmarks.png"


def run(title: str, args: list[str]) -> str:
    print(f"== {title}: python -m {' '.join(args)}", flush=True)
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    failed = f"\n(exit {done.returncode}: {done.stderr.strip()[-500:]})" if done.returncode else ""
    text = done.stdout.strip() + failed
    print(text, flush=True)
    return f"## {title}\n\n`python -m {' '.join(args)}`\n\n{text}\n"


def chart(rows: list[dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    by_c = [r for r in rows if r["body_bytes"] == 1024]
    left.plot([r["concurrency"] for r in by_c], [r["bare_rps"] for r in by_c], "o-", label="bare FastAPI")
    left.plot([r["concurrency"] for r in by_c], [r["ours_rps"] for r in by_c], "o-", label="with idem_asgi (memory)")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrency (1 KiB bodies, new key per request)")
    left.set_ylabel("requests/s")
    left.legend()
    by_b = [r for r in rows if r["concurrency"] == 8]
    sizes = [r["body_bytes"] / 1024 for r in by_b]
    right.plot(sizes, [r["ratio"] for r in by_b], "o-")
    right.set_xscale("log", base=2)
    right.set_ylim(0, 1.1)
    right.set_xlabel("request body, KiB (concurrency 8)")
    right.set_ylabel("ours / bare requests/s")
    fig.suptitle(f"idem_asgi scale curve, {datetime.date.today()}, {platform.machine()}, 2-core VM")
    fig.tight_layout()
    CHART.parent.mkdir(exist_ok=True)
    fig.savefig(CHART, dpi=90)


CALLGRIND = ("--valgrind", "--backends", "memory,floor,forward", "--cases", "new-key,replay")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows for the large Postgres table")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.jsonl"):
        old.unlink()  # this run's results only
    started = datetime.datetime.now(datetime.UTC)
    sections = [
        run("Store round trips", ["benchmarks.bench_roundtrips"]),
        run("Overhead", ["benchmarks.bench_overhead", "--quick", "--summary", str(OUT / "overhead-noop.jsonl")]),
        run(
            "Overhead, the route doing one Redis GET of its own",
            [
                "benchmarks.bench_overhead",
                "--quick",
                "--route-io",
                "redis",
                "--backends",
                "memory,redis,postgres,floor,forward,naive",
                "--cases",
                "new-key,replay",
                "--latency-samples",
                "0",
                "--summary",
                str(OUT / "overhead-io.jsonl"),
            ],
        ),
        run("Retry storms vs strawman", ["benchmarks.bench_storm", "--quick"]),
        run(
            "Held repeats (wait=2) vs 409",
            [
                "benchmarks.bench_storm",
                "--backends",
                "redis,postgres",
                "--workers",
                "2",
                "--middlewares",
                "ours,ours-wait",
            ],
        ),
        run("Held repeats in one process (10,000 on one key)", ["benchmarks.bench_held", "--hold", "3"]),
        run("Durable claims", ["benchmarks.bench_durable", "--n", "300", "--blocks", "2"]),
        run(
            "Postgres group commit",
            ["benchmarks.bench_group_commit", "--rounds", "2", "--summary", str(OUT / "group-commit.jsonl")],
        ),
        run(
            "Each key's history: its cost per request",
            ["benchmarks.bench_history", "--summary", str(OUT / "history.jsonl")],
        ),
        run("Bytes per request and per record", ["benchmarks.bench_footprint"]),
        run(
            "Bytes per key before and after replay_ttl",
            ["benchmarks.bench_horizons", "--summary", str(OUT / "horizons.jsonl")],
        ),
        run("Message consumers (NATS JetStream)", ["benchmarks.bench_consumers"]),
        run("The outbox: its write and its relay", ["benchmarks.bench_outbox", "--summary", str(OUT / "outbox.jsonl")]),
        run(
            "Message consumers' throughput beside a bare consumer (target 0.80)",
            ["benchmarks.bench_consumer_rate", "--summary", str(OUT / "consumer-rate.jsonl")],
        ),
        run("Fingerprint rules per MiB", ["benchmarks.bench_fingerprint", "--sizes", "16384,1048576,4194304"]),
        run(
            "Large Postgres table",
            [
                "benchmarks.bench_postgres_table",
                "--rows",
                str(args.rows),
                "--summary",
                str(OUT / "postgres-table.jsonl"),
            ],
        ),
        run(
            "Redis clients: CPU and system calls per call",
            ["benchmarks.bench_redis_clients", "--calls", "5000", *(["--syscalls"] if shutil.which("strace") else [])],
        ),
    ]
    if shutil.which("valgrind"):  # deterministic: the instruction targets are read from here
        sections.append(
            run(
                "Instructions per request (callgrind)",
                [
                    "benchmarks.bench_overhead",
                    *CALLGRIND,
                    "--valgrind-requests",
                    "600",
                    "--summary",
                    str(OUT / "instructions.jsonl"),
                ],
            )
        )
    else:
        print("no instruction counts: apt-get install valgrind", flush=True)
    print("== Scale curve: python -m benchmarks.bench_scale --json", flush=True)
    scale = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--json", "--summary", str(OUT / "scale.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(line) for line in scale.stdout.splitlines() if line.startswith("{")]
    sections.append("## Scale curve\n\n```\n" + "\n".join(json.dumps(r) for r in rows) + "\n```\n")
    goals = [line for section in sections for line in section.splitlines() if line.startswith("target ")]
    for r in rows:
        if "target" in r:
            met = "met" if r["met"] else "MISSED"
            goals.append(f"target {r['target']}: {r['value']:.2f} (goal >= {r['goal']:.2f}) {met}")
    summary = "\n".join(goals)
    print(f"== Targets ({sum('MISSED' in g for g in goals)} of {len(goals)} missed)\n{summary}", flush=True)
    sections.insert(0, f"## Targets\n\n```\n{summary}\n```\n")
    curve = [r for r in rows if "concurrency" in r]
    if curve:
        try:
            chart(curve)
            print(f"chart: {CHART.relative_to(ROOT)}")
        except ImportError:
            print('no chart: pip install "idem-asgi[bench]" (matplotlib)')
    report = OUT / "report.md"
    report.write_text(
        f"# Benchmarks, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n" + "\n".join(sections)
    )
    print(f"report: {report.relative_to(ROOT)}")
    machine = f"{os.cpu_count()}-core {platform.machine()}, Python {platform.python_version()}"
    latest = figures.collect(OUT, f"{started:%Y-%m-%d %H:%M} UTC", machine)
    figures.LATEST.write_text(json.dumps(latest, indent=1) + "\n")
    print(f"figures: {figures.LATEST.relative_to(ROOT)}; rewrote {', '.join(figures.write(latest)) or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
