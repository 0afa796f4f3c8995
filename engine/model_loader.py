"""Reads an ONNX Runtime GenAI model folder, checks the engine can serve it, and opens the session.

Owns genai_config.json parsing and graph I/O validation; every failure is a ModelLoadError at load.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine.chat_template import ChatTemplate, chat_template_source
from engine.config import EngineConfig
from engine.context_length import (
    GIB, ContextChoice, ModelTooLargeError, available_host_memory_bytes, check_fits, choose_context, kv_bytes_per_token,
)
from engine.end_of_generation import eog_token_ids
from engine.tokenizer import HELD_TOKENIZERS, Tokenizer
from engine.types import ModelLoadError

log = logging.getLogger(__name__)

_KV_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
DEFAULT_MAX_LENGTH = 2048
# where ORT finds external weights when the graph itself is passed as bytes
EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


@dataclass(frozen=True)
class GraphIO:
    """The decoder's input/output names (from genai_config.json, checked against the session)."""

    input_ids: str
    attention_mask: str
    position_ids: str | None  # some ORT GenAI models derive positions from the mask
    past_keys: tuple[str, ...]
    past_values: tuple[str, ...]
    logits: str
    present_keys: tuple[str, ...]
    present_values: tuple[str, ...]
    kv_dtype: Any = np.float32  # numpy dtype of the KV buffers
    kv_length: int | None = None  # a static KV length baked into the graph, else None
    vocab_size: int = 0  # logits width


@dataclass
class ModelFolder:
    """Everything read from a model folder before any session exists."""

    path: Path
    model_file: Path
    genai: dict[str, Any]
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    eog_token_ids: frozenset[int]  # every id that ends generation (llama.cpp's EOG set; grammars allow them)
    num_layers: int
    num_kv_heads: int
    head_size: int
    context_length: int
    search_max_length: int | None
    generation_config: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, float | int]:
        """generation_config.json's sampling settings (generation_defaults), read once."""
        return generation_defaults(self.generation_config)

    @property
    def model_name(self) -> str:
        return self.path.name

    @functools.cached_property
    def kv_dtype_bytes(self) -> int:
        """Bytes of one KV element: the graph's past-key input type (read without the weights); 4 if unknown."""
        import onnx  # only here: the graph's structure at load

        try:
            proto = onnx.load(str(self.model_file), load_external_data=False)
        except Exception:  # noqa: BLE001 - check_share_buffer reports an unreadable graph
            return 4
        for graph_input in proto.graph.input:
            if graph_input.name.startswith("past_key_values") or ".key" in graph_input.name:
                elem = graph_input.type.tensor_type.elem_type
                return 2 if elem in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16) else 4
        return 4

    @functools.cached_property
    def weights_bytes(self) -> int:
        """The decoder's graph and weights on disk: ``model.onnx`` and the external data files beside it."""
        return sum(f.stat().st_size for f in self.path.iterdir()
                   if f.is_file() and f.name.startswith(self.model_file.name))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The end-of-generation set under its older name."""
        return self.eog_token_ids


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"model folder {path.parent} has no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


# The generation_config.json fields that become a request's defaults (vLLM's --generation-config auto reads the
# same ones), each with the range SamplingParams accepts.
GENERATION_DEFAULT_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "temperature": ("[0, 2]", lambda v: 0.0 <= v <= 2.0),
    "top_p": ("(0, 1]", lambda v: 0.0 < v <= 1.0),
    "top_k": ("an integer >= 0", lambda v: v >= 0 and float(v).is_integer()),
    "min_p": ("[0, 1]", lambda v: 0.0 <= v <= 1.0),
    "repetition_penalty": ("[0.01, 2]", lambda v: 0.01 <= v <= 2.0),
}


def generation_defaults(config: Mapping[str, Any]) -> dict[str, float | int]:
    """The sampling defaults a model folder's generation_config.json recommends (its creator's settings, e.g.
    Qwen2.5-Coder's temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.1), as vLLM applies them.

    Fields other than GENERATION_DEFAULT_RANGES' (``do_sample``, ``max_length``, token ids) are not read; a value
    of the wrong type or out of range is left out with a warning, so an odd file never makes every request a 400.
    """
    defaults: dict[str, float | int] = {}
    for name, (allowed, ok) in GENERATION_DEFAULT_RANGES.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            log.warning("generation_config.json: ignoring %s=%r (expected %s)", name, value, allowed)
            continue
        defaults[name] = int(value) if name == "top_k" else float(value)
    return defaults


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def read_model_folder(path: str | Path, chat_template: str | None = None) -> ModelFolder:
    """Parse genai_config.json, the tokenizer, the chat template and the stop tokens.

    ``chat_template``: a built-in template name or a Jinja file replacing the model's own (--chat-template).

    Raises:
        ModelLoadError: a missing file or field, or a config the engine cannot serve.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    genai = _read_json(path / "genai_config.json", required=True)
    try:
        model = genai["model"]
        decoder = model["decoder"]
        model_file = path / decoder.get("filename", "model.onnx")
        num_layers = int(decoder["num_hidden_layers"])
        num_kv_heads = int(decoder["num_key_value_heads"])
        head_size = int(decoder["head_size"])
        context_length = int(model.get("context_length") or 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path / 'genai_config.json'} lacks a required field: {exc!r}") from exc
    if not model_file.is_file():
        raise ModelLoadError(f"model folder {path} has no {model_file.name} (genai_config decoder.filename)")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"model folder {path} has no tokenizer.json")
    tokenizer = HELD_TOKENIZERS.load(path / "tokenizer.json")
    tok_config = _read_json(path / "tokenizer_config.json", required=False)
    gen_config = _read_json(path / "generation_config.json", required=False)
    override = chat_template
    chat_template = ChatTemplate.from_tokenizer_config(tok_config)
    if override is not None:
        chat_template = ChatTemplate(chat_template_source(override), chat_template.special_tokens)
    elif not chat_template.available and (path / "chat_template.jinja").is_file():
        chat_template = ChatTemplate((path / "chat_template.jinja").read_text(encoding="utf-8"),
                                     chat_template.special_tokens)

    # NOTE(engine): a request ends at any end-of-generation token, decided as llama.cpp decides it
    # (engine.end_of_generation): the folder's eos ids (genai_config, generation_config, the tokenizer's
    # eos_token), eot/eom, FIM pad/repo/separator and every token llama.cpp ends on by its text. Folders converted
    # before the builder wrote the whole set get it here.
    eos = _ids(model.get("eos_token_id")) | _ids(gen_config.get("eos_token_id"))
    eos_text = chat_template.special_tokens.get("eos_token")
    if eos_text and tokenizer.token_to_id(eos_text) is not None:
        eos.add(tokenizer.token_to_id(eos_text))
    eog = eog_token_ids(tokenizer.vocab, eos_ids=eos,
                        vocab_size=tokenizer.vocab_size)
    if not eog:
        log.warning("model %s names no end-of-generation token; requests end only at max_tokens or stop strings",
                    path)
    search_max = genai.get("search", {}).get("max_length")
    return ModelFolder(
        path=path, model_file=model_file, genai=genai, tokenizer=tokenizer, chat_template=chat_template,
        eog_token_ids=eog, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size,
        context_length=context_length, search_max_length=int(search_max) if search_max else None,
        generation_config=gen_config,
    )


