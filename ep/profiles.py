"""Device profiles: one class per device family (vLLM's ``platforms/`` are the model) holding every per-device default
of the engine. A profile is built once from what ep/ reports of the selected device (``ep.device.SelectedDevice``,
whose ``profile`` it is; ``CpuProfile(None)`` for the plain CPU session) and ``engine.placement`` asks it.

Adding a device is adding one class here and its entry in ``FAMILIES``. Provider names are compared here and in
``ep.names`` only (tests/unit/ep/test_provider_names.py keeps it so).

Pure Python: imports ep.names and ep.addressing only (ep.device, ep.flags, ep.providers and ep.host_memory import
this module); no onnxruntime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ep.addressing import Addressing
from ep.names import (
    AUTO_ORDER,
    EpOptionError,
    is_auto,
    normalize_provider,
    same_provider,
)

# NOTE(engine): the opaque memories whose buffers bind as a prefix of their rows (the handle with a smaller first
# dimension) and take the ScatterND row copy: measured on the WebGPU plugin EP (onnxruntime-ep-webgpu 0.4.0).
PREFIX_VIEW_MEMORY = frozenset({"webgpu_buf", "webgpu_buffer"})
# NOTE(server): the device step of a batch is a few ms; the event loop's work for its outputs (detokenizing,
# SSE events) can take longer. With Python's 5 ms switch interval the engine thread, back from a step, waited up to
# 5 ms for the loop to yield before it could sample and launch the next step; at 0.5 ms it waits less than that.
DEVICE_SWITCH_INTERVAL_MS = 0.5
DEFAULT_PREFILL_BUDGET = 256  # tokens an engine step runs (decode + prompt chunks) unless the device says otherwise
# Backend env flags (ep.flags declares and applies them) that a family's backend reads.
MIGRAPHX_INT4_GEMV_FLAG = "MIGRAPHX_ENABLE_INT4_GEMV"
CUDA_INT4_GEMM_FLAG = "ORT_FPA_INTB_GEMM"
# Captured decode steps run each MatMulNBits over groups of at most this many rows (engine.graph_capture).
MATMUL_GROUP_ROWS = 3

WEBGPU_GRAPH_CAPTURE_OPTION = "enableGraphCapture"  # lands as ep.webgpuexecutionprovider.enableGraphCapture
CUDA_GRAPH_OPTION = "enable_cuda_graph"
# NOTE(ep): Dawn's API validation costs over a third of a 1B model's decode step (docs/perf/GPU.md); the engine's
# kernels come from ORT, so it is off unless asked for
# (--ep-option validationMode=basic).
WEBGPU_DEFAULT_OPTIONS = {"validationMode": "disabled"}
# NOTE(engine): the CUDA EP's attention kernels for prompt chunks (its sdpa_kernel option, a bitmask of
# onnxruntime's AttentionBackend: flash 1 | memory-efficient 2 | unfused 16). Unpinned, GroupQueryAttention prefers
# cuDNN's SDPA on SM >= 90, whose plan is built per new (chunk length, past length): tens of ms each time a prompt chunk
# met a new pair (docs/perf/GPU.md "Fifth pass"), where chunks vary by design.
# Decode steps keep the default: their shapes are fixed and captured.
PROMPT_SDPA_KERNEL = "19"
# The dtypes a GGUF converts to (engine.builder.graph.DTYPES): activations and KV; logits stay float32.
MODEL_DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True)
class SessionSetup:
    """What a profile adds to a session: provider options, session-config entries, memory patterns on or off."""

    options: dict[str, str]
    entries: dict[str, str]
    mem_pattern: bool = True
    note: str = ""  # logged at INFO when set


def genai_provider_options(genai_config: Mapping[str, Any], provider: str) -> dict[str, str]:
    """The provider options genai_config declares for ``provider``.

    genai_config's ``model.decoder.session_options.provider_options`` is a list of one-key dicts keyed by a
    provider name in any spelling, e.g. ``[{"webgpu": {"enableGraphCapture": "1"}}]``.
    """
    session_options = genai_config.get("model", {}).get("decoder", {}).get("session_options", {}) or {}
    options: dict[str, str] = {}
    for entry in session_options.get("provider_options", []) or []:
        for name, values in dict(entry).items():
            if same_provider(name, provider):
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


def default_row_groups(max_batch: int) -> int:
    """The row split for a captured step of at most ``max_batch`` rows: every row on the small-M path up to 9 rows
    (docs/perf/GPU.md, 1B INT4: bucket 4 2.6x and bucket 8 1.8x faster, bucket 2 10% slower); none beyond (bucket
    16 took 1.5x as long split: the tiled kernel's cost hardly grows with M, so a few small groups beside it
    only add)."""
    if max_batch <= MATMUL_GROUP_ROWS or max_batch > 3 * MATMUL_GROUP_ROWS:
        return 0
    return -(-max_batch // MATMUL_GROUP_ROWS) - 1


def _never() -> bool:
    return False


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


class DeviceProfile:
    """The generic profile: an EP this project has no family for (the whole-buffer path works on any device), and
    the base of the families.

    Class attributes are the family's facts, known before a device is selected; properties read the device.

    Args:
        selected: the ``ep.device.SelectedDevice`` (None: the plain CPU session, no ep/ device).
        int4_gemm_on: whether sessions made from now on take the fused INT4 GEMM kernels
            (``ep.flags.cuda_int4_gemm_on``; read when asked, as the environment may change around a session).
    """

    family = "generic"
    # the engine core in a process of its own (``engine.core_client.use_engine_process``)
    engine_process = True
    env_flags: frozenset[str] = frozenset()  # the backend env flags (ep.flags) this family's backend reads
    engine_capture = False  # the engine drives the EP's graph capture (rewritten decode graph, fixed buffers)
    row_summary = False  # captured decode steps also give each row's argmax and log-normalizer on the device
    batched_prompts = False  # new prompts run together (where a run's cost is its launches, not its compute)
    prompt_shapes = False  # batched prompt runs take fixed widths, warmed at load
    split_matmul_rows = False  # captured steps split MatMulNBits into small-M row groups
    prompt_sdpa_kernel: str | None = None  # the attention kernels of prompt chunks' sessions (sdpa_kernel option)
    hip_host_memory = False  # decode inputs fall back to hipHostMalloc'd memory (hip-python)
    cpu_ep = False  # the CPU EP itself: no OrtEpDevice memory infos, its memory the host's (id 0)
    # NOTE(builder): the dtype `serve` and `pull` convert a GGUF to for this family (--dtype overrides): float32
    # where the family is not known to run float16 kernels well (the generic EP, the CPU, OpenVINO).
    model_dtype = "float32"

    def __init__(self, selected: Any = None, int4_gemm_on: Callable[[], bool] = _never) -> None:
        self.selected = selected
        self._int4_gemm_on = int4_gemm_on

    def __repr__(self) -> str:
        name = self.selected.ep_name if self.selected is not None else "plain CPU session"
        return f"{type(self).__name__}({name})"

    # -- what the device offers ----------------------------------------------------------------------------

    @property
    def kv_rows(self) -> str:
        """How one KV row in the device's DEFAULT memory is bound (``ep.addressing``): host | pointer | opaque."""
        return str(self.selected.kv_addressing) if self.selected is not None else str(Addressing.HOST)

    @property
    def prefix_views(self) -> bool:
        """Opaque buffers bind as a prefix of their rows, and rows copy on the device."""
        if self.selected is None or self.selected.default_memory is None:
            return True
        return self.selected.default_memory.name.lower() in PREFIX_VIEW_MEMORY

    @property
    def host_accessible(self) -> bool:
        """The device offers HOST_ACCESSIBLE memory (for the decode inputs)."""
        return self.selected is not None and self.selected.host_accessible_memory is not None

    @property
    def host_accessible_inputs(self) -> bool:
        """Decode inputs (and a row runner's logits) go to host-accessible memory through ep.host_memory, which
        falls back to ordinary buffers; False: ordinary buffers at once."""
        return self.selected is not None

    @property
    def int4_gemm(self) -> bool:
        """The family's fused INT4 GEMM kernels are on for sessions made now."""
        return False

    @property
    def fixed_chunk_shapes(self) -> bool:
        """Prompt chunks and draft checks run as pieces of fixed lengths (``engine.row_chunks.chunk_pieces``)."""
        return False

    @property
    def prefill_budget(self) -> int:
        """The engine step's token budget (decode tokens + prompt chunks) when none is asked for."""
        return DEFAULT_PREFILL_BUDGET

    @property
    def one_row_session(self) -> bool:
        """Captured one-row decode steps get a session of their own without the fused INT4 kernels."""
        return False

    @property
    def share_weights(self) -> bool:
        """The decoder's sessions share one device copy of its weights (``engine.shared_weights``): where the engine
        opens the decoder more than once, its captured decode graph beside the plain one, on pointer rows."""
        return self.engine_capture and self.kv_rows == Addressing.POINTER

    @property
    def switch_interval_ms(self) -> float | None:
        """The interpreter's thread switch interval once the model is loaded (None: Python's own)."""
        return DEVICE_SWITCH_INTERVAL_MS if self.kv_rows != Addressing.HOST else None

    @property
    def device_type(self) -> str:
        """The device type a session allocates on (``InferenceSession.create_ortvalue_from_shape_and_type``)."""
        return self.selected.record.device_type.lower()

    def memory_device(self) -> tuple[Any, ...]:
        """``onnxruntime.OrtDevice.make`` arguments of the DEFAULT memory: the hardware's type with the memory info's
        device id and vendor (what ORT keys a plugin EP's allocations by; "cuda" alone would say NVIDIA)."""
        mem = self.selected.default_memory
        return self.device_type, int(mem.device_id), int(mem.device_vendor_id)

    def ep_graphs(self, genai_config: Mapping[str, Any], ep_options: Mapping[str, str] | None = None) -> bool:
        """The EP captures decode steps as device graphs by its own session config (not the engine's capture)."""
        return False

    # -- engine settings -----------------------------------------------------------------------------------

    def resolve(self, config: Any) -> Any:
        """``config`` (an ``engine.config.EngineConfig``) with its device-dependent None fields decided: the one
        place they are. ``graph_capture`` None stays (auto: tried at load, dropped if the graph or the first run
        can't); ``engine_process`` is decided before a device is chosen (``engine_process_default``)."""
        return dataclasses.replace(
            config,
            matmul_row_groups=_pick(config.matmul_row_groups,
                                   default_row_groups(config.max_batch) if self.split_matmul_rows else 0),
            device_row_summary=_pick(config.device_row_summary, self.row_summary),
            fixed_chunk_shapes=_pick(config.fixed_chunk_shapes, self.fixed_chunk_shapes),
            prefill_chunk=_pick(config.prefill_chunk, max(self.prefill_budget, config.max_batch + 1)),
            batched_prompts=_pick(config.batched_prompts, self.batched_prompts),
            # NOTE(engine): True does not force it: it applies only where the fused kernels are on
            one_row_session=config.one_row_session is not False and self.one_row_session,
            share_weights=_pick(config.share_weights, self.share_weights))

    # -- sessions ------------------------------------------------------------------------------------------

    def session_setup(self, options: dict[str, str], genai_config: Mapping[str, Any], *,
                      input_names: Sequence[str] | None, output_names: Sequence[str] | None,
                      graph_capture: bool) -> SessionSetup:
        """The provider options and session-config entries of a session on this device (``options``: genai's and
        --ep-option's, changed in place)."""
        note = f"graph capture is only wired for WebGPU and CUDA here; {self.selected.ep_name} runs without it" \
            if graph_capture else ""
        return SessionSetup(options, {}, note=note)


