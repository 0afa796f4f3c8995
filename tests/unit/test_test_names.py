"""Test modules outside packages (no __init__.py) are imported by pytest under their basename, so two of them with
the same name make the whole suite's collection fail ("import file mismatch"): it happened once (session 10).
Every such basename under tests/ is unique."""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rootless_modules(root: Path) -> list[Path]:
    """Test modules whose folder is not a package (pytest's rootdir import: module name = basename)."""
    return [p for p in sorted((root / "tests").rglob("test_*.py")) if not (p.parent / "__init__.py").is_file()]


def test_test_module_basenames_outside_packages_are_unique() -> None:
    by_name = collections.defaultdict(list)
    for path in _rootless_modules(ROOT):
        by_name[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def test_the_check_finds_a_collision(tmp_path: Path) -> None:
    for folder in ("a", "b"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / "test_same.py").write_text("")
    names = [p.name for p in _rootless_modules(tmp_path)]
    assert names.count("test_same.py") == 2
