"""The README and docs hold together: every link resolves (a file that exists, a heading that
exists, by GitHub's anchor rules; the site build checks the same links by its own), every code
snippet of the README and of the pages it moved to (`ALONE`) imports what it uses (the only names
it may leave undefined are the reader's own objects, named as such in the prose), and each of them
runs as printed, alone (top-level `await` included), with stand-ins for those objects."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI

from idem_asgi.backends import Backend
from tests.support.servers import REDIS_URL, ROOT, require
from tests.support.snippets import ALONE, compile_snippet, python_blocks, section_of, undefined_names

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
README = ROOT / "README.md"
STANDALONE = [README, *(ROOT / "docs" / page for page in ALONE)]
"""The pages whose snippets each run alone: the README and the pages its sections moved to."""
YOURS = {"app", "provider", "fake_provider", "order_from", "record_charge"}
"""The reader's own objects these snippets use without defining: their FastAPI app, their
payment provider's client (and its fake in tests), their request parsing and ORM writes."""
API = ROOT / "docs" / "api"
"""Pages mkdocstrings fills from the code: their anchors exist only in the built site."""


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_to_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto: ...
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and file.parent != API and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    assert broken == []


@pytest.mark.parametrize("page", STANDALONE, ids=lambda p: p.name)
def test_sections_named_in_quotes_exist(page: Path) -> None:
    """`(see "Scope" below)` in a snippet's comment names a heading of its own page."""
    text = page.read_text()
    headings = {h.strip().strip("`") for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    named = set(re.findall(r'see "([^"]+)"', text))
    assert named <= headings, named - headings


def test_the_slug_rules_match_githubs() -> None:
    assert (
        slug("Stuck claims, reconciliation and the `idem-asgi` CLI")
        == "stuck-claims-reconciliation-and-the-idem-asgi-cli"
    )
    assert slug("### `IdempotencyMiddleware(app, *, ...)`".lstrip("# ")) == "idempotencymiddlewareapp--"
    assert "five-lines-on-fastapi" in anchors(README)


RUN_IN_TEST_README = {
    ("README.md", "Five lines on FastAPI"),
    ("get-started.md", "Five lines on FastAPI"),
    ("frameworks.md", "Adding it, framework by framework"),
}
"""Sections whose snippet tests/test_readme.py runs with its own checks (one charge under 200
retries; compressors outside), so it is not run twice in one process (BlackSheep allows one
default router per process)."""


def snippets() -> list[tuple[str, str]]:
    """(page:line, code) of every snippet that runs alone."""
    return [(f"{page.relative_to(ROOT)}:{line}", code) for page in STANDALONE for line, code in python_blocks(page)]


def section_at(where: str) -> tuple[str, str]:
    path, line = where.rsplit(":", 1)
    return Path(path).name, section_of(ROOT / path, int(line))


RUNNABLE = [(where, code) for where, code in snippets() if section_at(where) not in RUN_IN_TEST_README]


def test_the_import_check_catches_a_missing_import() -> None:
    assert undefined_names("app.add_middleware(GZipMiddleware)") == {"app", "GZipMiddleware"}
    assert undefined_names("from x import GZipMiddleware\napp.add_middleware(GZipMiddleware)") == {"app"}


@pytest.mark.parametrize(("where", "code"), snippets(), ids=[where for where, _ in snippets()])
def test_every_standalone_snippet_imports_what_it_uses(where: str, code: str) -> None:
    assert undefined_names(code) <= YOURS, f"{where} uses names it neither imports nor defines"


class FakeProvider:
    def __init__(self) -> None:
        self.charges: list[str] = []

    async def charge(self, order: Any, *, idempotency_key: str) -> SimpleNamespace:
        self.charges.append(idempotency_key)
        return SimpleNamespace(id=f"ch_{len(self.charges)}")


def test_the_snippets_run_elsewhere_are_the_ones_test_readme_runs() -> None:
    elsewhere = [section_at(where) for where, _ in snippets() if section_at(where) in RUN_IN_TEST_README]
    assert sorted(elsewhere) == sorted(RUN_IN_TEST_README)
    source = (ROOT / "tests" / "test_readme.py").read_text()
    assert all(f'"## {s}"' in source or f'"### {s}"' in source for _, s in RUN_IN_TEST_README)


@pytest.mark.redis
@pytest.mark.parametrize(("where", "code"), RUNNABLE, ids=[where for where, _ in RUNNABLE])
async def test_every_standalone_snippet_runs_as_printed(where: str, code: str) -> None:
    require("redis", REDIS_URL)
    if "django" in code:
        from tests.django_project import _configure

        _configure()  # the snippet's settings module is the reader's; Django's settings are process-wide
    provider = FakeProvider()
    namespace: dict[str, Any] = {
        "__name__": "readme_snippet",
        "app": FastAPI(),
        "provider": provider,
        "fake_provider": provider,
        "order_from": lambda request: {"amount": 1},
        "record_charge": lambda charge: None,
    }
    code = code.replace("redis://localhost:6379/0", REDIS_URL)
    compiled = compile_snippet(code, where)
    outcome = eval(compiled, namespace)  # the page's own code
    if outcome is not None:
        await outcome  # a snippet with top-level await
    for value in namespace.values():
        if isinstance(value, Backend) and not isinstance(value, type):
            await value.aclose()


def test_the_postgres_pages_ddl_is_what_migrate_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/postgres.md shows the schema `idem-asgi migrate --print` prints, every column the code
    creates (a column added to the DDL without the page fails here: paste the command's output)."""
    from idem_asgi.ops import cli

    page = (ROOT / "docs" / "postgres.md").read_text()
    found = re.search(r"```bash\n(idem-asgi migrate --print[^\n]*)\n```\n\n```sql\n(.*?)```", page, re.S)
    assert found is not None, "docs/postgres.md: the migrate --print command and its sql block"
    monkeypatch.delenv("IDEM_BACKEND_URL", raising=False)
    assert cli.main(found.group(1).split()[1:]) == 0
    assert found.group(2) == capsys.readouterr().out
