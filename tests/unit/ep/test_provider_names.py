"""Provider names are compared in two modules of engine/ and ep/ only: the device profiles (ep/profiles.py) and the
EP name table (ep/names.py). Everywhere else a per-device choice asks the profile (STYLE.md: "A device family is one
profile class"; issue 35)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("engine", "ep")
ALLOWED = {"ep/profiles.py", "ep/names.py"}
# every provider short name, the selectors, and backends' other names; EP names are matched by their suffix
NAMES = {"amdgpu", "migraphx", "webgpu", "openvino", "cuda", "cpu", "auto", "all", "rocm", "hip", "dml", "directml"}
# identifiers that hold a provider name
PROVIDER_IDENTIFIERS = {"provider", "chosen", "prov"}


def _is_provider_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value.strip().lower()
        return text in NAMES or text.endswith("executionprovider")
    return False


def _holds_provider(node: ast.AST) -> bool:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("lower", "strip"):
        return _holds_provider(node.func.value)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name is not None and (name in PROVIDER_IDENTIFIERS or name.endswith("_provider"))


def _names_a_provider(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_provider(e) for e in node.elts)
    if isinstance(node, ast.Starred):
        return _names_a_provider(node.value)
    return _is_provider_name(node) or _holds_provider(node)


def provider_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, expression) of every comparison (==, !=, in, not in, ...) one of whose sides is a provider name
    or a variable/attribute holding one (``provider``, ``selected.provider``, ``config.provider.lower()``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_a_provider(side) for side in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_rule_sees_each_kind_of_comparison() -> None:
    """The checker itself: each form found today's code used, and none of the allowed forms."""
    bad = '''
if config.provider.lower() == "cpu": pass
if selected.provider in MIGRAPHX_BACKED: pass
if provider not in ("auto", *FLAGS): pass
x = [r for r in records if r.provider == provider]
if value.device_name() == "CUDAExecutionProvider": pass
'''
    assert sorted(line for line, _ in provider_comparisons(bad)) == [2, 3, 4, 5, 6]
    fine = '''
device = ort.OrtDevice.make("cpu", 0)
hints = TABLE.get(provider, ())
if profile.engine_capture and selected is not None: pass
'''
    assert provider_comparisons(fine) == []


def test_provider_names_are_compared_only_in_the_profiles_and_the_name_table() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            offenders += [f"{rel}:{line}: {text}" for line, text in provider_comparisons(path.read_text("utf-8"))]
    assert not offenders, ("provider names compared outside ep/profiles.py and ep/names.py (ask the device "
                           "profile instead):\n" + "\n".join(offenders))
