"""The shape of ``distlocks/`` that the module map of docs/contributing.md promises: no import cycle (type-only and
function-level imports included), backends that import nothing of the layers above them, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distlocks"
#: What a backend may import from outside ``distlocks.backends``: the leaves every layer shares.
BELOW_BACKENDS = {"distlocks.exceptions", "distlocks.owner", "distlocks.models"}
MOST_LINES = 450


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """Each module of ours and the modules of ours it imports anywhere in its text (as ``import`` reads them)."""
    ours = modules()

    def resolve(name: str) -> str | None:
        while name and name not in ours:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in ours.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in ours else base for a in node.names)
        resolved = {r for r in map(resolve, targets) if r is not None}
        # Importing a submodule initialises its parents first; one's own parents are initialised already.
        with_parents = set()
        for target in resolved:
            while target:
                with_parents.add(target)
                target = target.rpartition(".")[0]
        graph[module] = {t for t in with_parents if t in ours and t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_distlocks():
    graph = imports()
    assert len(graph) > 50  # it read the package
    assert sum(map(len, graph.values())) > 100
    assert cycles(graph) == []


def test_backends_import_nothing_above_them():
    above = {
        module: sorted(t for t in targets if not t.startswith("distlocks.backends") and t not in BELOW_BACKENDS)
        for module, targets in imports().items()
        if module.startswith("distlocks.backends")
    }
    assert {module: targets for module, targets in above.items() if targets} == {}


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_module_is_over_450_lines(module):
    assert len(modules()[module].read_text().splitlines()) <= MOST_LINES
