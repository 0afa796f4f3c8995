"""deploy/nginx/ortserve.conf passes `nginx -t` (where nginx is installed: Debian package nginx-light)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy_tools import DEPLOY, nginx_main_conf

CONF = DEPLOY / "nginx" / "ortserve.conf"

needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (apt nginx-light)")


def _nginx_test(tmp_path: Path, site: Path) -> subprocess.CompletedProcess[str]:
    main = nginx_main_conf(tmp_path / "nginx", site)
    return subprocess.run(
        ["nginx", "-t", "-p", str(tmp_path / "nginx"), "-c", str(main), "-e", str(tmp_path / "nginx" / "error.log")],
        capture_output=True, text=True, timeout=60, check=False,
    )


@needs_nginx
def test_example_config_passes_nginx_t(tmp_path: Path) -> None:
    proc = _nginx_test(tmp_path, CONF)
    assert proc.returncode == 0, proc.stderr
    assert "test is successful" in proc.stderr


@needs_nginx
def test_nginx_t_rejects_a_bad_directive(tmp_path: Path) -> None:
    bad = tmp_path / "bad.conf"
    bad.write_text(CONF.read_text().replace("least_conn;", "least_connections;"))
    proc = _nginx_test(tmp_path, bad)
    assert proc.returncode != 0 and "least_connections" in proc.stderr


def test_example_streams_unbuffered_to_least_loaded_replica() -> None:
    text = CONF.read_text()
    upstream = re.search(r"upstream ortserve \{(.*?)\}", text, flags=re.S)
    assert upstream is not None
    assert re.search(r"^\s*least_conn;", upstream.group(1), flags=re.M)
    assert len(re.findall(r"^\s*server 127\.0\.0\.1:\d+", upstream.group(1), flags=re.M)) >= 2
    for directive in ("proxy_buffering off;", "proxy_http_version 1.1;", "proxy_pass http://ortserve;"):
        assert directive in text, directive


def test_example_drops_slow_clients_with_ortserve_own_timeouts() -> None:
    """The proxy times out slow headers and stalled bodies as `ortserve serve` does by default."""
    from server.settings import Settings

    text = CONF.read_text()
    for directive, field in (("client_header_timeout", "header_timeout_s"), ("client_body_timeout", "body_timeout_s")):
        default = Settings.model_fields[field].default
        assert re.search(rf"^\s*{directive} {default:g}s;", text, flags=re.M), (directive, default)
