"""Provider names, the auto-selection order and the device layer's error classes.

Pure Python: no onnxruntime import, so the CLI can validate ``--provider`` before any backend loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Short name -> the EP name ONNX Runtime uses (OrtEpDevice.ep_name, InferenceSession.get_providers()).
EP_NAMES: dict[str, str] = {
    "amdgpu": "AMDGPUExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
KNOWN_PROVIDERS: tuple[str, ...] = tuple(EP_NAMES)

# NOTE(ep): `--provider auto` takes the first of these that has a device. OpenVINO is never picked
# automatically: on a CPU it competes with the CPU EP and is asked for by name only.
# CUDA before WebGPU: on an NVIDIA GPU with both installed, the CUDA EP serves 2-3x the tokens/s (docs/perf/GPU.md).
AUTO_ORDER: tuple[str, ...] = ("amdgpu", "migraphx", "cuda", "webgpu", "cpu")

# Providers whose backend is MIGraphX: the INT4 GEMV flag and the ep.migraphx.* entries are for them.
MIGRAPHX_BACKED: frozenset[str] = frozenset({"amdgpu", "migraphx"})
AUTO = "auto"  # --provider auto: the first of AUTO_ORDER with a device
ALL = "all"  # every known provider (``ortserve devices``)

_SUFFIX = "executionprovider"


class EpError(Exception):
    """Base of the device layer's startup errors; the message is meant for the user as it is.

    The CLI maps any ``EpError`` to a one-line message and a non-zero exit code.
    """


class UnknownProviderError(EpError, ValueError):
    """A provider name that is not one of KNOWN_PROVIDERS (or "auto" where allowed)."""


class EpLibraryError(EpError):
    """A plugin EP library could not be found or registered; says which path and why."""


class DeviceNotFoundError(EpError, LookupError):
    """No EP device matches the provider and selector; the message lists the devices that exist."""


class EpOptionError(EpError, ValueError):
    """A malformed ``--ep-option`` (expects key=value)."""


class SessionCreateError(EpError):
    """ONNX Runtime refused to create a session for the model on the selected EP."""


class MemoryUnavailableError(EpError):
    """The selected device offers no memory of the asked kind (e.g. no DEFAULT memory info)."""


def normalize_provider(name: str, *, allow_auto: bool = False) -> str:
    """Map any spelling of a provider to its short name.

    Lower-cases, strips a trailing "executionprovider" and any ".SUFFIX" an EP adds to its name
    (OpenVINO registers "OpenVINOExecutionProvider.AUTO" and the like).

    Args:
        name: e.g. "AMDGPU", "amdgpu", "AMDGPUExecutionProvider", "WebGpuExecutionProvider".
        allow_auto: accept "auto" and return it unchanged.

    Returns:
        One of KNOWN_PROVIDERS (or "auto").

    Raises:
        UnknownProviderError: the name is none of them; the message lists the known names.

    >>> normalize_provider("AMDGPUExecutionProvider")
    'amdgpu'
    """
    key = str(name).strip().lower().split(".", 1)[0]
    if key.endswith(_SUFFIX) and key != _SUFFIX:
        key = key[: -len(_SUFFIX)]
    if allow_auto and key == "auto":
        return "auto"
    if key not in EP_NAMES:
        known = ", ".join((("auto",) if allow_auto else ()) + KNOWN_PROVIDERS)
        raise UnknownProviderError(f"unknown provider {name!r}; known providers: {known}")
    return key


def is_auto(provider: str) -> bool:
    """Whether ``provider`` (a short name) is ``auto``, not yet one provider."""
    return provider == AUTO


def expand_providers(provider: str) -> tuple[str, ...]:
    """The short names ``provider`` stands for: every known one for ``all``, AUTO_ORDER for ``auto``, else itself.

    ``provider``: "all", "auto" or any spelling of a known provider.
    """
    if str(provider).strip().lower() == ALL:
        return KNOWN_PROVIDERS
    key = normalize_provider(provider, allow_auto=True)
    return AUTO_ORDER if key == AUTO else (key,)


def selects(requested: str, provider: str) -> bool:
    """Whether ``--provider requested`` (a short name or "auto") may end on ``provider`` (a short name)."""
    return requested == AUTO or requested == provider


def same_provider(name: str, provider: str) -> bool:
    """Whether ``name`` (any spelling, e.g. a genai_config key) names ``provider`` (a short name)."""
    return provider_of_ep_name(name) == provider


def needs_library(provider: str) -> bool:
    """Whether ``provider`` (a short name) comes from a library that must be found (not auto, not the CPU EP)."""
    return provider not in (AUTO, "cpu")


def matching(records: Sequence[Any], provider: str) -> list[Any]:
    """The device records (``.ep_name``, ``.provider``) of ``provider`` (a short name): those whose EP name is exactly
    the provider's, else any whose EP name normalizes to it (e.g. "OpenVINOExecutionProvider.AUTO")."""
    exact = [r for r in records if r.ep_name == EP_NAMES[provider]]
    return exact or [r for r in records if r.provider == provider]


def provider_of_ep_name(ep_name: str) -> str | None:
    """The short name of an EP name ORT reports, or None for an EP this project does not know."""
    try:
        return normalize_provider(ep_name)
    except UnknownProviderError:
        return None
