"""Every module path a docstring names in backticks resolves: a module of the package that moved, or a
name that was renamed, leaves no stale reference behind (`_request.Protected`, `_leases.Leases` once did).

A backticked dotted name whose first part is a module of `idem_asgi` (by its path, its last part, or
that part without its leading underscore) must resolve: some module of the package ends with the
name's leading parts, and the rest are attributes of it (a class, a function, a constant, a method).
Names whose first part is no module of ours (`asyncio.wait_for`, `msg.in_progress()`, `job.result`)
are someone else's, or a variable, and are not checked here.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from typing import Any, Final

from tests.support.servers import ROOT

PACKAGE: Final = ROOT / "idem_asgi"
NAMED: Final = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\(\))?`")


def module_names() -> list[str]:
    found = []
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append(".".join(parts))
    return found


def docstrings() -> Iterator[tuple[str, str]]:
    """(where, text) of every module, class and function docstring of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"
                    yield where, text


def _attr(obj: Any, names: list[str]) -> bool:
    for name in names:
        if isinstance(obj, type) and name in getattr(obj, "__annotations__", {}):
            return True  # a field declared on a class (a dataclass's, a Protocol's)
        if not hasattr(obj, name):
            slots = getattr(obj, "__slots__", ())
            return name in slots
        obj = getattr(obj, name)
    return True


def ours(parts: list[str], modules: list[str]) -> bool:
    """Whether a dotted name points into the package: `idem_asgi.x`, a private module's name
    (`_request.Protected`, whether or not that module still exists), or a module path of ours by its
    last two parts (`claims.session`)."""
    if parts[0] == "idem_asgi":
        return True
    tails = {tuple(m.split(".")[-2:]) for m in modules if m.count(".") >= 1}
    if parts[0].startswith("_"):
        return True  # a private module's name: ours, whether it still exists or not
    return len(parts) >= 2 and (parts[0], parts[1]) in tails


def resolves(dotted: str, modules: list[str]) -> bool | None:
    """True or False for a name that points into the package; None for anyone else's (a variable,
    another library, an ASGI message type). A file name (`_lean.py`) must name a module of ours."""
    parts = dotted.split(".")
    if parts[-1] == "py":
        return (
            any(m.split(".")[-1] == ".".join(parts[:-1]) for m in modules)
            if ours([*parts[:-1], "x"], modules)
            else None
        )
    if not ours(parts, modules):
        return None
    for name in modules:
        segments = name.split(".")
        for k in range(len(parts), 0, -1):
            if segments[-k:] == parts[:k]:
                module = importlib.import_module(name)
                if _attr(module, parts[k:]):
                    return True
    return False


def test_every_module_path_a_docstring_names_resolves() -> None:
    modules = module_names()
    stale = sorted(
        f"{where}: `{dotted}`"
        for where, text in docstrings()
        for dotted in NAMED.findall(text)
        if resolves(dotted, modules) is False
    )
    assert stale == []


def test_the_check_catches_a_moved_module() -> None:
    modules = module_names()
    assert resolves("_request.Protected", modules) is False  # the module is http/request.py now
    assert resolves("claims.session.ClaimSession", modules) is True
    assert resolves("asyncio.wait_for", modules) is None