class CpuProfile(DeviceProfile):
    """The CPU EP: host KV rows, no capture, the engine in the server's process (measured on 2 shared cores: no
    faster, docs/perf/cpu.md "The engine in its own process")."""

    family = "cpu"
    engine_process = False
    cpu_ep = True

    @property
    def host_accessible_inputs(self) -> bool:
        # NOTE(lead): keyed on what the device offers: a CPU allocator registered as HOST_ACCESSIBLE (the stand-in)
        return self.host_accessible


class CudaProfile(DeviceProfile):
    """NVIDIA's CUDA EP: pointer rows, CUDA graphs driven by the engine, the fused INT4 GEMM (ORT_FPA_INTB_GEMM)."""

    family = "cuda"
    env_flags = frozenset({CUDA_INT4_GEMM_FLAG})
    model_dtype = "float16"  # half the KV and activation bytes; tensor-core GEMMs
    engine_capture = True
    # NOTE(engine): measured on CUDA; WebGPU's reductions over 128k logits cost 1.8 ms a step
    row_summary = True
    # NOTE(engine): where a run's cost is its launches (CUDA), not its compute (the CPU); runs of fixed widths
    batched_prompts = True
    prompt_shapes = True
    prompt_sdpa_kernel = PROMPT_SDPA_KERNEL

    @property
    def int4_gemm(self) -> bool:
        return self._int4_gemm_on()

    @property
    def fixed_chunk_shapes(self) -> bool:
        # NOTE(engine): the first run of a new length costs over 10x a later one (engine.row_chunks.chunk_pieces); only beside the
        # fused INT4 kernels: with ORT's own MatMulNBits kernels (onnxruntime-gpu 1.31.1) pieces of 14-16
        # tokens after a past gave greedy tokens unlike the CPU EP's from the 6th on
        # (tests/integration/ep/test_cuda_engine.py, exact chunks and the fused kernels both match)
        return self.int4_gemm

    @property
    def one_row_session(self) -> bool:
        # NOTE(engine): the fused kernels' one-row GEMV is slower than ORT's own, their batched GEMM
        # faster (docs/perf/GPU.md) (engine.placement._one_row_session)
        return self.int4_gemm

    def session_setup(self, options, genai_config, *, input_names, output_names, graph_capture):
        if graph_capture:
            options[CUDA_GRAPH_OPTION] = "1"  # one graph per gpu_graph_id (the engine's decode buckets)
        return SessionSetup(options, {})


