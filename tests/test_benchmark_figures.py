"""The benchmark figures the pages quote have one source, `benchmarks/latest.json` (benchmarks/figures.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import figures

OUTSIDE_FIGURE = re.compile(r"(?<!Python )\b\d\.\d\d\b")  # a ratio such as 0.69 or 2.17 (not "Python 3.11")


def test_every_page_block_is_rendered_from_latest_json() -> None:
    """Run `python -m benchmarks.figures` after changing latest.json (run_all does it itself)."""
    assert figures.drift() == []


def test_the_readme_quotes_no_benchmark_figure_outside_its_block() -> None:
    text = figures.PAGES["readme"].read_text()
    start, end = "<!-- figures:readme -->", "<!-- /figures:readme -->"
    outside = text.split(start)[0] + text.split(end)[1]
    assert OUTSIDE_FIGURE.findall(outside) == []


def test_a_run_s_summaries_become_the_figures_the_pages_show(tmp_path: Path) -> None:
    """What the benchmarks append (`--summary`) is what latest.json holds and the blocks print."""
    for route, memory in (("noop", 0.71), ("io", 0.83)):
        for backend, ratio in (
            ("memory", memory),
            ("redis", 0.66),
            ("postgres", 0.41),
            ("floor", 0.87),
            ("naive", 0.3),
        ):
            figures.append(
                str(tmp_path / f"overhead-{route}.jsonl"),
                {"kind": "summary", "backend": backend, "case": "new-key", "ratio": ratio},
            )
    for server, case, n in (
        ("bare", "new-key", 430_000),
        ("memory", "new-key", 480_500),
        ("floor", "replay", 300_000),
        ("memory", "replay", 339_000),
    ):
        figures.append(
            str(tmp_path / "instructions.jsonl"),
            {"kind": "valgrind", "server": server, "case": case, "instructions": n},
        )
    figures.append(
        str(tmp_path / "group-commit.jsonl"),
        {
            "kind": "group-commit",
            "inflight": 32,
            "keys_ratio": 2.5,
            "pg_cpu_ratio": 0.2,
            "pg_us_per_key": 55.0,
            "batch_median": 8,
            "batch_max": 31,
        },
    )
    data = figures.collect(tmp_path, "2026-12-03 05:00 UTC", "2-core x86_64")
    assert json.loads(json.dumps(data)) == data
    text = figures.render("standing", data)
    assert "| new key, route doing one Redis `GET` | 0.83 | 0.66 | 0.41 | 0.87 | 0.30 |  |" in text
    assert "Postgres new key, route with I/O: **0.41** of bare (target 0.65: MISSED, the worker, Postgres" in text
    assert "memory new key over the capture floor: **0.95** (target 0.95: met)" in text
    assert "own instructions per new key (callgrind, memory store): **50.5k** (target 55k: met)" in text
    assert "per replay, over the capture floor's: **39.0k** (target 40k: met)" in text
    assert "| 32 | x2.50 | x0.20 | 55 | 8 / 31 |" in text
    assert "Postgres group commit" not in figures.render("readme", data)
