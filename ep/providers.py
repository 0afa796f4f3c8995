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
from ep.names import MIGRAPHX_BACKED, EpOptionError, SessionCreateError, provider_of_ep_name

logger = logging.getLogger(__name__)

WEBGPU_GRAPH_CAPTURE_OPTION = "enableGraphCapture"  # lands as ep.webgpuexecutionprovider.enableGraphCapture
CUDA_GRAPH_OPTION = "enable_cuda_graph"
# NOTE(ep): Dawn's API validation costs over a third of a 1B model's decode step (docs/perf/GPU.md); the engine's kernels come from ORT, so it is off unless asked for
# (--ep-option validationMode=basic).
WEBGPU_DEFAULT_OPTIONS = {"validationMode": "disabled"}


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


def genai_provider_options(genai_config: Mapping[str, Any], provider: str) -> dict[str, str]:
    """The provider options genai_config declares for ``provider``.

    genai_config's ``model.decoder.session_options.provider_options`` is a list of one-key dicts keyed by a
    provider name in any spelling, e.g. ``[{"webgpu": {"enableGraphCapture": "1"}}]``.
    """
    session_options = genai_config.get("model", {}).get("decoder", {}).get("session_options", {}) or {}
    options: dict[str, str] = {}
    for entry in session_options.get("provider_options", []) or []:
        for name, values in dict(entry).items():
            if provider_of_ep_name(name) == provider:
                options.update({str(k): str(v) for k, v in dict(values or {}).items()})
    return options


def amdgpu_session_entries(genai_config: Mapping[str, Any], *, input_names: Sequence[str] | None = None,
                           output_names: Sequence[str] | None = None, hip_graph: bool = True) -> dict[str, str]:
    """The session-config entries the AMDGPU EP expects (as onnxruntime-genai sets them).

    The EP pads the prefill token axis of input_ids/position_ids to max_length so MIGraphX compiles one
    prefill program, slices logits back, and captures HIP graphs.

    Args:
        genai_config: the model's genai_config.json as a dict (search.max_length, decoder input/output names).
        input_names, output_names: the graph's actual names; padded names the graph lacks are left out.
        hip_graph: ep.migraphx.hip_graph_enable (genai's provider option enable_graph_capture=0 turns it off).

    Returns:
        {config key: value}, e.g. {"ep.migraphx.static_pad_seq_len": "2048", ...}.
    """
    model = genai_config.get("model", {})
    decoder = model.get("decoder", {})
    inputs = decoder.get("inputs", {})
    outputs = decoder.get("outputs", {})
    max_length = genai_config.get("search", {}).get("max_length") or model.get("context_length")
    if not max_length:
        raise EpOptionError("genai_config has neither search.max_length nor model.context_length")
    padded_inputs = [inputs.get("input_ids", "input_ids"), inputs.get("position_ids", "position_ids")]
    if input_names is not None:
        padded_inputs = [n for n in padded_inputs if n in input_names]
    logits = outputs.get("logits", "logits")
    entries = {"ep.migraphx.static_pad_seq": "1", "ep.migraphx.static_pad_seq_len": str(int(max_length)),
               "ep.migraphx.static_pad_inputs": ",".join(f"{n}:1" for n in padded_inputs)}
    if output_names is None or logits in output_names:
        entries["ep.migraphx.static_pad_outputs"] = f"{logits}:1"
    entries["ep.migraphx.hip_graph_enable"] = "1" if hip_graph else "0"
    entries["ep.directml.enable_host_accessible"] = "1"
    return entries


def hip_graph_enabled(genai_config: Mapping[str, Any], ep_options: Mapping[str, str] | None = None) -> bool:
    """Whether an AMDGPU/MIGraphX session captures HIP graphs (``ep.migraphx.hip_graph_enable``): on, unless
    genai's provider option ``enable_graph_capture=0`` (the folder's or --ep-option) turns it off."""
    options = genai_provider_options(genai_config, "amdgpu") | genai_provider_options(genai_config, "migraphx")
    options.update(ep_options or {})
    return options.get("enable_graph_capture", "1") != "0"


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
    provider = selected.provider
    options = genai_provider_options(genai_config, provider)
    options.update(ep_options or {})

    if provider in MIGRAPHX_BACKED:
        # NOTE(ep): genai's opt-out of graph capture is a provider option the EP itself does not know.
        hip_graph = options.pop("enable_graph_capture", "1") != "0"
        for key, value in amdgpu_session_entries(genai_config, input_names=input_names,
                                                 output_names=output_names, hip_graph=hip_graph).items():
            so.add_session_config_entry(key, value)
        if provider == "amdgpu":
            options.setdefault("model_arch", str(genai_config.get("model", {}).get("type", "")))
    elif provider == "webgpu":
        for key, value in WEBGPU_DEFAULT_OPTIONS.items():
            options.setdefault(key, value)
        if graph_capture:
            options[WEBGPU_GRAPH_CAPTURE_OPTION] = "1"
            so.enable_mem_pattern = False  # capture replays fixed buffers; ORT refuses memory patterns
        else:
            options.pop(WEBGPU_GRAPH_CAPTURE_OPTION, None)
    elif provider == "cuda" and graph_capture:
        options[CUDA_GRAPH_OPTION] = "1"  # one graph per gpu_graph_id (the engine's decode buckets)
    elif graph_capture:
        logger.info("graph capture is only wired for WebGPU and CUDA here; %s runs without it", selected.ep_name)

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
