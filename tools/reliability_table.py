"""Build the Reliability table (docs/reliability.md) from the scorecards of a real run.

    IDEM_SCORECARD_FILE=out.jsonl python -m pytest tests/...   # every suite appends its lines
    python -m tools.reliability_table out.jsonl                 # print the table
    python -m tools.reliability_table out.jsonl --readme docs/reliability.md   # replace it between the markers

Each row gathers the scorecards whose `test` matches its pattern, over every backend. A row whose
suite did not run says so ("not in this run") instead of keeping stale figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START = "<!-- reliability-table:start -->"
END = "<!-- reliability-table:end -->"

Line = dict[str, Any]


def _n(x: float) -> str:
    return f"{x:,.0f}"


def _sum(lines: Sequence[Line], field: str) -> int:
    return sum(int(line.get(field) or 0) for line in lines)


def _backends(lines: Sequence[Line]) -> str:
    seen: list[str] = []
    for line in lines:
        if line["backend"] not in seen:
            seen.append(line["backend"])
    return ", ".join(seen)


def storm_cases(lines: Sequence[Line]) -> str:
    return f"{_backends(lines)} ({_n(_sum(lines, 'requests'))} requests, {_n(_sum(lines, 'keys'))} keys)"


def storm_observed(lines: Sequence[Line]) -> str:
    parts = [f"{_n(_sum(lines, 'executions'))} executions"]
    for field, label in (("409", "x 409"), ("replays", "identical replays"), ("422", "x 422"), ("503", "x 503")):
        if _sum(lines, field) or field in ("409", "replays"):
            parts.append(f"{_n(_sum(lines, field))} {label}")
    other = _sum(lines, "5xx") - _sum(lines, "503")
    parts.append(f"{other} other 5xx")
    unknown = _sum(lines, "lost_completions")
    if unknown:
        parts.append(f"{unknown} ran but answer `outcome-unknown` (for reconcile)")
    faults: dict[str, int] = {}
    for line in lines:
        for kind, count in (line.get("faults") or {}).items():
            faults[kind] = faults.get(kind, 0) + int(count)
    if faults:
        parts.append("faults " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    return "; ".join(parts)


def property_cases(lines: Sequence[Line]) -> str:
    return f"{_backends(lines)} ({_n(_sum(lines, 'examples'))} hypothesis examples)"


def property_observed(lines: Sequence[Line]) -> str:
    counts: dict[str, int] = {}
    for line in lines:
        for k, v in line.items():
            if k not in ("test", "backend", "examples", "5xx") and isinstance(v, int):
                counts[k] = counts.get(k, 0) + v
    return ", ".join(f"{k} {_n(v)}" for k, v in counts.items()) + f"; {_sum(lines, '5xx')} x 5xx"


def model_cases(lines: Sequence[Line]) -> str:
    steps = sum(sum(line["steps"].values()) for line in lines)
    return f"{_backends(lines)} ({_n(_sum(lines, 'examples'))} runs, {_n(steps)} steps)"


def model_observed(lines: Sequence[Line]) -> str:
    seen: dict[str, int] = {}
    for line in lines:
        for k, v in line["seen"].items():
            seen[k] = seen.get(k, 0) + v
    keys = ("requests", "executions", "replays", "409_in_progress", "409_outcome_unknown", "422", "reclaims")
    parts = [f"{k.replace('_', ' ')} {_n(seen.get(k, 0))}" for k in keys]
    parts.append(f"stale owners fenced off {_n(seen.get('stale_owner_fenced', 0))}")
    parts.append(f"cross-scope leaks {_sum(lines, 'cross_scope_leaks')}")
    return ", ".join(parts)


def scopes_observed(lines: Sequence[Line]) -> str:
    return f"{_n(_sum(lines, 'pairs'))} key pairs; cross-scope leaks {_sum(lines, 'cross_scope_leaks')}"


def flood_observed(lines: Sequence[Line]) -> str:
    line = lines[0]
    return (
        f"{_n(sum(line['statuses'].values()))} x 201; entries stayed {max(line['entries_every_10k']):,}; "
        f"RSS +{line['rss_after_flood_mib'] - line['rss_full_mib']:.1f} MiB after the store was full"
    )


def body_observed(lines: Sequence[Line]) -> str:
    """Each mode's answer; RSS as the bound the test asserts (its exact growth is noise)."""
    modes = "; ".join(
        f"{line['mode']}: {line['status']}, {line['chunks_read']} chunks read, {len(line['store_calls'])} store calls"
        for line in lines
    )
    most = max(line["rss_growth"] for line in lines) / 2**20
    rss = (
        "RSS grew less than the asserted 6 MiB (twice the 1 MiB limit + 4 MiB of slack)"
        if most < 6
        else f"RSS grew up to {most:.1f} MiB"
    )
    return f"{modes}; in every mode {rss}"


