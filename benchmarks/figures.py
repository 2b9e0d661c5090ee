"""One source for the benchmark figures the pages quote: `benchmarks/latest.json`.

`python -m benchmarks.run_all` (`python3 dev.py bench`) writes `latest.json` from the results of the
run and then rewrites every block of README.md and docs/ that quotes them (between
`<!-- figures:NAME -->` and `<!-- /figures:NAME -->`, NAME one of BLOCKS), so a page never quotes a
figure another page or an older run contradicts. By hand:

    python -m benchmarks.figures            # rewrite the blocks from latest.json
    python -m benchmarks.figures --check    # exit 1 when a block differs from latest.json (a test runs it)
    python -m benchmarks.figures --merge scale out.jsonl  # one benchmark's figures, then the blocks
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LATEST = ROOT / "benchmarks" / "latest.json"
SECTIONS = {"group_commit": "group-commit.jsonl", "history": "history.jsonl", "scale": "scale.jsonl"}
SECTIONS["consumers"] = "consumer-rate.jsonl"
SECTIONS["horizons"] = "horizons.jsonl"
SECTIONS["postgres_table"] = "postgres-table.jsonl"
SECTIONS["outbox"] = "outbox.jsonl"
"""latest.json's sections written from one benchmark's `--summary` file each (`--merge NAME FILE`)."""
_MARK = re.compile(r"<!-- figures:([\w-]+) -->\n")

STORES = ("memory", "redis", "postgres", "floor", "naive", "forward")
NAMES = {
    "memory": "memory",
    "redis": "Redis",
    "postgres": "Postgres",
    "floor": "capture floor",
    "naive": "naive redis-py middleware",
    "forward": "forwarding only",
}
TARGETS = {"redis": 0.85, "postgres": 0.65}  # new key, ours/bare, on the route with I/O (memory: over the floor)
FLOOR_TARGET = 0.95  # memory's new key over the capture floor's
INSTRUCTIONS_TARGET = 55_000  # the middleware's own per new key, memory store
REPLAY_INSTRUCTIONS_TARGET = 40_000


def append(path: str, row: dict[str, Any]) -> None:
    """Add one result to a benchmark's summary file (JSON lines), which `collect` reads."""
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def collect(out: Path, run: str, machine: str) -> dict[str, Any]:
    """latest.json's content from the summary files `run_all` had the benchmarks write into `out`."""

    def ratios(name: str) -> dict[str, dict[str, float]]:
        by: dict[str, dict[str, float]] = {}
        for row in _lines(out / name):
            if row.get("kind") == "summary":
                by.setdefault(row["backend"], {})[row["case"]] = row["ratio"]
        return by

    instructions: dict[str, dict[str, int]] = {}
    for row in _lines(out / "instructions.jsonl"):
        if row.get("kind") == "valgrind":
            instructions.setdefault(row["server"], {})[row["case"]] = row["instructions"]
    return {
        "run": run,
        "machine": machine,
        "noop": ratios("overhead-noop.jsonl"),
        "io": ratios("overhead-io.jsonl"),
        "instructions": instructions,
        **{name: section(out / file) for name, file in SECTIONS.items()},
    }