class HipProfile(DeviceProfile):
    """AMD GPUs under MIGraphX: pointer rows (hipMalloc) on Linux, HIP graphs captured by the EP's own session
    config, decode inputs in host-accessible memory (hipHostMalloc through hip-python as the fallback), logits to
    the CPU, MIGRAPHX_ENABLE_INT4_GEMV."""

    family = "hip"
    env_flags = frozenset({MIGRAPHX_INT4_GEMV_FLAG})
    model_dtype = "float16"
    hip_host_memory = True
    model_arch_option = False  # the AMDGPU umbrella EP's model_arch provider option

    def ep_graphs(self, genai_config, ep_options=None):
        return hip_graph_enabled(genai_config, ep_options)

    def session_setup(self, options, genai_config, *, input_names, output_names, graph_capture):
        # NOTE(ep): genai's opt-out of graph capture is a provider option the EP itself does not know.
        hip_graph = options.pop("enable_graph_capture", "1") != "0"
        entries = amdgpu_session_entries(genai_config, input_names=input_names, output_names=output_names,
                                         hip_graph=hip_graph)
        if self.model_arch_option:
            options.setdefault("model_arch", str(genai_config.get("model", {}).get("type", "")))
        return SessionSetup(options, entries)


class AmdgpuProfile(HipProfile):
    """The AMDGPU umbrella plugin EP (names amdgpu / AMDGPU / AMDGPUExecutionProvider): the HIP family, and the model
    type as its model_arch provider option."""

    model_arch_option = True