def stale_observed(lines: Sequence[Line]) -> str:
    def total(field: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in lines:
            for k, v in (line.get(field) or {}).items():
                out[k] = out.get(k, 0) + int(v)
        return out

    runs = total("executions_by_owner")
    refused = ", ".join(f"{k} {v}" for k, v in total("stale_writes_refused").items())
    return (
        f"{_n(_sum(lines, 'keys'))} keys, each run by the stalled A ({runs.get('stale_A', 0)}) and, by design "
        f"of `reclaim`, by B ({runs.get('taker_B', 0)}); A's writes refused: {refused}; stored answer is B's "
        f"on {_sum(lines, 'stored_answer_is_takers')} keys; {_n(_sum(lines, 'replays'))} replays, "
        f"{_sum(lines, 'replay_mismatches')} mismatches, {_sum(lines, '5xx')} x 5xx"
    )


def zero(_: Sequence[Line]) -> str:
    """For suites that assert every run count and every record themselves: reached only if 0."""
    return "0"


def dash(_: Sequence[Line]) -> str:
    return "-"


@dataclass(frozen=True)
class Row:
    label: str
    pattern: str
    expected: str
    rerun: str
    cases: Callable[[Sequence[Line]], str] = storm_cases
    observed: Callable[[Sequence[Line]], str] = storm_observed
    lost: Callable[[Sequence[Line]], str] = lambda lines: str(_sum(lines, "unaccounted_keys"))
    doubled: Callable[[Sequence[Line]], str] = lambda lines: str(_sum(lines, "double_executions"))


STORMS = "tests/test_reliability_storms.py"
SAME = "1 execution per key; duplicates 409 or identical replays; no 5xx"
ROWS = [
    Row("1 key x 1,000 concurrent, in-process", r"storm_1key_x\d+_inprocess", SAME, STORMS),
    Row("1,000 keys x 50 duplicates, seeded order, <= 500 in flight", r"storm_\d+keys_x\d+_inprocess", SAME, STORMS),
    Row("`uvicorn --workers 4`, 200 keys x 25 over loopback", r"storm_\d+keys_x\d+_uvicorn_\d+workers", SAME, STORMS),
    Row(
        "worker SIGKILLed before the claim",
        r"crash_before_claim",
        "the retry runs it, once",
        "tests/test_crash_matrix.py",
    ),
    Row(
        "SIGKILL after the claim",
        r"crash_after_claim",
        "409 `outcome-unknown`, nothing ran",
        "tests/test_crash_matrix.py",
    ),
    Row(
        "SIGKILL mid-handler, after the handler before the store write, mid-send",
        r"crash_(mid_handler|before_store|mid_send)",
        "409 `outcome-unknown`, ran once (reconcile resolves it)",
        "tests/test_crash_matrix.py",
    ),
    Row(
        "SIGKILL after the store write (before or after the first send)",
        r"crash_(after_store|before_first_send)",
        "replays",
        "tests/test_crash_matrix.py",
    ),
    Row(
        "reply to the claim lost (silently, reset, request lost)",
        r"lost_ack_claim_",
        "503, app not run; the key stays retryable; then one run",
        "tests/test_lost_acks.py",
    ),
    Row(
        "reply to the completion lost (silently, reset once or twice)",
        r"lost_ack_complete_reply_",
        "the client gets its 201; retries replay",
        "tests/test_lost_acks.py",
    ),
    Row(
        "completion never reached the store (request lost twice, rolled back twice)",
        r"lost_ack_complete_(request_lost|rolled_back)",
        "client gets its 201; written again in the background; retries replay",
        "tests/test_lost_acks.py",
    ),
    Row(
        "store blackholed ~1 s; 100 ms delay on every reply",
        r"lost_ack_(blackhole|delay)",
        "503 within the timeout, then one run; normal",
        "tests/test_lost_acks.py",
    ),
    Row(
        "every store connection reset 5x during a 50 x 5 storm",
        r"lost_ack_storm_with_connection_resets",
        "no double runs, every key accounted for",
        "tests/test_lost_acks.py",
    ),
    Row(
        "Redis SIGSTOP / SIGKILL + restart / `CLIENT PAUSE` / `DEBUG SLEEP` mid-storm (50 x 5)",
        r"storm_fault_redis_",
        "2xx, 409 or 503 + `Retry-After` within the timeout; never another 5xx; recovers by itself",
        "tests/test_storm_faults.py",
    ),
    Row(
        "Postgres `pg_terminate_backend` / `pg_ctl restart -m immediate` mid-storm",
        r"storm_fault_postgres_",
        "same",
        "tests/test_postgres_faults.py",
    ),
    Row(
        "stale owner: worker SIGSTOPped past its lease under `reclaim`, then resumed",
        r"stale_owner_reclaim",
        "B takes over; A's extend and completion refused by the token; replays are B's answer",
        "tests/test_stale_owner.py",
        storm_cases,
        stale_observed,
    ),
    Row(
        "Idempotency-Key values: empty, 256+, control, non-ASCII, quoted, two lines, injection-shaped",
        r"bad_input_keys",
        "400 `key-malformed` and no store call, or one run then replays; never 5xx",
        "tests/test_bad_input.py",
        property_cases,
        property_observed,
        zero,
        zero,
    ),
    Row(
        "bodies: empty, odd chunking, over the limit, lying or invalid Content-Length, disconnects",
        r"bad_input_bodies",
        "413 before any store call, or the actual bytes fingerprinted; never 5xx",
        "tests/test_bad_input.py",
        property_cases,
        property_observed,
        zero,
        zero,
    ),
    Row(
        "methods and paths: lowercase, unknown, percent-encoded, unicode, `..`, long",
        r"bad_input_methods_paths",
        "protected ones per the contract, the rest untouched; never 5xx",
        "tests/test_bad_input.py",
        property_cases,
        property_observed,
        zero,
        zero,
    ),
    Row(
        "stateful model: send, retry, burst, finish, crash, clock, stall, restart store",
        r"^model$",
        "<= 1 execution per (scope, key, epoch); replay == first answer; mismatch 422; no cross-scope bytes",
        "tests/test_model.py",
        model_cases,
        model_observed,
        zero,
        lambda lines: str(_sum(lines, "double_executions")),
    ),
    Row(
        "two scopes, one key (property)",
        r"two_scopes_one_key",
        "neither sees the other's record or bytes",
        "tests/test_isolation_bounds.py",
        lambda lines: f"{_backends(lines)} ({_n(_sum(lines, 'pairs'))} pairs)",
        scopes_observed,
        zero,
        zero,
    ),
    Row(
        "flood of 100,000 keys into a memory store bounded at 10,000",
        r"flood_100k_keys",
        "never past the bound; running claims never evicted",
        "tests/test_isolation_bounds.py",
        lambda lines: "memory (100,000 requests)",
        flood_observed,
        dash,
        dash,
    ),
    Row(
        "100 MiB body, 1 MiB limit (honest, chunked, lying Content-Length)",
        r"body_100mib_",
        "413 before any claim, bounded RSS",
        "tests/test_isolation_bounds.py",
        lambda lines: f"memory ({len(lines)} modes)",
        body_observed,
        dash,
        dash,
    ),
]


def read(paths: Iterable[Path]) -> list[Line]:
    lines: list[Line] = []
    for path in paths:
        for text in path.read_text(encoding="utf-8").splitlines():
            if text.strip():
                lines.append(json.loads(text))
    return lines


def table(lines: Sequence[Line]) -> str:
    out = [
        "| fault or input class | cases tried | expected | observed "
        "| duplicated executions | lost completions | rerun |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        matched = [line for line in lines if re.search(row.pattern, line.get("test", ""))]
        if not matched:
            out.append(f"| {row.label} | not in this run | {row.expected} | - | - | - | `{row.rerun}` |")
            continue
        cells = [row.cases(matched), row.expected, row.observed(matched), row.doubled(matched), row.lost(matched)]
        out.append(f"| {row.label} | " + " | ".join(cells) + f" | `{row.rerun}` |")
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="scorecard JSONL files")
    parser.add_argument("--readme", type=Path, help="replace the table between the markers in this file")
    parser.add_argument("--note", default="", help="what ran, on what machine (printed above the table)")
    args = parser.parse_args(argv)
    lines = read(args.files)
    stamp = datetime.date.today().isoformat()
    text = f"Figures from a run on {stamp}{' (' + args.note + ')' if args.note else ''}:\n\n{table(lines)}"
    if args.readme is None:
        print(text)
        return 0
    readme = args.readme.read_text(encoding="utf-8")
    start, end = readme.index(START) + len(START), readme.index(END)
    args.readme.write_text(readme[:start] + "\n" + text + "\n" + readme[end:], encoding="utf-8")
    print(f"{args.readme}: table replaced ({len(lines)} scorecards)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
