"""The captured decode step (WebGPU and CUDA graph capture): the rewritten graph, the session choice, fixed device
buffers.

Imports onnxruntime (and onnx while rewriting); ep/ only through engine.model_loader.create_session. The
runner owns the buffers' contents; this module owns where they live and how they cross to the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.config import EngineConfig
from engine.model_loader import ModelFolder, create_session, select_profile
from engine.types import ModelLoadError
from ep.profiles import MATMUL_GROUP_ROWS  # the WebGPU profile's measured split

log = logging.getLogger(__name__)

TOTAL_LEN_NAME = "ortserve/total_sequence_length"
# The packed decode input: int32 [num_slots, 2] = (token id, seqlens_k = KV length after this token - 1) per row,
# one upload per step instead of three (each host -> WebGPU copy is a queue submission: docs/perf/GPU.md).
PACKED_INPUT = "ortserve/step"
# The decode step's row summary (``capture_graph_bytes(row_summary=True)``): per row of the step's logits, its argmax
# (int64 [num_slots, 1]) and log-normalizer log(sum(exp(logits))) (float32 [num_slots, 1]), computed on the device.
ROW_ARGMAX = "ortserve/row_argmax"
ROW_LOG_NORM = "ortserve/row_log_norm"
# ... and the log-probability of that argmax token (float32), so an all-greedy step needs no logits on the host
ROW_TOKEN_LOGPROB = "ortserve/row_token_logprob"

HOST_MEMORY = "cpu"  # OrtValue.device_name() of host memory (lower case)
# (shape, dtype) -> an OrtValue in device memory (zeroed)
DeviceAllocator = Callable[[tuple[int, ...], Any], ort.OrtValue]


@dataclass(frozen=True)
class OpenedSession:
    """The decoder session and how it runs the decode step."""

    session: ort.InferenceSession
    selected: Any  # ep.device.SelectedDevice, None on the plain CPU path
    graph_capture: bool
    note: str  # why capture is on or off (logged, and reported in DevicePlacement)
    packed_input: str | None = None  # the graph's decode inputs are packed into this one (see capture_graph_bytes)
    row_summary: bool = False  # the graph also outputs ROW_ARGMAX, ROW_LOG_NORM, ROW_TOKEN_LOGPROB (add_row_summary)
    model_bytes: bytes | None = None  # the rewritten graph the session was made from (None: the folder's)
    profile: Any = None  # the device's ep.profiles.DeviceProfile
    weights: Any = None  # engine.shared_weights.SharedWeights the decoder's sessions take (None: each its own)


def capture_graph_bytes(folder: ModelFolder, kv_length: int, *, packed: bool = False,
                        names: tuple[str, str, str] = ("input_ids", "position_ids", "attention_mask"),
                        row_groups: int = 0, row_summary: bool = False, logits: str = "logits") -> bytes:
    """The decoder graph with nothing left for the CPU EP when every run is ``[num_slots, 1]`` wide.

    Only the graph is rewritten (the weights stay in the folder's external data file):
      1. overridable initializers (graph inputs with a default, e.g. ``logits_to_keep``) become constants, so
         the optimizer folds the int64 arithmetic they feed;
      2. every GroupQueryAttention's ``total_sequence_length`` (``Shape(attention_mask)[1]``: shape ops on
         int64 that GPU EPs leave to the CPU) becomes the constant ``kv_length``, which is exactly the
         width of the mask every captured run binds;
      3. ``packed``: input_ids, position_ids and attention_mask give way to one int32 input ``PACKED_INPUT``
         [num_slots, 2]: column 0 feeds the embedding, column 1 is GQA's seqlens_k (which GQA also takes the
         rotary positions from when position_ids is absent, as it is for a one-token step);
      4. nodes nobody consumes any more are dropped;
      5. ``row_groups`` > 0: every MatMulNBits runs its rows in ``row_groups`` groups of at most
         ``MATMUL_GROUP_ROWS`` rows, then one on the rest (``split_matmul_rows``);
      6. ``row_summary``: three more outputs, ``ROW_ARGMAX``, ``ROW_LOG_NORM`` and ``ROW_TOKEN_LOGPROB``, each
         row's argmax, log-normalizer and the argmax's log-probability (``add_row_summary``), so a greedy step's
         tokens and log-probabilities need no pass over the logits on the CPU, and an all-greedy step none of its
         logits on the host (every other step reads them whole: sampling stays on the CPU).

    Args:
        folder: the model folder.
        kv_length: the KV buffers' length = the attention mask's width (positions).
        packed: rewrite the three decode inputs into ``PACKED_INPUT``.
        names: the graph's (input_ids, position_ids, attention_mask) names.
        row_groups: see step 5 (0: off).
        row_summary: see step 6.
        logits: the graph's logits output (step 6).
    Returns:
        The serialized model; load it with the external-data folder set to ``folder.path``.
    Raises:
        ModelLoadError: the graph cannot be read, has no GroupQueryAttention to rewrite, or (``packed``)
            uses a decode input elsewhere than the embedding and GroupQueryAttention.
    """
    import onnx
    from onnx import numpy_helper

    try:
        proto = onnx.load(str(folder.model_file), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for corrupt files
        raise ModelLoadError(f"{folder.model_file} is not a readable ONNX model: {exc}") from exc
    graph = proto.graph
    # 1. Defaults of optional inputs become plain constants.
    init_names = {t.name for t in graph.initializer}
    kept = [i for i in graph.input if i.name not in init_names]
    del graph.input[:]
    graph.input.extend(kept)
    # 2. GQA's total length from a constant.
    rewired = 0
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and len(node.input) > 6 and node.input[6]:
            node.input[6] = TOTAL_LEN_NAME
            rewired += 1
    if not rewired:
        raise ModelLoadError(f"{folder.model_file}: no GroupQueryAttention with a total_sequence_length input")
    graph.initializer.append(numpy_helper.from_array(np.array(kv_length, dtype=np.int32), TOTAL_LEN_NAME))
    if packed:
        _pack_decode_inputs(graph, names)
    if row_groups:
        split_matmul_rows(graph, row_groups)
    if row_summary:
        add_row_summary(graph, logits)
    # 4. Drop what fed only the old total length (Shape -> Gather -> Cast), iterating to a fixed point.
    graph_outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | graph_outputs
        dead = [node for node in graph.node if not any(out in used for out in node.output if out)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    used = {name for node in graph.node for name in node.input} | graph_outputs
    live_inits = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live_inits)
    if packed:
        left = sorted(set(names) & used)
        if left:
            raise ModelLoadError(f"{folder.model_file}: {left} feed more than the embedding and GroupQueryAttention; "
                                 f"the decode inputs can't be packed")
        kept = [i for i in graph.input if i.name not in names]
        del graph.input[:]
        graph.input.extend(kept)
    return proto.SerializeToString()


# The most rows WebGPU's MatMulNBits runs on its small-M path (onnxruntime-ep-webgpu 0.4.0: M <= 3, one
# workgroup pass over the weights; M = 4 already takes the tiled path, 5x slower for a 1B model: docs/perf/GPU.md).
def split_matmul_rows(graph, groups: int, rows: int = MATMUL_GROUP_ROWS) -> int:
    """Step 5 of ``capture_graph_bytes``: each MatMulNBits ``Y = f(A)`` becomes
    ``Concat(f(A[0:r]), f(A[r:2r]), ..., f(A[groups*r:]))`` along A's first axis (the batch of a decode step).

    Slices past the end are empty, so any batch runs: up to ``groups * rows`` rows take the small-M path
    only, and larger batches put the rest through one ordinary run. Returns the nodes split.
    """
    from onnx import helper, numpy_helper

    bounds = [i * rows for i in range(groups + 1)] + [2**62]
    consts = {b: f"ortserve/row_{b}" for b in bounds}
    graph.initializer.extend(numpy_helper.from_array(np.array([b], np.int64), name) for b, name in consts.items())
    graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "ortserve/axis0"))
    new_nodes, count = [], 0
    for node in graph.node:
        if node.op_type != "MatMulNBits":
            new_nodes.append(node)
            continue
        count += 1
        parts = []
        for g, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            a, y = f"{node.name}/rows{g}/A", f"{node.name}/rows{g}/Y"
            new_nodes.append(helper.make_node("Slice", [node.input[0], consts[lo], consts[hi], "ortserve/axis0"], [a],
                                              name=f"{node.name}/rows{g}/slice"))
            part = helper.make_node("MatMulNBits", [a, *node.input[1:]], [y], name=f"{node.name}/rows{g}",
                                    domain=node.domain)
            part.attribute.extend(node.attribute)
            new_nodes.append(part)
            parts.append(y)
        new_nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=f"{node.name}/rows", axis=0))
    del graph.node[:]
    graph.node.extend(new_nodes)
    return count


def add_row_summary(graph, logits: str) -> None:
    """Step 6 of ``capture_graph_bytes``: ``ROW_ARGMAX = ArgMax(logits)``,
    ``ROW_LOG_NORM = logits[..., 0] - LogSoftmax(logits)[..., 0]`` (= log(sum(exp(logits)))) and
    ``ROW_TOKEN_LOGPROB = LogSoftmax(logits)[..., ROW_ARGMAX]``, each ``[B, S]``.

    NOTE(engine): the normalizer comes from LogSoftmax, one kernel over each row on the CUDA EP (its blockwise
    softmax); a ReduceMax + Exp + ReduceSum form cost several decode steps' time at batch 8 (docs/perf/GPU.md). A
    row's log-probability of token t is then ``logits[t] - ROW_LOG_NORM``; ArgMax takes the first index on
    ties, as numpy's argmax does.
    """
    from onnx import TensorProto, helper, numpy_helper

    if logits not in {o.name for o in graph.output}:
        raise ModelLoadError(f"the graph has no output {logits!r} to summarize")
    zero, last = "ortserve/summary_col0", "ortserve/summary_last_axis"
    graph.initializer.extend([numpy_helper.from_array(np.array(0, np.int64), zero),
                              numpy_helper.from_array(np.array([-1], np.int64), last)])
    graph.node.extend([
        helper.make_node("ArgMax", [logits], [ROW_ARGMAX], name="ortserve/row_argmax", axis=-1, keepdims=0),
        helper.make_node("LogSoftmax", [logits], ["ortserve/log_softmax"], name="ortserve/log_softmax", axis=-1),
        helper.make_node("Gather", [logits, zero], ["ortserve/logit0"], name="ortserve/logit0", axis=-1),
        helper.make_node("Gather", ["ortserve/log_softmax", zero], ["ortserve/logprob0"], name="ortserve/logprob0",
                         axis=-1),
        helper.make_node("Sub", ["ortserve/logit0", "ortserve/logprob0"], [ROW_LOG_NORM], name="ortserve/log_norm"),
        # [B, S] -> [B, S, 1] -> the argmax's log-probability [B, S, 1] -> [B, S]
        helper.make_node("Unsqueeze", [ROW_ARGMAX, last], ["ortserve/argmax_k"], name="ortserve/argmax_k"),
        helper.make_node("GatherElements", ["ortserve/log_softmax", "ortserve/argmax_k"], ["ortserve/token_lp_k"],
                         name="ortserve/token_lp_k", axis=-1),
        helper.make_node("Squeeze", ["ortserve/token_lp_k", last], [ROW_TOKEN_LOGPROB], name="ortserve/token_lp"),
    ])
    graph.output.extend([
        helper.make_tensor_value_info(ROW_ARGMAX, TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(ROW_LOG_NORM, TensorProto.FLOAT, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(ROW_TOKEN_LOGPROB, TensorProto.FLOAT, ["batch_size", "sequence_length"]),
    ])


def _pack_decode_inputs(graph, names: tuple[str, str, str]) -> None:
    """Step 3 of ``capture_graph_bytes``: feed the embedding and GQA from ``PACKED_INPUT``.

    Gathers (not Slice/Squeeze) take the two columns apart, and the token ids go back to int64 for the
    embedding, so every new node has a WebGPU kernel in onnxruntime-ep-webgpu 0.4.0.
    """
    from onnx import TensorProto, helper, numpy_helper

    input_ids, position_ids, _ = names
    graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "ortserve/col0"),
                              numpy_helper.from_array(np.array(1, np.int64), "ortserve/col1")])
    ids, seqlens = "ortserve/ids", "ortserve/seqlens_k"
    new_nodes = [  # [n, 2] -> ids int64 [n, 1], seqlens_k int32 [n]
        helper.make_node("Gather", [PACKED_INPUT, "ortserve/col0"], ["ortserve/ids_i32"], name="ortserve/ids_i32",
                         axis=1),
        helper.make_node("Cast", ["ortserve/ids_i32"], [ids], name="ortserve/ids", to=TensorProto.INT64),
        helper.make_node("Gather", [PACKED_INPUT, "ortserve/col1"], [seqlens], name="ortserve/seqlens", axis=1),
    ]
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            node.input[5] = seqlens
            if len(node.input) > 9 and node.input[9] == position_ids:
                node.input[9] = ""
        for i, name in enumerate(node.input):
            if name == input_ids:
                node.input[i] = ids
    for node in reversed(new_nodes):
        graph.node.insert(0, node)
    graph.input.append(helper.make_tensor_value_info(PACKED_INPUT, TensorProto.INT32, ["batch_size", 2]))


def nodes_off_ep(session: ort.InferenceSession, ep_name: str) -> list[str]:
    """``"EP:OpType"`` for every node not assigned to ``ep_name`` (needs the session config entry
    ``session.record_ep_graph_assignment_info=1``); empty when all are on it or ORT can't tell."""
    try:
        groups = session.get_provider_graph_assignment_info()
    except (AttributeError, RuntimeError):  # older ORT, or the entry was not set
        return []
    return [f"{g.ep_name}:{n.op_type}" for g in groups if g.ep_name != ep_name for n in g.get_nodes()]


