"""deploy/docker: hadolint on both Dockerfiles, the build context against .dockerignore, the compose files
through Compose v2's own `config`, shellcheck on the entry point, and the images' runtime contract.

No image is built: these machines have no Docker engine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from docker.utils.build import exclude_paths

from deploy_tools import DEPLOY, ROOT, compose_binary, dockerfile_instructions, final_stage, tool

DOCKER = DEPLOY / "docker"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.rocm")
COMPOSE_FILES = ("compose.cpu.yaml", "compose.rocm.yaml")
# The uid both images run as; the Kubernetes pods' runAsUser must equal it (test_k8s checks that side).
IMAGE_UID = "10001"


def _duration_s(text: str) -> float:
    """A Compose duration such as "45s" or "1m30s", in seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert match and text, f"not a duration: {text!r}"
    hours, minutes, seconds = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(seconds or 0)


def _git_ignored(paths: list[Path]) -> set[Path]:
    """The paths git ignores (artefacts of local runs, not sources); none where there is no git checkout."""
    result = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--stdin"], capture_output=True, text=True,
                            input="\n".join(str(p) for p in paths), timeout=30, check=False)
    return {Path(line) for line in result.stdout.splitlines()} if result.returncode in (0, 1) else set()


def _hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [str(tool("hadolint")), "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=60, check=False)


def _compose(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # Only the variables the compose files read, so the caller's environment cannot change the outcome.
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), **(env or {})}
    return subprocess.run(
        [str(compose_binary()), "-f", str(path), *args],
        capture_output=True, text=True, timeout=60, check=False, env=clean, cwd=path.parent,
    )


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str) -> None:
    proc = _hadolint(str(DOCKER / name))
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


def test_hadolint_flags_an_unpinned_base_image() -> None:
    """The linter runs with our settings and fails on a finding (so silence above means clean)."""
    proc = _hadolint("-", stdin="FROM python:latest\nRUN pip install requests\n")
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # `latest` tag
    assert "DL3013" in proc.stdout  # unpinned pip package


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_are_in_the_build_context(name: str) -> None:
    """Every COPY source exists and survives .dockerignore (the Docker SDK's matcher, as `docker build`)."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    context = set(exclude_paths(str(ROOT), patterns))
    sources: list[str] = []
    for keyword, args in dockerfile_instructions(DOCKER / name):
        if keyword != "COPY":
            continue
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        if "--from=" in args:
            continue  # from another stage, not the context
        sources += [w.rstrip("/") for w in words[:-1]]
    assert sources, "no COPY from the build context found"
    for source in sources:
        assert (ROOT / source).exists(), f"{name}: COPY source {source} is not in the repository"
        files = [p for p in (ROOT / source).rglob("*") if p.is_file()] if (ROOT / source).is_dir() else [ROOT / source]
        files = [p for p in files if "__pycache__" not in p.parts and p.suffix != ".pyc" and not p.name.endswith(".so")]
        files = [p for p in files if p not in _git_ignored(files)]  # local artefacts, e.g. bench/results/
        missing = [str(p.relative_to(ROOT)) for p in files if str(p.relative_to(ROOT)) not in context]
        assert not missing, f"{name}: .dockerignore drops COPY inputs {missing[:5]}"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    context = exclude_paths(str(ROOT), patterns)
    for path in context:
        assert not path.startswith((".venv", ".git/", ".cache", "tests/")), path
        assert "__pycache__" not in path, path


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runtime_contract(name: str) -> None:
    """What compose, Kubernetes and systemd rely on: uid, port, cache volume, healthcheck, entry point."""
    stage = final_stage(dockerfile_instructions(DOCKER / name))
    values: dict[str, list[str]] = {}
    for keyword, args in stage:
        values.setdefault(keyword, []).append(args)
    assert values["USER"] == [f"{IMAGE_UID}:{IMAGE_UID}"]
    assert values["EXPOSE"] == ["8000"]
    env = " ".join(values["ENV"])
    assert "ORTSERVE_PORT=8000" in env and "ORTSERVE_HOST=0.0.0.0" in env
    assert "ORTSERVE_CACHE_DIR=/models" in env
    assert json.loads(values["VOLUME"][0]) == ["/models"]
    (healthcheck,) = values["HEALTHCHECK"]
    assert "/health" in healthcheck and "CMD [" in healthcheck
    assert json.loads(values["ENTRYPOINT"][0]) == ["/usr/local/bin/ortserve-entrypoint"]
    assert json.loads(values["CMD"][0]) == ["serve"]
    assert any("deploy/docker/entrypoint.sh /usr/local/bin/ortserve-entrypoint" in c for c in values["COPY"])


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_installs_the_postgres_extra(name: str) -> None:
    """Replicas share one state store on PostgreSQL (k8s components/shared-state): the image has its driver."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("psycopg") for req in extras["postgres"])
    installs = [a for k, a in dockerfile_instructions(DOCKER / name) if k == "RUN" and "pip install" in a
                and re.search(r'"\.\[', a)]
    (install,) = installs
    assert "postgres" in re.search(r'"\.\[([^\]]*)\]"', install).group(1).split(",")


