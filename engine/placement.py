"""Where the engine's tensors live and which runner drives them: the one place that decides, from what the
device offers, and assembles the sessions, the KV cache and the runner.

What a device offers (its profile, ``ep.profiles``: its DEFAULT memory's addressing, its host-accessible memory,
whether the engine or the EP captures its decode steps, and every per-device default) decides the path:

| KV rows (``ep.addressing``)            | runner                                   | prefill                    |
|----------------------------------------|------------------------------------------|----------------------------|
| host (CPU EP, CPU-side plugin EPs)     | ``Runner``: row views                    | chunks in the slot's row   |
| pointer (CUDA; HIP under MIGraphX / the AMDGPU EP on Linux) | ``Runner``: rows bound by address | chunks in the slot's row |
| opaque with prefix views (WebGPU)      | ``BucketRunner``: buckets over rows [0, b) | chunks through a staging row + device row copy |
| opaque otherwise (DirectML, unknown)   | ``BucketRunner``: all rows every step    | one token per run          |
| pointer, decode steps captured as device graphs (CUDA graphs; HIP graphs on AMDGPU/MIGraphX) | ``BucketRunner``: buckets over rows [0, b), fixed buffers | chunks in the slot's row, uncaptured |

A captured device graph replays the addresses it was captured with, so where decode steps are captured (CUDA's
enable_cuda_graph, which the engine turns on when the rewritten graph allows it; the AMDGPU and MIGraphX EPs' HIP
graphs, which the seeds' session config turns on) every bucket's step is bound once to fixed buffers: the KV prefix
[0, b), device buffers for the decode inputs (uploaded from host memory before each step) and the logits (read back
after it). Prompt chunks and draft checks, whose shapes and rows vary, run uncaptured (``gpu_graph_id=-1``).

Decode inputs (and a row runner's logits) live in the device's HOST_ACCESSIBLE memory where it offers some,
written in place; logits always end on the host, where sampling runs.

Imports onnxruntime (through the runners and sessions); ep/ lazily, as the sessions do (ep.profiles, pure Python,
at once).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from engine.bucket_runner import BucketRunner, DecodePath, RowPrompts, StagedPrompts
from engine.config import DEFAULT_BATCHED_PROMPT_TOKENS, EngineConfig
from engine.device_kv import AddressRowCopier, RowCopier, address_copy_graph_bytes, row_copy_graph_bytes
from engine.graph_capture import OpenedSession, open_session
from engine.kv_cache import OPAQUE, POINTER, HostKVAllocator, KVAllocator, KVCache, KVShape, make_kv_allocator
from engine.model_loader import (
    ModelFolder, check_graph, check_memory, choose_max_model_len, create_session, select_profile,
)
from engine.model_runner import ModelRunner
from engine.runner import Runner, make_input_allocator
from engine.shared_weights import load_shared_weights, probe_sharing
from engine.types import DevicePlacement, ModelLoadError

log = logging.getLogger(__name__)

@dataclass
class Loaded:
    """A runner ready to serve, and the facts the engine reports about it."""

    runner: ModelRunner
    placement: DevicePlacement
    max_model_len: int
    vocab_size: int


class _WarmupError(Exception):
    """The auto-chosen captured decode step failed at its first run."""


def load(folder: ModelFolder, config: EngineConfig) -> Loaded:
    """Open the sessions, allocate the KV cache and build the runner for ``config`` on its device.

    Raises:
        ModelLoadError: the model can't be served on this device (ep/'s own errors propagate unchanged).
    """
    # NOTE(engine): chosen once: the default depends on the memory available now, which the session changes
    context = choose_max_model_len(folder, config, None)
    log.info("%s", context.describe())
    planned_len = context.value
    profile = select_profile(config)
    resolved = profile.resolve(config)
    share = resolved.share_weights and not probe_sharing(profile.selected)
    copies = _weight_copies(resolved, profile, share)
    # before anything loads: refused with the sizes named
    log.info("%s", check_memory(folder, context, profile, weight_copies=copies))
    weights = load_shared_weights(folder.model_file, profile.selected) if share else None
    try:
        return _load(folder, config, open_session(folder, config, planned_len, profile, weights), planned_len)
    except _WarmupError as exc:  # graph capture was auto-chosen and its first run failed: run without it
        log.warning("graph capture failed at its first run (%s); running without it", exc)
        config = dataclasses.replace(config, graph_capture=False)
        return _load(folder, config, open_session(folder, config, planned_len, profile, weights), planned_len)


def _weight_copies(config: EngineConfig, profile: Any, shared: bool) -> int:
    """How many copies of the weights the decoder's sessions will hold in the device's memory (``config``
    resolved): one per session (the captured decode graph, the plain graph for prompt chunks, the one-row
    session), or, shared, one plus the fused INT4 kernels' prepacked layout in the captured decode session."""
    if not (profile.engine_capture and profile.kv_rows == POINTER) or config.graph_capture is False:
        return 1
    if shared:
        return 1 + int(profile.int4_gemm)
    return 2 + int(_one_row_applies(config))