def choose_max_model_len(folder: ModelFolder, config: EngineConfig, kv_length: int | None) -> ContextChoice:
    """The configured max_model_len (checked against the trained context), else the model's trained context
    reduced only to what the KV memory budget allows for ``config.max_batch`` rows (engine.context_length).

    A static KV length baked into the graph (``kv_length``) bounds either.

    Raises:
        ModelLoadError: a configured value over the trained context, or a budget too small for any context.
    """
    trained = folder.context_length or folder.search_max_length or DEFAULT_MAX_LENGTH
    if config.max_model_len is not None and config.max_model_len > trained:
        raise ModelLoadError(f"max_model_len {config.max_model_len} exceeds the model's context_length {trained}")
    per_token = kv_bytes_per_token(folder.num_layers, folder.num_kv_heads, folder.head_size, folder.kv_dtype_bytes)
    budget = None if config.kv_cache_memory_gib is None else int(config.kv_cache_memory_gib * GIB)
    try:
        choice = choose_context(trained, requested=config.max_model_len, num_rows=config.max_batch,
                                kv_bytes_per_token=per_token, budget_bytes=budget,
                                weights_bytes=folder.weights_bytes if host_weights(config) else 0)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    if kv_length is not None and choice.value > kv_length:
        choice = dataclasses.replace(choice, value=kv_length)  # a static KV length in the graph bounds the context
    return choice


def host_weights(config: EngineConfig) -> bool:
    """Whether the weights load into host memory (the plain CPU session, --provider cpu); under auto or a device
    provider they may live on the device (``check_memory`` knows once the device is chosen)."""
    from ep.profiles import host_profile

    return host_profile(config.provider) is not None


