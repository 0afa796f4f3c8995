"""No two of the project's modules import each other, directly or around a ring (STYLE.md: "keep the arrows
pointing down"). Every import counts: top-level, inside a function (lazy) and under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engine", "ep", "bench")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `packages` (a package is its __init__)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (a name resolves to its longest known module prefix)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: climb level - 1 packages from this module's package
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_cycle_among_the_project_modules() -> None:
    modules = module_files(ROOT, PACKAGES)
    assert {"server.app", "engine.core", "ep.flags", "bench.cli"} <= set(modules)
    found = cycles(import_graph(modules))
    assert not found, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(component) for component in found)


# The layers, lowest first: a module imports only from its own layer or lower ones (STYLE.md "Keep the arrows pointing
# down": server -> engine -> ep; bench is a client of the server, and its engine-direct mode uses the engine).
LAYERS = {"ep": 0, "engine": 1, "server": 2, "bench": 3}
# NOTE(test): the `ortserve` command's entry point dispatches its `bench` subcommand: the top of every layer.
ENTRY_POINTS = {"server.__main__"}


def upward_arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a module imports from a higher layer (entry points aside)."""
    return sorted((a, b) for a, targets in graph.items() if a not in ENTRY_POINTS for b in targets
                  if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]])


def test_no_upward_arrow_among_the_project_modules() -> None:
    found = upward_arrows(import_graph(module_files(ROOT, PACKAGES)))
    assert not found, "imports that point up a layer:\n" + "\n".join(f"{a} -> {b}" for a, b in found)


def test_the_product_imports_nothing_from_the_lab() -> None:
    """perf/ (investigations, outside the installed packages) is never imported by the product."""
    modules = module_files(ROOT, (*PACKAGES, "perf"))
    graph = import_graph(modules)
    found = sorted((a, b) for a, targets in graph.items() if not a.startswith("perf") for b in targets
                   if b.split(".")[0] == "perf")
    assert not found, f"product modules importing perf/: {found}"


def test_an_upward_arrow_is_seen() -> None:
    graph = {"ep.x": {"engine.y"}, "engine.y": {"ep.x"}, "server.__main__": {"bench.cli"}, "bench.cli": set(),
             "server.z": {"engine.y", "bench.cli"}}
    assert upward_arrows(graph) == [("ep.x", "engine.y"), ("server.z", "bench.cli")]


@pytest.mark.parametrize("a_imports", [
    "from pkg import b",  # absolute
    "from . import b",  # relative
    "import pkg.b",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B",  # typing-only
    "def lazy():\n    from pkg.b import B",  # inside a function
])
def test_the_finder_sees_every_kind_of_import(tmp_path: Path, a_imports: str) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(a_imports + "\n")
    (package / "b.py").write_text("from pkg.c import C\n")
    (package / "c.py").write_text("from pkg.a import A\n")
    (package / "d.py").write_text("from pkg.a import A\n")  # points into the ring, not part of it
    assert cycles(import_graph(module_files(tmp_path, ("pkg",)))) == [["pkg.a", "pkg.b", "pkg.c"]]
