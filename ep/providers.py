"""Session options per provider: the AMDGPU/MIGraphX entries, WebGPU graph capture, user provider options.

Imports onnxruntime; never imports engine/ or server/ (they call this).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnxruntime as ort

from ep.device import SelectedDevice
from ep.names import EpOptionError, SessionCreateError
from ep.profiles import (  # noqa: F401 - the per-family session setup lives with the profiles; named here too
    CUDA_GRAPH_OPTION, WEBGPU_DEFAULT_OPTIONS, WEBGPU_GRAPH_CAPTURE_OPTION, amdgpu_session_entries,
    genai_provider_options, hip_graph_enabled,
)

logger = logging.getLogger(__name__)


def parse_ep_options(items: Iterable[str] | None) -> dict[str, str]:
    """Parse repeated ``--ep-option key=value`` flags; a later key wins.

    Raises:
        EpOptionError: an item without "=" or with an empty key.
    """
    options: dict[str, str] = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise EpOptionError(f"--ep-option {item!r}: expected key=value (e.g. --ep-option enableGraphCapture=1)")
        options[key.strip()] = value.strip()
    return options


def make_session_options(
    selected: SelectedDevice,
    genai_config: Mapping[str, Any],
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    ep_options: Mapping[str, str] | None = None,
    intra_op_threads: int | None = None,
    graph_capture: bool = False,
) -> ort.SessionOptions:
    """Build the SessionOptions for ``selected``: EP, its options and the session-config entries.

    Plugin EPs are added with ``SessionOptions.add_provider_for_devices([ep_device], options)``; the plain
    CPU EP needs nothing. Provider options: genai_config's, then ``ep_options`` (--ep-option) on top.

    Args:
        selected: from ``ep.device.select_device``.
        genai_config: the model's genai_config.json as a dict.
        input_names, output_names: the graph's names (filter the AMDGPU padding entries); None = trust config.
        ep_options: parsed --ep-option pairs.
        intra_op_threads: CPU threads for the CPU EP (and CPU fallback nodes); None = ORT's default.
        graph_capture: WebGPU: enableGraphCapture=1 and memory patterns off; CUDA: enable_cuda_graph=1. The
            caller must then bind fixed device buffers for every input and output (see ep.host_memory.alloc_device).

    Returns:
        The SessionOptions, ready for ``create_session``.
    """
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    decoder_opts = genai_config.get("model", {}).get("decoder", {}).get("session_options", {}) or {}
    threads = intra_op_threads if intra_op_threads is not None else decoder_opts.get("intra_op_num_threads")
    if threads:
        so.intra_op_num_threads = int(threads)
    if decoder_opts.get("log_id"):
        so.logid = str(decoder_opts["log_id"])
    options = genai_provider_options(genai_config, selected.provider)
    options.update(ep_options or {})
    setup = selected.profile.session_setup(options, genai_config, input_names=input_names,
                                           output_names=output_names, graph_capture=graph_capture)
    for key, value in setup.entries.items():
        so.add_session_config_entry(key, value)
    if not setup.mem_pattern:
        so.enable_mem_pattern = False
    if setup.note:
        logger.info("%s", setup.note)
    options = setup.options

    if selected.ep_device is not None:
        so.add_provider_for_devices([selected.ep_device], dict(options))
        logger.info("session: %s with options %s", selected.ep_name, options or "{}")
    elif options:
        logger.warning("CPU EP: ignoring provider options %s", options)
    return so


def create_session(model_file: str | os.PathLike[str] | bytes, selected: SelectedDevice,
                   session_options: ort.SessionOptions) -> ort.InferenceSession:
    """Create the InferenceSession on the selected device.

    ``model_file`` may also be a serialized model (bytes); its external data is then found through the
    session config entry ``session.model_external_initializers_file_folder_path``.

    Raises:
        SessionCreateError: ORT refused the model or the EP; the message names both.
    """
    model = model_file if isinstance(model_file, bytes) else str(model_file)
    if isinstance(model_file, bytes):
        model_file = f"<{len(model_file)}-byte model>"  # for the error message
    try:
        if selected.ep_device is None:
            session = ort.InferenceSession(model, sess_options=session_options,
                                           providers=["CPUExecutionProvider"])
        else:
            session = ort.InferenceSession(model, sess_options=session_options)
    except Exception as e:  # noqa: BLE001 - ORT raises several pybind classes; keep the cause chained
        raise SessionCreateError(f"cannot create a session for {model_file} on {selected.ep_name}: {e}") from e
    providers = session.get_providers()
    if selected.ep_name not in providers:
        logger.warning("session providers %s do not include the selected %s", providers, selected.ep_name)
    logger.info("session on %s (device id %d): providers %s", selected.ep_name, selected.device_id, providers)
    return session