def open_session(folder: ModelFolder, config: EngineConfig, kv_length: int, profile: Any = None,
                 weights: Any = None) -> OpenedSession:
    """Open the decoder session, with graph capture where ``config.graph_capture`` asks for it and it works.

    ``graph_capture``: None (auto) captures on WebGPU and CUDA when the rewritten graph puts every node on the
    device and falls back to a plain session otherwise (the reason logged); True requires it; False never.
    The packed-input graph is tried first, then the one with the three ordinary decode inputs. ``weights``: the
    decoder's shared device weights (``engine.shared_weights``), given to every session made here.

    Raises:
        ModelLoadError: the model can't be served, or ``graph_capture=True`` can't be honoured.
    """
    want = config.graph_capture
    profile = profile or select_profile(config)  # (the caller's, when it chose the device already)
    selected = profile.selected
    config = profile.resolve(config)
    if selected is None:  # the plain CPU session
        if want:
            raise ModelLoadError("graph_capture=True needs the WebGPU or CUDA EP; the provider is cpu")
        session, _ = create_session(folder, config, weights=weights)
        return OpenedSession(session, None, False, "off: the CPU EP has no graph capture", profile=profile,
                             weights=weights)
    if not profile.engine_capture or want is False:
        if want:
            raise ModelLoadError(f"graph_capture=True needs the WebGPU or CUDA EP; {selected.ep_name} was selected")
        note = "off: graph_capture=False" if want is False else \
            f"off: the engine drives no graph capture on {selected.ep_name}"
        session, _ = create_session(folder, config, selected=selected, weights=weights)
        return OpenedSession(session, selected, False, note, profile=profile, weights=weights)
    inputs = folder.genai["model"]["decoder"].get("inputs", {})
    names = (inputs.get("input_ids", "input_ids"), inputs.get("position_ids", "position_ids"),
             inputs.get("attention_mask", "attention_mask"))
    row_groups, summary = config.matmul_row_groups, config.device_row_summary  # (the profile's where None)
    logits = folder.genai["model"]["decoder"].get("outputs", {}).get("logits", "logits")
    errors = []
    for packed in (True, False):  # one upload per step where the graph allows it, else three
        try:
            model_bytes = capture_graph_bytes(folder, kv_length, packed=packed, names=names, row_groups=row_groups,
                                              row_summary=summary, logits=logits)
            session, _ = create_session(folder, config, selected=selected, graph_capture=True, model_bytes=model_bytes,
                                        weights=weights)
            off = nodes_off_ep(session, selected.ep_name)
            if off:
                raise ModelLoadError(f"nodes outside {selected.ep_name}: {', '.join(sorted(set(off)))}")
        except ModelLoadError as exc:
            errors.append(f"{'packed' if packed else 'plain'} inputs: {exc}")
            continue
        note = (f"on: decode step [{config.max_batch}, 1], KV length {kv_length}, every node on "
                f"{selected.ep_name}, {'one packed input' if packed else 'three inputs'}"
                + (f", MatMulNBits over {row_groups} groups of {MATMUL_GROUP_ROWS} rows + the rest"
                   if row_groups else "")
                + (", each row's argmax and log-normalizer on the device" if summary else ""))
        log.info("graph capture %s", note)
        return OpenedSession(session, selected, True, note, PACKED_INPUT if packed else None, summary, model_bytes,
                             profile, weights)
    reason = "; ".join(errors)
    if want:
        raise ModelLoadError(f"graph capture on {selected.ep_name} is not possible: {reason}")
    # NOTE(engine): issue 13 saw uncaptured WebGPU runs compute wrong logits; the cause was the runner's, not the
    # EP's: IOBinding copies host inputs when they are bound, and cached bindings were not bound again before each
    # run (engine.runner.RunnerBase._run). Uncaptured runs now match the CPU EP (tests/integration/ep).
    log.warning("graph capture is off on %s (%s)", selected.ep_name, reason)
    session, _ = create_session(folder, config, selected=selected, weights=weights)
    return OpenedSession(session, selected, False, f"off: {reason}", profile=profile, weights=weights)