def test_rocm_image_points_at_the_amdgpu_ep_library() -> None:
    stage = final_stage(dockerfile_instructions(DOCKER / "Dockerfile.rocm"))
    env = " ".join(args for keyword, args in stage if keyword == "ENV")
    assert "AMDGPU_EP_PATH=/opt/amdgpu-ep/" in env
    assert "ORTSERVE_PROVIDER=amdgpu" in env
    assert any(k == "COPY" and a.endswith("/opt/amdgpu-ep/") for k, a in stage)
    # The pinned ROCm base image and hip-python must be the same ROCm release.
    instructions = dockerfile_instructions(DOCKER / "Dockerfile.rocm")
    base_tag = next(a for k, a in instructions if k == "FROM").split()[0].split(":")[1]
    hip_python = next(a for k, a in instructions if k == "ARG" and a.startswith("HIP_PYTHON_VERSION="))
    assert hip_python.split("=")[1].startswith(base_tag + ".")


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_passes_compose_config(name: str) -> None:
    proc = _compose(DOCKER / name, "config", "--format", "json", env={"RENDER_GID": "992"})
    assert proc.returncode == 0, proc.stderr
    service = json.loads(proc.stdout)["services"]["ortserve"]
    assert [p["target"] for p in service["ports"]] == [8000]
    assert [(v["type"], v["target"]) for v in service["volumes"]] == [("volume", "/models")]
    assert service["read_only"] is True and service["cap_drop"] == ["ALL"]
    assert service["init"] is True
    # Docker's SIGKILL must come after the server's drain.
    drain_s = float(service["environment"]["ORTSERVE_SHUTDOWN_GRACE_S"])
    assert _duration_s(service["stop_grace_period"]) > drain_s
    assert service["build"]["dockerfile"] == f"deploy/docker/Dockerfile.{name.split('.')[1]}"
    assert Path(service["build"]["context"]) == ROOT


def test_gpu_compose_passes_one_gpus_devices_and_groups() -> None:
    proc = _compose(DOCKER / "compose.rocm.yaml", "config", "--format", "json", env={"RENDER_GID": "992"})
    assert proc.returncode == 0, proc.stderr
    service = json.loads(proc.stdout)["services"]["ortserve"]
    assert sorted(d["source"] for d in service["devices"]) == ["/dev/dri", "/dev/kfd"]
    assert service["group_add"] == ["44", "992"]
    assert service["environment"]["ORTSERVE_DEVICE"] == "0"


def test_gpu_compose_refuses_to_start_without_the_render_gid() -> None:
    """Compose itself stops with our message, instead of a container that cannot open /dev/dri."""
    proc = _compose(DOCKER / "compose.rocm.yaml", "config", "--quiet")
    assert proc.returncode != 0
    assert "RENDER_GID" in proc.stderr


def test_compose_rejects_an_invalid_file(tmp_path: Path) -> None:
    """The compose check validates against the schema (an unknown service key fails)."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  web:\n    image: x\n    stop_grace_periods: 10s\n")
    proc = _compose(bad, "config", "--quiet")
    assert proc.returncode != 0 and "stop_grace_periods" in proc.stderr


def test_entrypoint_passes_shellcheck() -> None:
    proc = subprocess.run(
        [str(tool("shellcheck")), "--shell=sh", "--severity=style", str(DOCKER / "entrypoint.sh")],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)
