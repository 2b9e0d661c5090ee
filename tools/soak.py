"""The soak: the retry storms again and again, one seed per run, within a time cap (on demand, not in CI).

    python3 dev.py soak                    # 20 random seeds, stops after 40 minutes at the latest
    python -m tools.soak --minutes 10 --seeds 5
    python -m tools.soak --seed 7 --seed 8 -- -k "memory or redis"   # pinned seeds, pytest args after --
    python -m tools.soak --summarize .soak/<run>/scorecards.jsonl  # the summary of any scorecard file

Each seed runs `python -m pytest tests/test_reliability_storms.py` once with `IDEM_STORM_SEED=<seed>`
(the seed sets the random order of the storms) and `IDEM_SCORECARD_FILE` pointing at one JSONL file
for the whole soak, so every scorecard of every run lands there; each run's pytest output goes to
`seed-<seed>.log` next to it (default directory `.soak/<UTC time>/`, which ignores itself in git).

The cap is a total time: when it is reached the running pytest gets SIGINT (its tests stop their
servers and clean up, as on Ctrl-C), the seeds not started are reported as such, and the summary
covers every scorecard written so far. Ctrl-C does the same.

The summary has one row per storm and backend: runs, requests, executions, 409s, replays, the
sums of the zero-tolerance fields (double_executions, replay_mismatches, unaccounted_keys), 5xx and
the slowest wall_s. Exit status: 0 when every zero-tolerance sum is 0 and no finished run failed; 1
otherwise; 2 when there is no scorecard at all.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.scorecard import ZERO_TOLERANCE

ROOT = Path(__file__).resolve().parent.parent
STORMS = "tests/test_reliability_storms.py"
DEFAULT_SEEDS = 20
DEFAULT_MINUTES = 40.0
GRACE_S = 60.0  # after SIGINT, how long a cut run may take to stop its servers and clean up
SUMMED = ("requests", "executions", "409", "replays", *ZERO_TOLERANCE, "5xx")


@dataclass
class SeedRun:
    seed: int
    status: str = "not started"  # passed | failed (exit N) | cut at the cap | interrupted | not started
    seconds: float = 0.0
    outcome: str = ""  # pytest's last line
    log: Path | None = None


@dataclass
class Soak:
    seeds: list[int]
    out: Path
    deadline: float
    pytest_args: list[str] = field(default_factory=list)
    runs: list[SeedRun] = field(default_factory=list)

    def run_all(self) -> None:
        self.runs = [SeedRun(s) for s in self.seeds]
        for i, run in enumerate(self.runs, 1):
            if time.monotonic() >= self.deadline:
                break
            print(f"soak: seed {run.seed} ({i}/{len(self.runs)}) ...", flush=True)
            try:
                self.run_one(run)
            except KeyboardInterrupt:
                run.status = "interrupted"
                print(f"soak: seed {run.seed} interrupted (Ctrl-C)", flush=True)
                break
            print(f"soak: seed {run.seed}: {run.status}, {run.outcome} ({run.seconds:.0f} s)", flush=True)
            if run.status.startswith("cut"):
                break

    def run_one(self, run: SeedRun) -> None:
        run.log = self.out.parent / f"seed-{run.seed}.log"
        env = {**os.environ, "IDEM_STORM_SEED": str(run.seed), "IDEM_SCORECARD_FILE": str(self.out)}
        cmd = [sys.executable, "-m", "pytest", STORMS, "-q", "-p", "no:cacheprovider", *self.pytest_args]
        started = time.monotonic()
        with run.log.open("w") as log:
            # Its own session, so a Ctrl-C reaches it once, from us; SIGINT at its default even if
            # we were started with it ignored (`cmd &` in a script), else pytest could not be stopped.
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
            try:
                code = proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
                run.status = "passed" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                run.status = "cut at the cap"
                stop(proc)
            except KeyboardInterrupt:
                stop(proc)
                raise
            finally:
                run.seconds = time.monotonic() - started
                run.outcome = last_line(run.log)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children(pid: int) -> list[int]:
    """The direct children of `pid`, from /proc/<n>/stat (Linux; empty elsewhere)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT: pytest stops as on Ctrl-C and the tests clean up (servers, records). After GRACE_S,
    SIGKILL its process group and the servers it started in their own sessions (uvicorn)."""
    if proc.poll() is None:
        print(f"soak: stopping pytest (SIGINT; SIGKILL in {GRACE_S:g} s)", flush=True)
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    servers = _children(proc.pid)
    for group in (proc.pid, *servers):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    proc.wait()
    print(f"soak: pytest killed; this run's records stay in the stores ({len(servers)} child groups killed)")


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip("= ") if lines else ""


# -- the summary ------------------------------------------------------------------------------------


def read_scorecards(paths: Iterable[Path]) -> list[dict[str, Any]]:
    cards = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                card = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed run
            if isinstance(card, dict) and "test" in card:
                cards.append(card)
    return cards


def summarize(cards: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(one row per (test, backend), the zero-tolerance sums over everything)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for card in cards:
        groups[(str(card["test"]), str(card.get("backend")))].append(card)
    rows = []
    for (test, backend), group in sorted(groups.items()):
        row: dict[str, Any] = {"test": test, "backend": backend, "runs": len(group)}
        for name in SUMMED:
            row[name] = sum(int(c.get(name) or 0) for c in group)
        row["seeds"] = len({c.get("seed") for c in group})
        row["max_wall_s"] = max(float(c.get("wall_s") or 0) for c in group)
        rows.append(row)
    totals = {name: sum(int(c.get(name) or 0) for c in cards) for name in (*ZERO_TOLERANCE, "5xx")}
    return rows, totals


def render(rows: Sequence[dict[str, Any]]) -> str:
    columns = ["test", "backend", "runs", *SUMMED, "max_wall_s"]
    table = [columns] + [[f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in table
    )


def report(cards: Sequence[dict[str, Any]], runs: Sequence[SeedRun] = ()) -> int:
    """Print the summary; the exit status (see the module docstring)."""
    if runs:
        print("\nsoak: runs")
        for run in runs:
            where = f" [{run.log}]" if run.log and run.status not in ("passed", "not started") else ""
            took = f", {run.seconds:.0f} s" if run.status != "not started" else ""
            print(f"  seed {run.seed}: {run.status}{took} {run.outcome}{where}".rstrip())
    if not cards:
        print("soak: no scorecard at all")
        return 2
    rows, totals = summarize(cards)
    print(f"\nsoak: {len(cards)} scorecards\n" + render(rows))
    failed = [r.seed for r in runs if r.status.startswith("failed")]
    bad = {name: n for name, n in totals.items() if n and name in ZERO_TOLERANCE}
    print(f"\nzero-tolerance sums: {', '.join(f'{k}={totals[k]}' for k in ZERO_TOLERANCE)}; 5xx={totals['5xx']}")
    if failed:
        print(f"failed runs (seeds): {failed}; rerun one with IDEM_STORM_SEED=<seed> python -m pytest {STORMS}")
    if bad or failed:
        print("soak: FAILED")
        return 1
    print("soak: OK (every zero-tolerance sum is 0, no run failed)")
    return 0


# -- command line -----------------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m tools.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="how many random seeds (default 20)")
    parser.add_argument("--seed", type=int, action="append", default=[], help="run this seed (repeatable)")
    parser.add_argument(
        "--minutes", type=float, default=DEFAULT_MINUTES, help=f"total time cap (default {DEFAULT_MINUTES:g})"
    )
    parser.add_argument("--out", type=Path, help="the scorecard JSONL (default .soak/<UTC time>/scorecards.jsonl)")
    parser.add_argument("--summarize", type=Path, nargs="+", metavar="JSONL", help="only summarize these files")
    return parser.parse_args(argv), extra


def main(argv: Sequence[str]) -> int:
    args, extra = parse(argv)
    if args.summarize:
        return report(read_scorecards(args.summarize))
    seeds = args.seed or [random.SystemRandom().randrange(1, 2**31) for _ in range(args.seeds)]
    out: Path = (
        args.out or ROOT / ".soak" / datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ") / "scorecards.jsonl"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    soak = Soak(seeds, out, time.monotonic() + args.minutes * 60, extra)
    print(f"soak: {len(seeds)} seeds: {' '.join(map(str, seeds))}")
    print(f"soak: cap {args.minutes:g} min; scorecards -> {out}", flush=True)
    soak.run_all()
    return report(read_scorecards([out]), soak.runs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