def _one_row_applies(config: EngineConfig) -> bool:
    """The one-row decode session is asked for (``config`` resolved) and there are rows beside the one."""
    return bool(config.one_row_session) and config.max_batch >= 2


def _load(folder: ModelFolder, config: EngineConfig, opened: OpenedSession, planned_len: int) -> Loaded:
    session, selected = opened.session, opened.selected
    io = check_graph(folder, session, packed_input=opened.packed_input)
    max_model_len = min(planned_len, io.kv_length or planned_len)  # a static KV length in the graph bounds it
    kv_length = io.kv_length or max_model_len
    if opened.graph_capture and kv_length != planned_len:
        raise ModelLoadError(f"graph capture was set up for KV length {planned_len}, the graph has {kv_length}")
    profile = opened.profile
    config = profile.resolve(config)  # the device's defaults for every None setting
    ep_graphs = profile.ep_graphs(folder.genai, config.ep_options)
    kv_shape = KVShape(folder.num_layers, config.max_batch, folder.num_kv_heads, kv_length, folder.head_size,
                       io.kv_dtype)
    allocator = make_kv_allocator(selected, session)
    if config.kv_rows == POINTER and isinstance(allocator, HostKVAllocator):
        allocator = HostKVAllocator(POINTER)  # host memory bound by address: the stand-in for CUDA/HIP rows
    kv = KVCache(kv_shape, allocator)
    fixed_shapes = config.fixed_chunk_shapes
    common = dict(prefill_chunk=config.prefill_chunk, max_position=max_model_len,
                  input_allocator=make_input_allocator(selected))
    chunks = dict(fixed_shapes=fixed_shapes and kv.row_views,
                  max_verify=config.speculative_tokens + 1 if config.speculative_tokens else 0,
                  batch_prompts=config.batched_prompts and kv.row_views,
                  prompt_shapes=fixed_shapes or profile.prompt_shapes)
    runner: ModelRunner
    if kv.addressing == POINTER:
        kv.row_copy = _address_copier(folder, config, selected, kv)
    graphs = kv.addressing == POINTER and (opened.graph_capture or ep_graphs)
    if graphs:
        prefill_session, prefill_io = _prefill_session(folder, config, opened)
        one_row = _one_row_session(folder, config, opened)
        decode = DecodePath(device_alloc=_device_alloc(selected, session), packed_input=opened.packed_input,
                            graph_ids=True, row_summary=opened.row_summary,
                            bucket_sessions={1: one_row} if one_row else None)
        runner = BucketRunner(session, io, kv, **common, decode=decode,
                              prompts=RowPrompts(prefill_session, prefill_io, **chunks))
        kind = "buckets (pointer, captured steps" + (", one row on its own session)" if one_row else ")")
    elif kv.row_views and config.kv_rows != OPAQUE:
        runner = Runner(session, io, kv, **common, **chunks)
        kind = f"rows ({kv.addressing})"
    else:
        # NOTE(engine): kv_rows="opaque" on host KV runs the opaque path with host buffers (its CPU stand-in)
        prefix = profile.prefix_views or kv.addressing != OPAQUE
        decode = DecodePath(buckets=prefix,
                            device_alloc=_device_alloc(selected, session) if opened.graph_capture else None,
                            packed_input=opened.packed_input, graph_ids=opened.graph_capture,
                            row_summary=opened.row_summary and opened.graph_capture)
        prompts = _staged_prompts(folder, config, opened, kv_shape, allocator) if prefix else None
        runner = BucketRunner(session, io, kv, **common, decode=decode, prompts=prompts)
        kind = "buckets" if prefix else "whole buffer"
    runner.prompt_budget = batched_prompt_tokens(config, runner)  # (its prompt runs' shapes are warmed below)
    if selected is not None:
        try:  # compile the kernels (and capture the decode steps) before the first request
            runner.warmup()
        except Exception as exc:  # noqa: BLE001 - ORT raises several pybind classes
            if opened.graph_capture and config.graph_capture is None:
                raise _WarmupError(f"{type(exc).__name__}: {exc}") from exc
            raise ModelLoadError(f"the first run on {selected.ep_name} failed: {exc}") from exc
    placement = DevicePlacement(
        provider=selected.provider if selected is not None else "cpu",
        ep_name=selected.ep_name if selected is not None else "CPUExecutionProvider",
        device_id=selected.device_id if selected is not None else 0,
        kv_cache="host" if kv.addressable else "device", decode_inputs=runner.input_source,
        logits=runner.logits_source, whole_buffer=runner.whole_buffer,
        graph_capture=opened.graph_capture or graphs, kv_rows=kv.addressing, runner=kind,
        switch_interval_ms=profile.switch_interval_ms,
        graph_capture_note=opened.note if opened.graph_capture or not ep_graphs else
        "on: the EP's HIP graphs (ep.migraphx.hip_graph_enable), one per decode bucket at fixed addresses")
    log.info("placement: %s", placement)
    return Loaded(runner, placement, max_model_len, io.vocab_size)


