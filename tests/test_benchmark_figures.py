"""The benchmark figures the pages quote have one source, `benchmarks/latest.json` (benchmarks/figures.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import figures

PAGES = sorted(
    [figures.ROOT / "README.md", figures.ROOT / "benchmarks" / "README.md", *(figures.ROOT / "docs").glob("**/*.md")]
)
"""Every page of the site and the README (benchmarks/README.md is included in docs/benchmarks.md;
the changelog, a record of past releases, includes CHANGELOG.md, which is not scanned)."""
MEASURED = re.compile(
    r"""(?x)(?<![\w.])(?:
      [x\u00d7]\d+\.\d+                                                # a ratio: x2.94
    | \d[\d,]*(?:\.\d+)?\s?(?:µs|ns|k\b|(?:msg|keys|rows|requests|calls|replays)/s)  # a cost, a rate
    | \d+\.\d+\s?(?:ms|[MG]B\b)                                  # a time to the tenth of a ms, a size
    | \d+\.\d+[\u2013-]\d+\.\d+\s?s\b                                  # a measured range: 0.7-0.9 s
    | \d+\.\d{2,}(?![\d.])                                       # a ratio or a time to the hundredth: 0.62
    )"""
)
"""What a benchmark measures: costs in µs, rates, instruction counts, ratios and times to the
hundredth. Settings (a 20 ms linger, a 256 KiB threshold, a 0.5 s lease) are not figures."""
VERSION = re.compile(
    r"(?i)\b(?:python|redis|postgresql|pgbouncer|rabbitmq|nats|starlette|litestar|quart|granian|hypercorn|"
    r"uvicorn|uvicorn-worker|gunicorn|fastapi|valkey-glide|redis-py|coredis|msgspec|asyncpg)\s+\d+(?:\.\d+)+\+?"
)


def measured_outside_blocks(text: str) -> list[str]:
    """The measured figures of a page outside its figure blocks, code and versions."""
    text = re.sub(r"<!-- figures:([\w-]+) -->.*?<!-- /figures:\1 -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    text = re.sub(r"--8<-- \"[^\"]*\"", "", text)
    text = re.sub(r"(?:target|goal|>=|≥)\s*\d+\.\d+|\d+\.\d+\s*GHz", "", text)  # a goal, a clock: not measured
    return [
        f"{n}: {line.strip()[:160]}"
        for n, line in enumerate(VERSION.sub("", text).splitlines(), 1)
        if MEASURED.search(line)
    ]


def test_every_page_block_is_rendered_from_latest_json() -> None:
    """Run `python -m benchmarks.figures` after changing latest.json (run_all does it itself)."""
    assert figures.drift() == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(figures.ROOT)))
def test_a_page_quotes_measured_figures_only_in_blocks_rendered_from_latest_json(page: Path) -> None:
    """A figure written by hand goes stale the next run; in a block it is rewritten from the run.
    (Line numbers count the page with its blocks and code blocks taken out.)"""
    assert measured_outside_blocks(page.read_text()) == []


def test_the_figure_rule_sees_costs_rates_and_ratios_but_not_settings_or_versions() -> None:
    seen = measured_outside_blocks(
        "ours 0.62 of bare, 230 µs per message, 80,600 calls/s, x2.94, 109.7k instructions\n"
        "a 20 ms linger, 256 KiB, lease 0.5 s, Redis 7.0.15, RabbitMQ 3.12+, `scope_share=0.25`, target 0.80\n"
        "<!-- figures:x -->\n0.99 inside\n<!-- /figures:x -->\n```\n0.98 in code\n```\n"
    )
    assert seen == ["1: ours 0.62 of bare, 230 µs per message, 80,600 calls/s, x2.94, 109.7k instructions"]


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


def test_the_scale_curve_and_consumer_rates_render_from_their_summary_files(tmp_path: Path) -> None:
    """bench_scale's and bench_consumer_rate's `--summary` rows become the blocks the pages hold."""
    scale, rates = str(tmp_path / "scale.jsonl"), str(tmp_path / "consumer-rate.jsonl")
    figures.append(scale, {"kind": "run", "run": "2026-12-03 12:00 UTC", "rounds": 3, "duration": 1.5})
    for concurrency, ratio in ((1, 0.8), (128, 0.6)):
        figures.append(
            scale,
            {
                "kind": "point", "backend": "memory", "concurrency": concurrency, "body_bytes": 1024,
                "bare_rps": 2000.0, "ours_rps": 2000.0 * ratio, "ratio": ratio,
                "bare_p99_ms": 9.0, "ours_p99_ms": 11.5, "ours_p50_ms": 5.0,
            },
        )  # fmt: skip
    goal = {"target": "memory ratio at concurrency 128 / at 1", "value": 0.75, "goal": 0.9, "met": False}
    figures.append(scale, {"kind": "target", **goal})
    figures.append(scale, {"kind": "memory", "in_flight_body_bytes": 1024, "bytes_per_request": 4608})
    figures.append(
        rates,
        {
            "kind": "consumer-rate", "run": "2026-12-03 12:05 UTC", "n": 2000, "procs": 2, "window": 100,
            "broker": "nats", "rounds": 3, "bare_msg_per_s": 13000.0, "ours_msg_per_s": 5000.0, "ratio": 0.385,
            "ratio_min": 0.3, "ratio_max": 0.41, "bare_cpu_us_per_msg": 126.0, "ours_cpu_us_per_msg": 300.0,
            "bare_broker_cpu_us_per_msg": 22.0, "ours_broker_cpu_us_per_msg": 25.0,
            "ours_redis_cpu_us_per_msg": 43.0, "target": 0.8, "met": False,
        },
    )  # fmt: skip
    data = figures.collect(tmp_path, "2026-12-03 12:10 UTC", "2-core x86_64")
    text = figures.render("scale", data)
    assert "run 2026-12-03 12:00 UTC, memory store" in text and "median of 3 bare/ours pairs" in text
    assert "| 128 | 1 KiB | 2,000 | 1,200 | 0.60 | 9.0 / 11.5 |" in text
    assert "- memory ratio at concurrency 128 / at 1: **0.75** (target 0.9: MISSED" in text
    assert "4.5 KiB with 1 KiB bodies" in text
    text = figures.render("consumers", data)
    assert "| NATS JetStream | 13,000 | 5,000 | **0.39** (0.30-0.41) | 126 → 300 | 22 → 25 | 43 | 0.80: MISSED" in text
    with pytest.raises(ValueError, match="no figure block"):
        figures.render("nonesuch", data)
