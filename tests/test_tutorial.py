"""The tutorial (docs/tutorial/) holds together: each step's file runs as a script, exits 0 and
prints exactly the ```console block of its page; each page shows its file's code (a snippet line
the site build includes, strict, so the code shown is the file); the overview links every step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest

from tests.support.servers import REDIS_URL, ROOT, require

TUTORIAL = ROOT / "docs" / "tutorial"
STEPS = [
    ("1-memory.md", "step1_memory.py"),
    ("2-redis.md", "step2_redis.py"),
    ("3-scope.md", "step3_scope.py"),
    ("4-client.md", "step4_client.py"),
    ("5-recovery.md", "step5_recovery.py"),
    ("6-production.md", "step6_production.py"),
]
STEPS_BY_PAGE = dict(STEPS)
NEEDS_REDIS = {"step2_redis.py", "step6_production.py"}


def console_block(page: Path) -> str:
    """The page's one ```console block, without its `$ python docs/tutorial/...` line."""
    blocks = re.findall(r"^```console\n(.*?)^```$", page.read_text(), re.S | re.M)
    assert len(blocks) == 1, f"{page.name}: expected one console block, found {len(blocks)}"
    lines = blocks[0].splitlines(keepends=True)
    assert lines[0] == f"$ python docs/tutorial/{STEPS_BY_PAGE[page.name]}\n", lines[0]
    return "".join(lines[1:])


def run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(Path("docs") / "tutorial" / script)],
        cwd=ROOT,
        env={**os.environ, "IDEM_REDIS_URL": REDIS_URL},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("page", "script"), STEPS, ids=[script for _, script in STEPS])
def test_the_step_prints_what_its_page_shows(page: str, script: str) -> None:
    if script in NEEDS_REDIS:
        require("redis", REDIS_URL)
    started = time.monotonic()
    done = run(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout == console_block(TUTORIAL / page)
    assert time.monotonic() - started < 30, f"{script} is too slow for a tutorial step"


@pytest.mark.parametrize(("page", "script"), STEPS, ids=[page for page, _ in STEPS])
def test_the_page_shows_the_files_code(page: str, script: str) -> None:
    text = (TUTORIAL / page).read_text()
    include = f'--8<-- "docs/tutorial/{script}"'
    fences = re.findall(r"^```python[^\n]*\n(.*?)^```$", text, re.S | re.M)
    assert fences == [include + "\n"], f"{page}: one ```python block holding only `{include}`"
    # ruff (0.16+) formats ```python blocks in Markdown and would rewrite the include line as
    # `--8 < --"..."`, which the site then shows as code: the block is fenced off from it.
    assert re.search(r"^<!-- fmt:off -->\n```python[^\n]*\n--8<-- [^\n]+\n```\n<!-- fmt:on -->$", text, re.M)
    assert "pymdownx.snippets" in (ROOT / "mkdocs.yml").read_text()  # what turns that line into the file


def test_the_files_and_pages_match_and_the_overview_links_every_step() -> None:
    assert sorted(p.name for p in TUTORIAL.glob("*.py")) == sorted(script for _, script in STEPS)
    assert sorted(p.name for p in TUTORIAL.glob("*.md")) == sorted([*(page for page, _ in STEPS), "index.md"])
    overview = (TUTORIAL / "index.md").read_text()
    assert all(f"]({page})" in overview for page, _ in STEPS)
    for (page, _), (following, _) in pairwise(STEPS):
        assert f"]({following})" in (TUTORIAL / page).read_text(), f"{page} does not link to {following}"
