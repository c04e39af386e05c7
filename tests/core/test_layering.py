"""The package's floors: modeling < core < conversion < training < analysis / evaluation < serving < demo < cli.

Every module's imports are read with `ast` — function-local ones included, since a cycle hidden behind a local import
is still a cycle — and the test fails on an import from a higher floor or on any circle of modules."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hf_loops")

# The floor of each top-level part of the package (a module may import its own floor or lower ones).
FLOORS = {
    "hf_loops": 0,  # the package itself only registers the modeling classes
    "modeling": 0,
    "core": 1,
    "data": 1,  # small embedded files and their paths
    "conversion": 2,
    "training": 3,
    "analysis": 4,
    "evaluation": 4,
    "inference": 4,
    "serving": 5,
    "demo": 6,
    "reproduce": 6,  # the papers' claims; runs its jobs on the demo's worker pool
    "cli": 7,
}


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The hf_loops modules `module` imports anywhere in its file (`from . import x` counts as the submodule x)."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import hf_loops.x.y` names x.y, a function, ...
                target = target.rpartition(".")[0]
            if target.startswith("hf_loops") and target != module:
                out.add(target)
    return out


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS[parts[1] if len(parts) > 1 else parts[0]]


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_part_of_the_package_has_a_floor(graph):
    parts = {m.split(".")[1] if "." in m else m for m in graph}
    assert parts <= set(FLOORS), sorted(parts - set(FLOORS))


# `import hf_loops` checks the transformers version before it imports anything else (core.compat imports no hf_loops
# module at import time).
ALLOWED_UPWARD = {("hf_loops", "hf_loops.core.compat")}


def test_no_import_from_a_higher_floor(graph):
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    if _floor(t) > _floor(m) and (m, t) not in ALLOWED_UPWARD)
    assert upward == [], "\n".join(upward)


def test_modeling_imports_only_its_siblings(graph):
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith("hf_loops.modeling")
                 for t in ts if not t.startswith("hf_loops.modeling"))
    assert bad == [], bad


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_circular_imports(graph):
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_hidden_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