def section(path: Path) -> list[dict[str, Any]]:
    """One benchmark's summary rows; a run row (when it wrote none, the file's time) comes first."""
    rows = _lines(path)
    if rows and not any(r.get("kind") == "run" for r in rows):
        rows.insert(0, {"kind": "run", "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(os.path.getmtime(path)))})
    return rows


def _rows(data: dict[str, Any], name: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in data.get(name) or [] if r.get("kind", kind) == kind]


def _f(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _ratio_rows(data: dict[str, Any]) -> list[str]:
    rows = []
    for route, label in (("noop", "no-op route"), ("io", "route doing one Redis `GET`")):
        for case, what in (("new-key", "new key"), ("replay", "replay")):
            cells = [_f(data[route].get(s, {}).get(case)) for s in STORES]
            rows.append(f"| {what}, {label} | " + " | ".join(cells) + " |")
    rows.append("| store round trips, new key / replay | 0 / 0 | 2 / 1 | 2 / 1 | | 2 / 2 | |")
    return rows


def _own(data: dict[str, Any], case: str) -> int | None:
    """The memory store's own instructions per request: over the bare app (a new key), over the
    capture floor's replay (a replay runs no app)."""
    counts = data["instructions"]
    ours, base = counts.get("memory", {}).get(case), counts.get("bare" if case == "new-key" else "floor", {}).get(case)
    return None if ours is None or base is None else ours - base


WHY: dict[str, str] = {
    "redis": "two script round trips through the event loop per new key on top of the middleware's own Python",
    "postgres": "the worker, Postgres and the load client share 2 cores, and each new key costs Postgres two "
    "statements and two commits of CPU; group commit cuts that only with many requests in flight",
    "floor": "a coroutine frame per step, the ASGI message dicts, two SHA-256, the memory store's bookkeeping",
    "instructions": "a coroutine frame per step (claim, run, capture, store), the message dicts, two SHA-256, the "
    "memory store's bookkeeping (~20k) and the lease table; the capture floor alone costs 33k",
    "replay": "the replay's store read and the answer's headers",
}


def _target(text: str, goal: float | str, ok: bool, why: str) -> str:
    """One target line: its figure, its goal, met, or MISSED with the reason."""
    return f"- {text} (target {goal}: met)" if ok else f"- {text} (target {goal}: MISSED, {WHY[why]})"


def _targets(data: dict[str, Any]) -> list[str]:
    io = data["io"]
    lines = []
    for store, goal in TARGETS.items():
        value = io.get(store, {}).get("new-key")
        if value is not None:
            text = f"{NAMES[store]} new key, route with I/O: **{value:.2f}** of bare"
            lines.append(_target(text, goal, value >= goal, store))
    floor = io.get("floor", {}).get("new-key")
    memory = io.get("memory", {}).get("new-key")
    if floor and memory is not None:
        over = memory / floor
        lines.append(
            _target(
                f"memory new key over the capture floor: **{over:.2f}**", FLOOR_TARGET, over >= FLOOR_TARGET, "floor"
            )
        )
    naive, redis = data["noop"].get("naive", {}).get("new-key"), data["noop"].get("redis", {}).get("new-key")
    if naive and redis is not None:
        lines.append(f"- Redis new key over the naive two-round-trip middleware, no-op route: **{redis / naive:.2f}**")
    own = _own(data, "new-key")
    if own is not None:
        text = f"the middleware's own instructions per new key (callgrind, memory store): **{own / 1000:.1f}k**"
        lines.append(_target(text, f"{INSTRUCTIONS_TARGET // 1000}k", own <= INSTRUCTIONS_TARGET, "instructions"))
    replay = _own(data, "replay")
    if replay is not None:
        text = f"per replay, over the capture floor's: **{replay / 1000:.1f}k**"
        goal = REPLAY_INSTRUCTIONS_TARGET
        lines.append(_target(text, f"{goal // 1000}k", replay <= goal, "replay"))
    return lines


def _group_commit(data: dict[str, Any]) -> list[str]:
    rows = _rows(data, "group_commit", "group-commit")
    if not rows:
        return []
    out = [
        "| Postgres group commit, in flight | keys/s, grouped over one-row | Postgres CPU per key, grouped over "
        "one-row | µs of Postgres CPU per key, grouped | rows per statement (median / max) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['inflight']} | x{r['keys_ratio']:.2f} | x{r['pg_cpu_ratio']:.2f} | {r['pg_us_per_key']:.0f} "
            f"| {r['batch_median']:.0f} / {r['batch_max']} |"
        )
    return out


def _history(data: dict[str, Any]) -> list[str]:
    rows = _rows(data, "history", "history")
    if not rows:
        return []
    out = [
        f"Each key's history (`history=16` over `history=0`, same run, {rows[0]['run']}, middleware called in "
        f"process, {rows[0]['inflight']} in flight; `python -m benchmarks.bench_history`):",
        "",
        "| store | CPU per new key, on over off | µs of CPU added per new key | floor: µs per new key, "
        "history off | µs added per replay | history writes per 100 new keys |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {NAMES.get(r['store'], r['store'])} | x{r['new_key_cpu_ratio']:.2f} | {r['new_key_us_added']:.1f} "
            f"| {r['floor_new_key_cpu_us']:.1f} | {r['replay_us_added']:.1f} | {r['writes_per_100_keys']:.1f} |"
        )
    return out


def _scale(data: dict[str, Any]) -> list[str]:
    points = _rows(data, "scale", "point")
    if not points:
        return ["No scale curve in `benchmarks/latest.json` yet: `python3 dev.py bench`."]
    run = _rows(data, "scale", "run")[0]
    pairs = f"{run['rounds']} bare/ours pairs" if "rounds" in run else "bare/ours pairs"
    rounds = f"the median of {pairs} per point"
    out = [
        f"Scale curve (`python -m benchmarks.bench_scale`, run {run['run']}, {points[0]['backend']} store, a route "
        f"that reads its body on both sides, a new key every request, {rounds}):",
        "",
        "| concurrency | body | bare requests/s | ours requests/s | ours over bare | p99 ms, bare / ours |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in points:
        out.append(
            f"| {r['concurrency']} | {_size(r['body_bytes'])} | {r['bare_rps']:,.0f} | {r['ours_rps']:,.0f} "
            f"| {r['ratio']:.2f} | {r['bare_p99_ms']:.1f} / {r['ours_p99_ms']:.1f} |"
        )
    out.append("")
    for t in _rows(data, "scale", "target"):
        out.append(f"- {t['target']}: **{t['value']:.2f}** (target {t['goal']:.1f}: {_met(t['met'])})")
    memory = _rows(data, "scale", "memory")
    if memory:
        per = ", ".join(
            f"{m['bytes_per_request'] / 1024:.1f} KiB with {_size(m['in_flight_body_bytes'])} bodies" for m in memory
        )
        out.append(f"- the middleware's memory per request held in flight, besides its body: {per}")
    return out


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _consumers(data: dict[str, Any]) -> list[str]:
    rows = _rows(data, "consumers", "consumer-rate")
    if not rows:
        return ["No consumer throughput in `benchmarks/latest.json` yet: `python3 dev.py bench`."]
    r0 = rows[0]
    out = [
        f"Message consumers' throughput (`python -m benchmarks.bench_consumer_rate`, run {r0['run']}, {r0['n']:,} "
        f"messages per round, {r0['procs']} consumer processes, prefetch / fetch batch {r0['window']}, a no-op "
        f"handler on the local Redis, bare and ours in {r0['rounds']} alternating rounds):",
        "",
        "| broker | bare msg/s | ours msg/s | ours over bare (min-max) | consumers' CPU µs per message, bare → ours "
        "| broker's, bare → ours | Redis server's, ours | target |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    names = {"rabbitmq": "RabbitMQ", "nats": "NATS JetStream"}
    for r in rows:
        out.append(
            f"| {names.get(r['broker'], r['broker'])} | {r['bare_msg_per_s']:,.0f} | {r['ours_msg_per_s']:,.0f} "
            f"| **{r['ratio']:.2f}** ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"| {_us(r['bare_cpu_us_per_msg'])} → {_us(r['ours_cpu_us_per_msg'])} "
            f"| {_us(r['bare_broker_cpu_us_per_msg'])} → {_us(r['ours_broker_cpu_us_per_msg'])} "
            f"| {_us(r['ours_redis_cpu_us_per_msg'])} | {r['target']:.2f}: {_met(r['met'])} |"
        )
    return out


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _horizons(data: dict[str, Any]) -> list[str]:
    rows = _rows(data, "horizons", "horizon")
    if not rows:
        return ["No horizon figures in `benchmarks/latest.json` yet: `python3 dev.py bench`."]
    r0 = rows[0]
    out = [
        f"Bytes per key before and after the answer's horizon (`python -m benchmarks.bench_horizons`, run "
        f"{r0['run']}, {r0['keys']:,} payment answers of a {r0['body']}-byte JSON body with `Content-Type`, "
        "`Location` and a request id), and what a 30-day key window holds at 1,000,000 new keys a day:",
        "",
        "| store | bytes per key, answer kept | bytes per key, tombstone | 30 days, `ttl` only | 30 days, "
        "`replay_ttl=24h` |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {NAMES.get(r['store'], r['store'])} | {r['full_bytes']:,} | {r['tombstone_bytes']:,} "
            f"| {r['gb_one_horizon']:.1f} GB | {r['gb_two_horizons']:.1f} GB |"
        )
    return out


def _postgres_table(data: dict[str, Any]) -> list[str]:
    rows = _rows(data, "postgres_table", "table")
    if not rows:
        return ["No large-table figures in `benchmarks/latest.json` yet: `python3 dev.py bench`."]
    out = [
        "A 30-day table against an empty one (`python -m benchmarks.bench_postgres_table --rows N`, completed "
        "records with expiry spread over 30 days, 1 % expired, `VACUUM ANALYZE`d; one operation at a time, "
        f"alternating between the tables; run {rows[-1]['run']}), µs:",
        "",
        "| rows | table + indexes | new key p50 / p99, large | empty | replay p50 / p99, large | empty "
        "| purge of the expired 1 % | new key p50 / p99 during the purge | replay, during |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r["rows"]):
        lat, during = r["latency"], r["latency"].get("during_purge", {})

        def pair(op: dict[str, Any] | None) -> str:
            return "-" if not op else f"{op['p50_us']:,.0f} / {op['p99_us']:,.0f}"

        out.append(
            f"| {r['rows']:,} | {r['table_mb'] + r['indexes_mb']:,.0f} MB | {pair(lat['large']['new'])} "
            f"| {pair(lat['empty']['new'])} | {pair(lat['large']['replay'])} | {pair(lat['empty']['replay'])} "
            f"| {r['purge']['rows']:,} rows in {r['purge']['seconds']:.1f} s | {pair(during.get('new'))} "
            f"| {pair(during.get('replay'))} |"
        )
    return out


def _outbox(data: dict[str, Any]) -> list[str]:
    writes, relays = _rows(data, "outbox", "write"), _rows(data, "outbox", "relay")
    if not writes and not relays:
        return ["No outbox figures in `benchmarks/latest.json` yet: `python3 dev.py bench`."]
    out = [
        f"Measured by `python -m benchmarks.bench_outbox` (run {(writes or relays)[-1]['run']}; medians of "
        "alternating rounds):",
        "",
    ]
    for w in writes[-1:]:
        out += [
            f"| {w['n']:,} payment transactions, {w['concurrency']} at a time | µs per transaction |",
            "|---|---:|",
            f"| ledger `INSERT` only (the floor) | {w['floor_us']:,.0f} |",
            f"| the same + `outbox.add(...)` | {w['outbox_us']:,.0f} (+{w['outbox_us'] - w['floor_us']:,.0f}) |",
            "",
        ]
    if relays:
        out += [
            "| relay to | messages (keys) | bare publisher, msg/s | relay, msg/s | relay / bare |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in relays:
            out.append(
                f"| {r['broker']} | {r['messages']:,} ({r['keys']}) | {r['bare_msg_s']:,} | {r['relay_msg_s']:,} "
                f"| {r['relay_msg_s'] / r['bare_msg_s']:.2f} |"
            )
    return out


BLOCKS = {
    "scale": _scale,
    "consumers": _consumers,
    "horizons": _horizons,
    "postgres_table": _postgres_table,
    "outbox": _outbox,
}
"""Blocks any page may hold, besides the README's and docs/benchmarks.md's standing ones."""


def render(name: str, data: dict[str, Any]) -> str:
    """The text of block `name` (readme, standing, or one of BLOCKS) for `data`."""
    if name in BLOCKS:
        return "\n".join(BLOCKS[name](data)) + "\n"
    if name not in ("readme", "standing"):
        raise ValueError(f"no figure block {name!r}: one of readme, standing, {', '.join(BLOCKS)}")
    head = [
        f"Latest run: **{data['run']}**, {data['machine']}; FastAPI `POST` under one uvicorn worker at",
        "concurrency 32, requests/s with the middleware over the bare app, the floors measured in the same",
        "rounds (from `benchmarks/latest.json`, written by `python3 dev.py bench`):",
        "",
        "| | " + " | ".join(NAMES[s] for s in STORES) + " |",
        "|---|" + "---:|" * len(STORES),
        *_ratio_rows(data),
        "",
        *_targets(data),
    ]
    if name == "standing":
        head += ["", *_group_commit(data)]
        history = _history(data)
        head += ["", *history] if history else []
    return "\n".join(head) + "\n"


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- figures:{name} -->\n", f"<!-- /figures:{name} -->"
    if start not in text or end not in text:
        raise ValueError(f"no block {name!r} (between {start.strip()} and {end})")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    return before + start + body + end + after


def block(text: str, name: str) -> str:
    """What block `name` of a page holds now."""
    start, end = f"<!-- figures:{name} -->\n", f"<!-- /figures:{name} -->"
    return text.split(start, 1)[1].split(end, 1)[0]


def pages() -> dict[Path, list[str]]:
    """README.md and every page under docs/ that holds figure blocks, with their names."""
    found = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        names = _MARK.findall(page.read_text())
        if names:
            found[page] = names
    return found


def write(data: dict[str, Any] | None = None) -> list[str]:
    """Rewrite every page's blocks from `data` (default: latest.json); the pages that changed."""
    data = data if data is not None else json.loads(LATEST.read_text())
    changed = []
    for page, names in pages().items():
        text = page.read_text()
        new = text
        for name in names:
            new = _replace(new, name, render(name, data))
        if new != text:
            page.write_text(new)
            changed.append(str(page.relative_to(ROOT)))
    return changed


def drift() -> list[str]:
    """The pages whose blocks differ from latest.json."""
    data = json.loads(LATEST.read_text())
    return [
        str(page.relative_to(ROOT))
        for page, names in pages().items()
        if any(block(page.read_text(), name) != render(name, data) for name in names)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page's block differs from latest.json")
    parser.add_argument(
        "--merge",
        nargs=2,
        metavar=("NAME", "FILE"),
        help=f"replace latest.json's NAME figures ({', '.join(SECTIONS)}) with one benchmark's summary FILE",
    )
    args = parser.parse_args(argv)
    if args.merge:
        name, path = args.merge
        data = json.loads(LATEST.read_text())
        if name not in SECTIONS:
            parser.error(f"--merge NAME: one of {', '.join(SECTIONS)}")
        data[name] = section(Path(path))
        LATEST.write_text(json.dumps(data, indent=1) + "\n")
    if args.check:
        stale = drift()
        for page in stale:
            print(f"{page}: its figures differ from benchmarks/latest.json (python -m benchmarks.figures)")
        return 1 if stale else 0
    for page in write():
        print(f"rewrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
