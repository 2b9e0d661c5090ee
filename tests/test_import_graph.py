"""The package's imports are a house of floors: no circle, and no import from a lower floor to a higher one.

Read from the source (every `import` and `from ... import`, those under `if TYPE_CHECKING:` too: a
type a module names is a dependency of its design), module by module. The floors, from the ground up:

0. what everything may use: `_types`, `errors`, `records`, `history` (what is stored);
1. the leaf services: `_logging`, `observe`, `transform`, `sealed_keys`, `context` (what a handler is told);
2. the stores: `backends` (and `_shared`, the stores a middleware shares);
3. the claim core: `claims`;
4. the surfaces: `http`, `jobs`;
5. what is built on the surfaces: `ops`, `admin`, `testing`, `client`, the package itself and `__main__`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from tests.support.servers import ROOT

PACKAGE: Final = ROOT / "idem_asgi"
FLOORS: Final = (
    ("idem_asgi._types", "idem_asgi.errors", "idem_asgi.records", "idem_asgi.history"),
    ("idem_asgi._logging", "idem_asgi.observe", "idem_asgi.transform", "idem_asgi.sealed_keys", "idem_asgi.context"),
    ("idem_asgi.backends", "idem_asgi._shared"),
    ("idem_asgi.claims",),
    ("idem_asgi.http", "idem_asgi.jobs"),
    ("idem_asgi.ops", "idem_asgi.admin", "idem_asgi.testing", "idem_asgi.client", "idem_asgi.__main__", "idem_asgi"),
)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that `name` imports (a name imported from a package that is a module of
    it counts as that module; anything else as the package)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            as_modules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            yield from as_modules
            if len(as_modules) < len(node.names):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target.startswith("idem_asgi"):
                    yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t in imports(name, path, known) if t != name} for name, path in known.items()}


def floor(name: str) -> int:
    best = (-1, -1)
    for level, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (level, len(prefix))
    assert best[0] >= 0, f"{name} is on no floor: add it to FLOORS"
    return best[0]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_package_has_no_import_circle() -> None:
    assert circles(graph()) == []


def test_no_module_imports_from_a_floor_above_its_own() -> None:
    upward = sorted(
        f"{name} (floor {floor(name)}) imports {target} (floor {floor(target)})"
        for name, targets in graph().items()
        for target in targets
        if floor(target) > floor(name)
    )
    assert upward == []


def test_the_check_sees_a_circle_and_an_upward_import() -> None:
    """The checks above can fail: a made-up graph with both is caught."""
    edges = {"idem_asgi.records": {"idem_asgi.claims.session"}, "idem_asgi.claims.session": {"idem_asgi.records"}}
    assert circles(edges) == [["idem_asgi.claims.session", "idem_asgi.records"]]
    assert floor("idem_asgi.claims.session") > floor("idem_asgi.records")


def test_only_the_claim_core_calls_a_stores_claim() -> None:
    """One claim path: every surface claims through `claims.session.ClaimSession` (a store's own
    `claim`, or a wrapper's forwarding to the store it wraps, is the store, not a claim path; the
    shipped store contract suite tests a store's `claim` itself)."""
    calls = []
    for path in PACKAGE.rglob("*.py"):
        if "claims" in path.relative_to(PACKAGE).parts or path == PACKAGE / "testing" / "contract.py":
            continue
        tree = ast.parse(path.read_text())
        forwarding = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "claim"
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in forwarding:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "claim":
                owner = ast.unparse(node.func.value)
                if owner.endswith(("store", "backend", "inner")):
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert calls == []
