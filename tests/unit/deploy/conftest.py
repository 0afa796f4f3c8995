"""Fixtures for the static deploy/ checks: the overlays rendered once per session."""

from __future__ import annotations

from typing import Any

import pytest

from deploy_tools import K8S, OVERLAYS, kustomize


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Each overlay (and the base) rendered once per session: name -> objects."""
    out = {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}
    out["base"] = kustomize(K8S / "base")
    return out