class WebGpuProfile(DeviceProfile):
    """The WebGPU plugin EP: opaque buffers bound by prefix (buckets, staged prompt chunks), the engine's graph
    capture (enableGraphCapture), MatMulNBits split into small-M row groups."""

    family = "webgpu"
    engine_capture = True
    model_dtype = "float16"
    # NOTE(engine): a staged prompt run costs 17-18 ms whatever its length up to 256 tokens, so a ~900-token prompt
    # beside 7 streams took 4 runs and 148 ms; at 512, 2 runs and 90 ms, the streams' ITL p99 35 -> 40 ms
    # (docs/perf/GPU.md, issue 38)
    prefill_budget = 512
    # NOTE(engine): measured on WebGPU's MatMulNBits; CUDA's small-M kernel has no such cliff
    split_matmul_rows = True

    @property
    def device_type(self) -> str:
        return "webgpu"  # NOTE(engine): the alias the WebGPU plugin's buffers were measured with

    def memory_device(self) -> tuple[Any, ...]:
        return self.device_type, self.selected.device_id

    def session_setup(self, options, genai_config, *, input_names, output_names, graph_capture):
        for key, value in WEBGPU_DEFAULT_OPTIONS.items():
            options.setdefault(key, value)
        if graph_capture:
            options[WEBGPU_GRAPH_CAPTURE_OPTION] = "1"
            return SessionSetup(options, {}, mem_pattern=False)  # capture replays fixed buffers; ORT refuses patterns
        options.pop(WEBGPU_GRAPH_CAPTURE_OPTION, None)
        return SessionSetup(options, {})


