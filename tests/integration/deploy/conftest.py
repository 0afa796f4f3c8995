"""The `replicas` fixture: two real `ortserve serve` processes on loopback (see replica_tools.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from collections.abc import Iterator

import pytest

# NOTE(deploy): the Dockerfile/unit/kustomize helpers live beside the static tests; one copy for both.
# Set here too, because conftest runs before the test modules import deploy_tools.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "deploy"))

from deploy_tools import DEPLOY, env_file  # noqa: E402
from replica_tools import (  # noqa: E402
    MODEL_MAX_LENGTH,
    SHUTDOWN_GRACE_S,
    Replica,
    base_env,
    bin_dir,
    container_env,
    free_port,
    start,
    stop,
    systemd_command,
    wait_ready,
)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replica]]:
    """Two ready replicas of one synthetic model: {"container": ..., "systemd": ...}."""
    from engine.builder import SyntheticSpec, build_synthetic

    tmp = tmp_path_factory.mktemp("deploy_replicas")
    model = str(build_synthetic(tmp / "model", SyntheticSpec(max_length=MODEL_MAX_LENGTH)))
    env = base_env(bin_dir(tmp))
    # `model` contains '/', so the entry point serves it without a pull.

    # 1. As the CPU container: the image's ORTSERVE_* env, flags only (the entry point adds `serve`).
    container_port = free_port()
    env_a = {**env, **container_env()}
    env_a.update(
        ORTSERVE_MODEL=model,
        ORTSERVE_HOST="127.0.0.1",  # the image listens on 0.0.0.0; tests stay on loopback
        ORTSERVE_CACHE_DIR=str(tmp / "models"),
        ORTSERVE_SHUTDOWN_GRACE_S=str(SHUTDOWN_GRACE_S),
        HOME=str(tmp),
    )
    argv_a = ["sh", str(DEPLOY / "docker" / "entrypoint.sh"), "--port", str(container_port)]

    # 2. As ortserve@0.service: the unit's command and environment, then the two env files in order.
    argv_b, unit_env = systemd_command("0")
    argv_b[0] = "ortserve"  # /opt/ortserve/bin/ortserve on a host
    cache_root = tmp / "var-cache"
    env_b = {**env, **{k: v.replace("%C", str(cache_root)) for k, v in unit_env.items()}}
    env_b.update(env_file(DEPLOY / "systemd" / "ortserve.env.example"))
    env_b.update(env_file(DEPLOY / "systemd" / "instance.env.example"))
    systemd_port = free_port()
    env_b.update(ORTSERVE_MODEL=model, ORTSERVE_PORT=str(systemd_port), ORTSERVE_PROVIDER="cpu")
    env_b.pop("AMDGPU_EP_PATH", None)  # no GPU (and no EP library) on test machines
    (cache_root / "ortserve").mkdir(parents=True)  # CacheDirectory= creates it on a host

    started = [
        start("container", argv_a, env_a, container_port, tmp),
        start("systemd", argv_b, env_b, systemd_port, tmp),
    ]
    try:
        for replica in started:
            wait_ready(replica)
        yield {replica.name: replica for replica in started}
    finally:
        for replica in started:
            stop(replica)
