"""The house's size limits (STYLE.md "Keep modules under about 600 lines"; issue 35): in the product packages
(server, engine, ep, bench) no module over 600 lines, no class over 350 lines, and no regular class whose
constructor takes over 12 parameters. Import circles and upward arrows: tests/unit/test_import_cycles.py.

Value records are not regular classes: a dataclass (without a hand-written ``__init__``), a NamedTuple, a pydantic
model or a TypedDict is built by keyword from named, typed fields that each say what they are (EngineConfig,
SamplingParams, a wire model); it has no collaborators to pass in, so its field count is not a constructor's
parameter count. A dataclass that writes its own ``__init__`` is a regular class.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engine", "ep", "bench")
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350
MAX_INIT_PARAMS = 12

RECORD_BASES = {"NamedTuple", "BaseModel", "TypedDict", "Protocol"}


def product_files(root: Path = ROOT) -> list[Path]:
    return [p for package in PACKAGES for p in sorted((root / package).rglob("*.py"))]


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def init_params(cls: ast.ClassDef) -> int | None:
    """The parameters of ``cls``'s hand-written ``__init__`` (``self`` aside, ``*args``/``**kwargs`` one each);
    None for a value record or a class that writes no ``__init__``."""
    init = next((f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return None
    if any(_name(base) in RECORD_BASES for base in cls.bases):
        return None
    a = init.args
    return (len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + (a.vararg is not None)
            + (a.kwarg is not None))


def measure(files: list[Path], root: Path = ROOT) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(module lines, class lines, constructor parameters), keyed "path" and "path:Class" (nested: "path:A.B")."""
    modules, classes, params = {}, {}, {}
    for path in files:
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        modules[rel] = len(text.splitlines())

        def visit(body: list[ast.stmt], prefix: str) -> None:
            for node in body:
                if isinstance(node, ast.ClassDef):
                    key = f"{rel}:{prefix}{node.name}"
                    classes[key] = node.end_lineno - node.lineno + 1
                    count = init_params(node)
                    if count is not None:
                        params[key] = count
                    visit(node.body, f"{prefix}{node.name}.")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(node.body, prefix)

        visit(ast.parse(text, rel).body, "")
    return modules, classes, params


@pytest.fixture(scope="module")
def house() -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    files = product_files()
    assert {"engine/core.py", "server/app.py", "ep/flags.py", "bench/cli.py"} <= {
        p.relative_to(ROOT).as_posix() for p in files}
    return measure(files)


def test_no_module_over_600_lines(house) -> None:
    modules, _, _ = house
    over = {name: n for name, n in modules.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_class_over_350_lines(house) -> None:
    _, classes, _ = house
    over = {name: n for name, n in classes.items() if n > MAX_CLASS_LINES}
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {over}"


def test_no_regular_class_takes_over_12_constructor_parameters(house) -> None:
    _, _, params = house
    over = {name: n for name, n in params.items() if n > MAX_INIT_PARAMS}
    assert not over, f"constructors over {MAX_INIT_PARAMS} parameters: {over}"


def test_the_measures_see_what_they_claim(tmp_path: Path) -> None:
    """Each limit can fail: a long module, a long nested class and a wide constructor are caught; records pass."""
    package = tmp_path / "engine"
    package.mkdir()
    wide = ", ".join(f"p{i}" for i in range(13))
    source = "\n".join([
        "from dataclasses import dataclass",
        "from typing import NamedTuple",
        "class Wide:",
        f"    def __init__(self, {wide}, *, k=1, **rest): pass",
        "class Narrow:",
        "    def __init__(self, a, b): pass",
        "@dataclass",
        "class Record:",
        *[f"    f{i}: int = 0" for i in range(20)],
        "class Row(NamedTuple):",
        "    a: int",
        "    def __init__(self, a, b, c, d, e, f, g, h, i, j, k, l, m): pass",
        "def outer():",
        "    class Inner:",
        *["        x = 1" for _ in range(400)],
        *["# filler" for _ in range(200)],
    ])
    (package / "mod.py").write_text(source + "\n")
    modules, classes, params = measure(product_files(tmp_path), tmp_path)
    assert modules["engine/mod.py"] > MAX_MODULE_LINES
    assert classes["engine/mod.py:Inner"] > MAX_CLASS_LINES
    assert params == {"engine/mod.py:Wide": 15, "engine/mod.py:Narrow": 2}
