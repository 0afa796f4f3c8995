"""The dtype a model is converted to and served in, chosen from the device before this process loads any backend:
the device family's (``ep.profiles``' ``model_dtype``), or --dtype.

Under --provider auto with a device EP library installed, the device is found by ``ep.device.select_device`` in a
short-lived spawned child, so the server's process never loads a backend (the engine's process does). Imports
onnxruntime only through ep.device, lazily.
"""

from __future__ import annotations

import functools
import logging

from ep.names import AUTO_ORDER, normalize_provider
from ep.profiles import DeviceProfile, DtypeChoice, choose_dtype, dtype_requested, profile_class

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def device_family(provider: str = "auto", selector: str | None = None,
                  ep_library: str | None = None) -> tuple[type[DeviceProfile], str]:
    """The profile class of the device ``provider`` will run on, known before this process loads any backend
    library: a named provider's family; under auto, the CPU's where no device EP library is installed, else the
    family of the device ``select_device`` picks in a short-lived child process (a backend library loads in the
    engine's process only, and the parent's choice must not load it).

    Returns:
        (the profile class, how the device was chosen: for the start-up line).
    """
    from ep.device import find_ep_libraries  # (locates library files; loads none)

    provider = normalize_provider(provider, allow_auto=True)
    family = profile_class(provider)
    if family is not None:
        return family, f"--provider {provider}"
    if not ep_library and not find_ep_libraries(AUTO_ORDER):
        return profile_class("cpu"), "--provider auto, and no device EP library is installed"
    picked, what = probe_device(provider, selector, ep_library)
    if not picked:
        logger.warning("--provider auto: no device could be probed (%s); the model dtype is the generic one", what)
        return DeviceProfile, f"--provider auto (no device could be probed: {what})"
    return profile_class(picked), f"--provider auto selected {what}"


def probe_device(provider: str, selector: str | None, ep_library: str | None) -> tuple[str | None, str]:
    """``select_device`` in a spawned child process: the provider it picks (None when none) and its device's line."""
    import multiprocessing  # noqa: PLC0415

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_probe, (provider, selector, ep_library))


def _probe(provider: str, selector: str | None, ep_library: str | None) -> tuple[str | None, str]:
    """In the child: the provider ``select_device`` picks, and its device's description."""
    from ep.device import select_device
    from ep.names import EpError

    try:
        selected = select_device(provider, selector, ep_library)
    except EpError as exc:
        return None, str(exc).splitlines()[0]
    return selected.provider, selected.record.describe()


def choose_model_dtype(provider: str = "auto", selector: str | None = None, ep_library: str | None = None,
                       requested: str | None = None) -> DtypeChoice:
    """The dtype ``serve`` and ``pull`` convert a GGUF to: --dtype when given, else the device family's
    (``ep.profiles``: float16 on CUDA, MIGraphX/AMDGPU and WebGPU, float32 on the CPU).

    A given --dtype needs no device: nothing is probed then.
    """
    if dtype_requested(requested):
        family = profile_class(normalize_provider(provider, allow_auto=True)) or DeviceProfile
        return choose_dtype(family, requested, f"--provider {provider}")
    family, how = device_family(provider, selector, ep_library)
    return choose_dtype(family, None, how)
