"""deploy/router: the vllm-router launcher passes shellcheck and the LiteLLM config declares every replica as one
model. Both run for real in tests/integration/deploy/test_router.py."""

from __future__ import annotations

import os
import subprocess

import yaml

from deploy_tools import DEPLOY, tool

ROUTER = DEPLOY / "router"


def test_router_script_passes_shellcheck() -> None:
    script = ROUTER / "ortserve-router.sh"
    proc = subprocess.run([str(tool("shellcheck")), "--shell=sh", "--severity=style", str(script)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert os.access(script, os.X_OK)


def test_router_script_rejects_a_device_list_of_the_wrong_length(tmp_path) -> None:
    proc = subprocess.run(["sh", str(ROUTER / "ortserve-router.sh")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "REPLICAS": "3", "DEVICES": "0 1", "RUN_DIR": str(tmp_path)},
                          check=False)
    assert proc.returncode == 2 and "DEVICES lists 2 devices for 3 replicas" in proc.stderr
    assert not list(tmp_path.iterdir()), "nothing may start"


def test_litellm_config_is_one_model_over_every_replica() -> None:
    config = yaml.safe_load((ROUTER / "litellm.yaml").read_text())
    deployments = config["model_list"]
    assert len(deployments) >= 2
    assert {d["model_name"] for d in deployments} == {"ortserve"}
    bases = [d["litellm_params"]["api_base"] for d in deployments]
    assert bases == [f"os.environ/ORTSERVE_REPLICA_{i}" for i in range(len(deployments))]
    assert all(d["litellm_params"]["model"].startswith("openai/") for d in deployments)
    assert config["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"