def batched_prompt_tokens(config: EngineConfig, runner: Any) -> int:
    """Tokens of new requests' whole prompts a step runs together beside its token budget (0: none; see
    ``EngineConfig.batched_prompt_tokens``)."""
    if not runner.can_batch_prompts:
        return 0
    return DEFAULT_BATCHED_PROMPT_TOKENS if config.batched_prompt_tokens is None else config.batched_prompt_tokens


def _address_copier(folder: ModelFolder, config: EngineConfig, selected: Any, kv: KVCache) -> AddressRowCopier:
    """Row copies between slots of pointer-addressed KV: a session of Identity nodes on the KV's device."""
    s = kv.shape
    graph = address_copy_graph_bytes(len(kv.buffers), s.dtype, (1, s.num_kv_heads, s.length, s.head_size))
    copy_session, _ = create_session(folder, config, selected=selected, model_bytes=graph)
    return AddressRowCopier(copy_session, kv)


def _prefill_session(folder: ModelFolder, config: EngineConfig, opened: OpenedSession) -> tuple[Any, Any]:
    """The session prompt chunks run on and its names (None: the decoder's): the decoder itself, unless its graph
    was rewritten for captured steps, which run S = 1 only; then a session of the plain graph (on CUDA with its
    attention kernels pinned to the profile's ``prompt_sdpa_kernel`` unless --ep-option sets sdpa_kernel)."""
    if not (opened.graph_capture or opened.packed_input):
        return opened.session, None
    kernel = opened.profile.prompt_sdpa_kernel
    if kernel is not None and "sdpa_kernel" not in config.ep_options:
        config = dataclasses.replace(config, ep_options={**config.ep_options, "sdpa_kernel": kernel})
    session, _ = create_session(folder, config, selected=opened.selected, weights=opened.weights)
    return session, check_graph(folder, session)


def _one_row_session(folder: ModelFolder, config: EngineConfig, opened: OpenedSession) -> Any | None:
    """The one-row decode step's session: the captured decode graph once more, made without the fused INT4 kernels
    (``EngineConfig.one_row_session``, on where the profile says: CUDA with ORT_FPA_INTB_GEMM); None where it does
    not apply or is turned off.

    NOTE(engine): ORT_FPA_INTB_GEMM is read by each MatMulNBits kernel as its session is made, so one process holds
    sessions of both kinds. Measured (synthetic 1B, captured steps; ep/flags.py, docs/perf/GPU.md): the fused kernels
    make 1 row 18% slower, 8 rows 32% and 64 rows 12% faster. One session can only have one or the other.
    """
    from ep.flags import cuda_int4_gemm_off

    if not _one_row_applies(config) or not opened.graph_capture:  # (resolved by the profile)
        return None
    try:
        with cuda_int4_gemm_off():
            session, _ = create_session(folder, config, selected=opened.selected, graph_capture=True,
                                        model_bytes=opened.model_bytes, weights=opened.weights)
    except ModelLoadError as exc:  # e.g. no room for its activations and graphs: serve without it
        log.warning("no one-row decode session (%s); one-row steps take the fused INT4 kernels", exc)
        return None
    log.info("one-row decode steps on a session without the fused INT4 kernels (ORT_FPA_INTB_GEMM=0 for it)")
    return session


def _device_alloc(selected: Any, session: Any):
    from ep import host_memory

    def alloc(shape: tuple[int, ...], dtype: Any) -> Any:
        return host_memory.alloc_device(shape, dtype, selected, session=session, zero=True)
    return alloc


def _staged_prompts(folder: ModelFolder, config: EngineConfig, opened: OpenedSession, kv_shape: KVShape,
                    allocator: KVAllocator) -> StagedPrompts:
    """A one-slot staging KV, a row copier and the prefill session for chunked prefill over buffers bound by
    prefix (``BucketRunner``)."""
    selected = opened.selected
    copy_bytes = row_copy_graph_bytes(2 * kv_shape.num_layers, kv_shape.dtype, kv_shape.num_kv_heads, kv_shape.length)
    copy_session, _ = create_session(folder, config, selected=selected, model_bytes=copy_bytes)
    prefill_session, prefill_io = _prefill_session(folder, config, opened)
    if isinstance(allocator, HostKVAllocator):
        allocator = HostKVAllocator()  # the staging row is bound whole: host addressing is enough
    staging = KVCache(dataclasses.replace(kv_shape, num_slots=1), allocator)
    log.info("chunked prefill through a staging row and device row copies (%s)",
             selected.ep_name if selected is not None else "CPUExecutionProvider")
    return StagedPrompts(staging, RowCopier(copy_session, 2 * kv_shape.num_layers), prefill_session, prefill_io)