def check_memory(folder: ModelFolder, context: ContextChoice, profile: Any, weight_copies: int = 1) -> str:
    """Refuse the model before its session loads when its weights and KV cache cannot fit in the memory they will
    live in: the host's available memory where the device's rows are host memory (the CPU), the device's own memory
    where it reports one (``ep.device.DeviceRecord.memory_bytes``), else nothing is checked. ``weight_copies``: the
    device copies of the weights the decoder's sessions will hold (``engine.placement``).

    Returns:
        The start-up line. Raises ModelLoadError naming every size.
    """
    kv = context.value * context.num_rows * context.kv_bytes_per_token
    selected = getattr(profile, "selected", None)
    if selected is None or str(profile.kv_rows) == "host":
        available, where = available_host_memory_bytes(), "host memory available (MemAvailable)"
    else:
        available, where = selected.record.memory_bytes(), f"{selected.ep_name} device memory"
    try:
        return check_fits(weights_bytes=folder.weights_bytes, kv_bytes=kv, available_bytes=available, where=where,
                          weight_copies=weight_copies)
    except ModelTooLargeError as exc:
        raise ModelLoadError(f"{folder.path.name} cannot be served here: {exc}") from exc


def check_graph(folder: ModelFolder, session: ort.InferenceSession, *, packed_input: str | None = None) -> GraphIO:
    """Match the session's inputs/outputs with genai_config's names; anything unknown is an error.

    ``packed_input``: the session runs a graph rewritten by ``engine.graph_capture`` whose decode inputs are
    packed into this one input (input_ids and attention_mask are then absent).
    """
    spec = folder.genai["model"]["decoder"]
    names_in = spec.get("inputs", {})
    names_out = spec.get("outputs", {})
    n = folder.num_layers
    io = GraphIO(
        input_ids=names_in.get("input_ids", "input_ids"),
        attention_mask=names_in.get("attention_mask", "attention_mask"),
        position_ids=names_in.get("position_ids", "position_ids"),
        past_keys=tuple(names_in.get("past_key_names", "past_key_values.%d.key") % i for i in range(n)),
        past_values=tuple(names_in.get("past_value_names", "past_key_values.%d.value") % i for i in range(n)),
        logits=names_out.get("logits", "logits"),
        present_keys=tuple(names_out.get("present_key_names", "present.%d.key") % i for i in range(n)),
        present_values=tuple(names_out.get("present_value_names", "present.%d.value") % i for i in range(n)),
    )
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    where = f"{folder.model_file.name} in {folder.path}"
    if io.past_keys[0] not in inputs:
        raise ModelLoadError(f"{where} has no KV-cache inputs ({io.past_keys[0]}); the engine needs a decoder "
                             f"with past/present KV (GroupQueryAttention, past_present_share_buffer)")
    known = {io.input_ids, io.attention_mask, io.position_ids, *io.past_keys, *io.past_values, packed_input}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise ModelLoadError(f"{where} has inputs the engine cannot feed: {unknown}")
    decode_inputs = (packed_input,) if packed_input else (io.input_ids, io.attention_mask)
    for required in (*decode_inputs, *io.past_keys, *io.past_values):
        if required not in inputs:
            raise ModelLoadError(f"{where} lacks the input {required!r}")
    for required in (io.logits, *io.present_keys, *io.present_values):
        if required not in outputs:
            raise ModelLoadError(f"{where} lacks the output {required!r}")
    kv = inputs[io.past_keys[0]]
    if kv.type not in _KV_DTYPES:
        raise ModelLoadError(f"{where}: KV dtype {kv.type} is not supported (float32 or float16)")
    if len(kv.shape) != 4:
        raise ModelLoadError(f"{where}: KV input {kv.name} must be [batch, kv_heads, length, head_size]")
    if isinstance(kv.shape[1], int) and kv.shape[1] != folder.num_kv_heads or \
            isinstance(kv.shape[3], int) and kv.shape[3] != folder.head_size:
        raise ModelLoadError(f"{where}: KV shape {kv.shape} disagrees with genai_config "
                             f"(kv heads {folder.num_kv_heads}, head size {folder.head_size})")
    vocab = outputs[io.logits].shape[-1]
    if not isinstance(vocab, int):
        vocab = int(folder.genai["model"].get("vocab_size") or 0)
    if vocab <= 0:
        raise ModelLoadError(f"{where}: cannot tell the vocabulary size (logits shape or vocab_size)")
    position_ids = io.position_ids if io.position_ids in inputs else None
    kv_length = kv.shape[2] if isinstance(kv.shape[2], int) else None
    return GraphIO(**{**io.__dict__, "position_ids": position_ids, "kv_dtype": _KV_DTYPES[kv.type],
                      "kv_length": kv_length, "vocab_size": vocab})