class DeviceDecodeIO:
    """Fixed device buffers for the decode inputs and the logits of a captured decode step.

    A captured graph replays with the buffers it was captured with, and ORT skips its input/output
    copies on replay, so every input and output must live in a fixed device buffer. The CPU keeps writing
    its numpy staging buffers in place; ``upload`` copies them over before each run and ``read_logits``
    brings the logits back after it.

    NOTE(engine): on WebGPU (ORT 1.31.1) uploads with ``onnxruntime.copy_tensors`` are ordered before
    the next run, but a ``copy_tensors`` readback right after a run was seen returning stale data, so the
    logits come back through an IOBinding's ``copy_outputs_to_cpu`` (the session's own data transfer).
    The readback binding holds only the logits, never the KV buffers, and is never run.

    Args:
        session: the decoder session.
        staging: input name -> the C-contiguous numpy array the CPU writes (shape fixed).
        logits_name: the logits output's name.
        logits_shape: ``[num_slots, 1, vocab]``.
        allocate: device allocator (CPU OrtValues work too: tests).
        host_logits: a float32 host array of ``logits_shape`` (host-accessible memory where the device offers it)
            that ``read_logits`` copies into with ``onnxruntime.copy_tensors`` (pointer memory: CUDA, HIP); None:
            the readback binding's fresh array (WebGPU, see the note above).
        summary: the graph has the row summary outputs (``add_row_summary``): fixed device buffers for them too,
            read back with the logits into ``row_argmax`` and ``row_log_norm`` (``[num_slots]`` each).
    """

    def __init__(self, session: ort.InferenceSession, staging: Mapping[str, np.ndarray], logits_name: str,
                 logits_shape: tuple[int, ...], allocate: DeviceAllocator,
                 host_logits: np.ndarray | None = None, summary: bool = False) -> None:
        self._names = list(staging)
        self._staging = [staging[name] for name in self._names]
        self._host = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._staging]  # zero copy
        self._device = [allocate(tuple(a.shape), a.dtype) for a in self._staging]
        self._on_cpu = any(v.device_name().lower() == HOST_MEMORY for v in self._device)
        self.logits = allocate(tuple(logits_shape), np.float32)
        self._readback = session.io_binding()
        self._readback.bind_ortvalue_output(logits_name, self.logits)
        self._host_logits = host_logits
        rows = logits_shape[0]
        self._outputs = [(logits_name, self.logits)]
        self.row_argmax: np.ndarray | None = None  # [rows] int64, the last run's, with ``summary``
        self.row_log_norm: np.ndarray | None = None  # [rows] float32
        self.row_token_logprob: np.ndarray | None = None  # [rows] float32: the argmax's log-probability
        if summary:
            self.row_argmax = np.zeros(rows, dtype=np.int64)
            self.row_log_norm = np.zeros(rows, dtype=np.float32)
            self.row_token_logprob = np.zeros(rows, dtype=np.float32)
            self._outputs += [(ROW_ARGMAX, allocate((rows, 1), np.int64)),
                              (ROW_LOG_NORM, allocate((rows, 1), np.float32)),
                              (ROW_TOKEN_LOGPROB, allocate((rows, 1), np.float32))]
            for name, value in self._outputs[1:]:
                self._readback.bind_ortvalue_output(name, value)
        self._host_outputs = [] if host_logits is None else [ort.OrtValue.ortvalue_from_numpy(a) for a in (
            host_logits, *([self.row_argmax[:, None], self.row_log_norm[:, None], self.row_token_logprob[:, None]]
                           if summary else []))]

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind the device inputs and the device logits into the decode step's binding."""
        for name, value in zip(self._names, self._device):
            binding.bind_ortvalue_input(name, value)
        for name, value in self._outputs:
            binding.bind_ortvalue_output(name, value)

    def upload(self) -> None:
        """Copy every staging buffer to its device buffer (before a run)."""
        if self._on_cpu:  # ORT has no CPU -> CPU data transfer for copy_tensors
            for array, value in zip(self._staging, self._device):
                value.update_inplace(array)
            return
        ort.copy_tensors(self._host, self._device)

    def read_logits(self, logits: bool = True) -> np.ndarray | None:
        """The last run's logits, float32 ``logits_shape`` (``host_logits``, or a fresh array); with the summary,
        its rows' ``row_argmax``, ``row_log_norm`` and ``row_token_logprob`` too.

        ``logits=False`` (with the summary and ``host_logits``): only the summary comes back, and None for the
        logits. NOTE(engine): at 64 rows of a 128k vocabulary the logits are 33 MB a step: copied into pinned
        memory under the interpreter lock (``copy_tensors`` keeps it), which the event loop waits on.
        """
        if self._host_logits is not None and not self._on_cpu:
            # NOTE(engine): a run whose outputs stay on the device may return before the device is done; wait for
            # it, then copy (copy_tensors without a stream is synchronous)
            self._readback.synchronize_outputs()
            if logits or self.row_argmax is None:
                ort.copy_tensors([value for _, value in self._outputs], self._host_outputs)
                return self._host_logits
            ort.copy_tensors([value for _, value in self._outputs[1:]], self._host_outputs[1:])
            return None
        out = self._readback.copy_outputs_to_cpu()
        if self.row_argmax is not None:
            self.row_argmax[:] = out[1][:, 0]
            self.row_log_norm[:] = out[2][:, 0]
            self.row_token_logprob[:] = out[3][:, 0]
            if not logits:
                return None  # (the CPU stand-in: the same answer as a device's, its copy saves nothing here)
        return out[0]
