"""Code blocks of the docs as code: find them, see which names they leave undefined, run them
(top-level `await` included), for the tests that keep the README and docs working as printed."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path
from types import CodeType

ALONE = (
    "index.md",
    "get-started.md",
    "frameworks.md",
    "keys.md",
    "observability.md",
    "how-it-works.md",
    "configuration.md",
    "memory.md",
    "stores.md",
)
"""docs/ pages whose blocks each stand alone (they came from the README, whose snippets were run
one by one): tests/test_docs_checked.py runs them so, tests/test_docs_run.py runs the others."""


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line of the code, code) of every ```python block of a page, in order."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def section_of(page: Path, line: int) -> str:
    """The heading (without its #s) of the section that holds `line` (1-based), code blocks skipped."""
    heading, fenced = "", False
    for text in page.read_text().splitlines()[: line - 1]:
        if text.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", text):
            heading = text.lstrip("#").strip()
    return heading


def compile_snippet(code: str, where: str) -> CodeType:
    """Compiled as a module body that may `await` at the top (then `eval` returns a coroutine)."""
    compiled: CodeType = compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    return compiled


def parse(code: str) -> ast.Module:
    tree = compile(code, "<snippet>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    assert isinstance(tree, ast.Module)
    return tree


def undefined_names(code: str) -> set[str]:
    """Names read but never bound anywhere in the snippet (import, assignment, def, argument...)."""
    bound, read = _names(code)
    return read - bound - set(dir(builtins))


def bound_names(code: str) -> set[str]:
    """Names a snippet defines at any level (what a later block on the same page may use)."""
    return _names(code)[0]


def _names(code: str) -> tuple[set[str], set[str]]:
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound, read