class OpenVinoProfile(DeviceProfile):
    """The OpenVINO plugin EP: often on the host CPU (host KV rows), so the engine stays in the server's process."""

    family = "openvino"
    engine_process = False


# Short provider name -> its family. A name without an entry gets the generic profile.
FAMILIES: dict[str, type[DeviceProfile]] = {
    "cpu": CpuProfile, "cuda": CudaProfile, "amdgpu": AmdgpuProfile, "migraphx": HipProfile,
    "webgpu": WebGpuProfile, "openvino": OpenVinoProfile,
}


def profile_class(provider: str) -> type[DeviceProfile] | None:
    """The family of ``provider`` (any spelling); None for ``auto``, whose family is known once a device is chosen."""
    key = normalize_provider(provider, allow_auto=True)
    return None if is_auto(key) else FAMILIES.get(key, DeviceProfile)


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model is converted to and served in, and why (the start-up line says both)."""

    dtype: str
    reason: str

    def describe(self) -> str:
        return f"model dtype {self.dtype} ({self.reason})"


def dtype_requested(requested: str | None) -> bool:
    """Whether --dtype names a dtype (so the device need not be known): not None and not "auto"."""
    return requested not in (None, "auto")


def choose_dtype(family: type[DeviceProfile], requested: str | None = None, device: str = "") -> DtypeChoice:
    """The model dtype for a device of ``family``: ``requested`` (--dtype) when given, else the family's.

    Args:
        family: the device's profile class (``profile_class``, or the one auto selected).
        requested: "float32", "float16", or None/"auto" for the device's choice.
        device: how the device was chosen, for the reason (e.g. "--provider auto selected CUDAExecutionProvider").
    Raises:
        ValueError: ``requested`` is not a dtype (the message names the choices).
    """
    how = f" ({device})" if device else ""
    if dtype_requested(requested):
        if requested not in MODEL_DTYPES:
            raise ValueError(f"dtype must be auto or one of {MODEL_DTYPES}, got {requested!r}")
        note = "" if requested == family.model_dtype else \
            f"; the {family.family} device{how} would take {family.model_dtype}"
        return DtypeChoice(requested, f"--dtype {requested}{note}")
    return DtypeChoice(family.model_dtype, f"the {family.family} device's default{how}; --dtype overrides it")


def make_profile(selected: Any, int4_gemm_on: Callable[[], bool] = _never) -> DeviceProfile:
    """The profile of ``selected`` (an ``ep.device.SelectedDevice``; None: the plain CPU session)."""
    if selected is None:
        return CpuProfile(None)
    return FAMILIES.get(selected.provider, DeviceProfile)(selected, int4_gemm_on)


def host_profile(provider: str) -> DeviceProfile | None:
    """The plain CPU session's profile when ``provider`` is exactly "cpu" (any case): sessions then name the CPU EP
    and ep/ selects nothing; None: the device comes from ``ep.device.select_device``."""
    return CpuProfile(None) if provider.lower() == "cpu" else None


def engine_process_default(provider: str) -> bool | None:
    """Whether the engine core runs in a process of its own by default on ``provider``; None for ``auto`` (the
    caller decides from the EP libraries installed, without loading them)."""
    family = profile_class(provider)
    return None if family is None else family.engine_process


def reads_flag(provider: str, flag: str) -> bool:
    """Whether the backend of ``provider`` (a short name; False for auto) reads the env flag ``flag``."""
    return not is_auto(provider) and flag in FAMILIES.get(provider, DeviceProfile).env_flags


def may_read_flag(provider: str, flag: str) -> bool:
    """``reads_flag``, and under auto: whether any provider auto may pick reads it."""
    candidates = AUTO_ORDER if is_auto(provider) else (provider,)
    return any(reads_flag(p, flag) for p in candidates)