def check_share_buffer(folder: ModelFolder) -> None:
    """The shared past/present buffer needs GroupQueryAttention; read the graph (not its weights)."""
    import onnx  # only here: the structure check at load

    try:
        proto = onnx.load(str(folder.model_file), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError and others for corrupt files
        raise ModelLoadError(f"{folder.model_file} is not a readable ONNX model: {exc}") from exc
    if not any(node.op_type == "GroupQueryAttention" for node in proto.graph.node):
        raise ModelLoadError(f"{folder.model_file} has no GroupQueryAttention node; the engine's shared KV "
                             f"buffer (past_present_share_buffer) needs it")


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads counted once)."""
    try:
        allowed = os.sched_getaffinity(0)
        cores = set()
        for cpu in allowed:
            base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
            with open(f"{base}/core_id") as f1, open(f"{base}/physical_package_id") as f2:
                cores.add((f1.read().strip(), f2.read().strip()))
        return max(1, len(cores))
    except (OSError, AttributeError):
        return max(1, os.cpu_count() or 1)


def session_options(config: EngineConfig, base: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """Graph optimization ALL, intra-op threads, spinning (``EngineConfig.stop_spinning``: not after a run); on top of
    ``base`` (from ep/) if given."""
    so = base if base is not None else ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = config.intra_op_threads or physical_cores()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.allow_spinning else "0")
    if config.stop_spinning or (config.stop_spinning is None and config.draft_model):
        so.add_session_config_entry("session.force_spinning_stop", "1")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def select_profile(config: EngineConfig) -> Any:
    """The device profile (``ep.profiles.DeviceProfile``) for ``config``: the plain CPU session's, or the profile of
    the device ``ep.device.select_device`` picks (ep's own errors propagate unchanged)."""
    from ep.profiles import host_profile

    profile = host_profile(config.provider)
    if profile is None:
        from ep import device as ep_device

        profile = ep_device.select_device(config.provider, config.device, config.ep_library).profile
    return profile


def create_session(folder: ModelFolder, config: EngineConfig, *, selected: Any = None,
                   graph_capture: bool = False, model_bytes: bytes | None = None, weights: Any = None,
                   ) -> tuple[ort.InferenceSession, Any]:
    """Open the session on the configured provider.

    ``provider="cpu"`` opens a plain CPU session here; any other provider goes through ``ep/`` (device
    selection, plugin EP registration, provider options); ep's own errors (``ep.names.EpError``: unknown
    provider, device not found, bad --ep-library) propagate unchanged.

    Args:
        folder, config: the model folder and the engine settings.
        selected: an ``ep.device.SelectedDevice`` already chosen (None: select from ``config``).
        graph_capture: ask the EP for graph capture (WebGPU; see ``engine.graph_capture``).
        model_bytes: a rewritten graph to load instead of ``folder.model_file``; its external weights are
            still read from the folder.
        weights: an ``engine.shared_weights.SharedWeights`` whose device values the session takes in place of
            loading its own (None: it loads its own).
    Returns:
        (session, ``ep.device.SelectedDevice`` or None for the plain CPU path).
    Raises:
        ModelLoadError: the graph is not servable or ONNX Runtime refuses it.
    """
    from ep.profiles import host_profile

    model: str | bytes = str(folder.model_file) if model_bytes is None else model_bytes
    check_share_buffer(folder)
    if selected is None and host_profile(config.provider) is not None:
        try:
            so = session_options(config)
            if model_bytes is not None:
                so.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(folder.path))
            if weights is not None:
                weights.add_to(so)
            return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]), None
        except Exception as exc:  # onnxruntime raises Fail/InvalidGraph/NoSuchFile/RuntimeError
            raise ModelLoadError(f"ONNX Runtime cannot load {folder.model_file}: {exc}") from exc
    from ep import device as ep_device
    from ep import providers as ep_providers
    from ep.names import SessionCreateError

    if selected is None:
        selected = ep_device.select_device(config.provider, config.device, config.ep_library)
    base = ep_providers.make_session_options(
        selected, folder.genai, ep_options=dict(config.ep_options),
        intra_op_threads=config.intra_op_threads or physical_cores(), graph_capture=graph_capture)
    if model_bytes is not None:
        base.add_session_config_entry(EXTERNAL_DATA_FOLDER, str(folder.path))
    if graph_capture:  # lets engine.graph_capture check that no node was left for the CPU EP
        base.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if weights is not None:
        weights.add_to(base)
    try:
        session = ep_providers.create_session(model, selected, session_options(config, base))
    except SessionCreateError as exc:
        raise ModelLoadError(str(exc)) from exc
    return session, selected
