"""deploy/systemd: `systemd-analyze verify` and `security --offline` on the units, and the units' contract
with the server (one device per instance, stop timeout over the drain, shared cache, hardening)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy_tools import DEPLOY, env_file, unit_entries, unit_values

SYSTEMD = DEPLOY / "systemd"
TEMPLATE = SYSTEMD / "ortserve@.service"
PULL = SYSTEMD / "ortserve-pull.service"
SYSTEM_UNITS = Path("/usr/lib/systemd/system")

needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None or not SYSTEM_UNITS.is_dir(),
    reason="systemd-analyze is not installed (Debian package systemd)",
)


def _scratch_root(tmp_path: Path, units: dict[str, str]) -> Path:
    """A filesystem root for `systemd-analyze --root`: the system's stock units, ours, and ExecStart's program.

    NOTE(deploy): verify resolves dependencies (sysinit.target, ...) and checks that ExecStart's program is
    executable, both inside the root; /opt/ortserve is not installed on test machines, so an executable
    placeholder stands at that path. Everything else in the units is checked as written.
    """
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    for name, text in units.items():
        (etc / name).write_text(text)
        for exec_start in re.findall(r"^ExecStart=(\S+)", text, flags=re.M):
            program = root / exec_start.lstrip("/")
            program.parent.mkdir(parents=True, exist_ok=True)
            program.write_text("#!/bin/sh\nexit 0\n")
            program.chmod(0o755)
    return root


def _analyze(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", f"--root={root}", *args], capture_output=True, text=True, timeout=120, check=False
    )


def _ours() -> dict[str, str]:
    return {TEMPLATE.name: TEMPLATE.read_text(), PULL.name: PULL.read_text()}


@needs_systemd
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    root = _scratch_root(tmp_path, _ours())
    proc = _analyze(root, "verify", "--man=no", "--generators=no", "ortserve@0.service", "ortserve-pull.service")
    # NOTE(deploy): verify exits 0 on parse warnings ("Unknown key ..., ignoring"), so any output fails too.
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stdout + proc.stderr


@needs_systemd
def test_verify_reports_a_misspelt_directive(tmp_path: Path) -> None:
    """The check above can fail: a typo in a hardening option is reported."""
    broken = TEMPLATE.read_text().replace("ProtectSystem=strict", "ProtectSystem=strict\nProtectSytem=strict")
    root = _scratch_root(tmp_path, {TEMPLATE.name: broken, PULL.name: PULL.read_text()})
    proc = _analyze(root, "verify", "--man=no", "--generators=no", "ortserve@0.service")
    assert "ProtectSytem" in proc.stderr


@needs_systemd
@pytest.mark.parametrize("unit", ["ortserve@0.service", "ortserve-pull.service"])
def test_units_rate_ok_in_systemd_analyze_security(tmp_path: Path, unit: str) -> None:
    """Exposure below 2.0 of 10 (the units rate 1.7 and 1.5 with systemd 252)."""
    root = _scratch_root(tmp_path, _ours())
    proc = _analyze(root, "security", "--offline=true", "--threshold=20", unit)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert match and float(match.group(1)) < 2.0, proc.stdout[-500:]


@needs_systemd
def test_security_check_fails_an_unhardened_unit(tmp_path: Path) -> None:
    """The rating above can fail: the same unit without its hardening options is rated over the threshold."""
    keep = ("Type", "ExecStart", "Environment", "EnvironmentFile", "KillSignal", "TimeoutStopSec", "Restart")
    lines = [
        line
        for line in TEMPLATE.read_text().splitlines()
        if "=" not in line or line.startswith("#") or line.split("=", 1)[0] in keep or line.startswith(
            ("Description", "After", "Wants", "Documentation", "WantedBy")
        )
    ]
    root = _scratch_root(tmp_path, {TEMPLATE.name: "\n".join(lines) + "\n", PULL.name: PULL.read_text()})
    proc = _analyze(root, "security", "--offline=true", "--threshold=20", "ortserve@0.service")
    assert proc.returncode != 0, proc.stdout[-500:]


def test_instance_serves_its_own_device() -> None:
    (exec_start,) = unit_values(TEMPLATE, "Service", "ExecStart")
    argv = exec_start.split()
    assert argv[1:3] == ["serve", "--device"] and argv[3] == "%i"
    # The per-instance env file is required (no leading '-'): it carries the instance's port.
    env_files = unit_values(TEMPLATE, "Service", "EnvironmentFile")
    assert env_files == ["-/etc/ortserve/ortserve.env", "/etc/ortserve/%i.env"]
    assert "ORTSERVE_PORT" in env_file(SYSTEMD / "instance.env.example")
    assert unit_values(TEMPLATE, "Unit", "Wants")[0].split()[-1] == PULL.name
    assert PULL.name in unit_values(TEMPLATE, "Unit", "After")[0].split()


def test_stop_timeout_covers_the_drain() -> None:
    environment = dict(v.split("=", 1) for v in unit_values(TEMPLATE, "Service", "Environment"))
    drain_s = float(environment["ORTSERVE_SHUTDOWN_GRACE_S"])
    (timeout,) = unit_values(TEMPLATE, "Service", "TimeoutStopSec")
    assert float(timeout) > drain_s
    assert unit_values(TEMPLATE, "Service", "KillSignal") == ["SIGTERM"]


def test_instances_and_pull_share_one_user_and_cache() -> None:
    for key in ("DynamicUser", "User", "CacheDirectory"):
        assert unit_values(TEMPLATE, "Service", key) == unit_values(PULL, "Service", key), key
    assert unit_values(TEMPLATE, "Service", "DynamicUser") == ["yes"]
    template_env = dict(v.split("=", 1) for v in unit_values(TEMPLATE, "Service", "Environment"))
    pull_env = dict(v.split("=", 1) for v in unit_values(PULL, "Service", "Environment"))
    assert template_env["ORTSERVE_CACHE_DIR"] == pull_env["ORTSERVE_CACHE_DIR"] == "%C/ortserve"
    assert unit_values(TEMPLATE, "Service", "ExecStart")[0].split()[0] == unit_values(PULL, "Service", "ExecStart")[
        0
    ].split()[0]


def test_gpu_devices_only_and_hardening() -> None:
    service = dict(unit_entries(TEMPLATE)["Service"])
    assert service["DevicePolicy"] == "closed"
    assert set(unit_values(TEMPLATE, "Service", "DeviceAllow")) == {"/dev/kfd rw", "char-drm rw"}
    assert set(service["SupplementaryGroups"].split()) == {"video", "render"}
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert service[key] == value, key
    # PrivateDevices=yes would hide /dev/kfd and /dev/dri from the server.
    assert "PrivateDevices" not in service
