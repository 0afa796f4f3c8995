"""ortserve's HTTP layer: OpenAI-compatible FastAPI app, settings and the `ortserve` CLI (no onnxruntime)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path


def _version() -> str:
    try:
        return importlib.metadata.version("ortserve")
    except importlib.metadata.PackageNotFoundError:  # running from a checkout that is not installed
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return match.group(1) if match else "0+unknown"


__version__ = _version()
