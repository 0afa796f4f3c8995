"""Writes an ONNX Runtime GenAI model folder atomically (temp folder beside the target, then rename).

Owns the genai_config.json / generation_config.json schema; no onnxruntime import.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import onnx
from onnx import TensorProto
from tokenizers import Tokenizer

from engine.builder.errors import OutputExistsError
from engine.builder.external import ExternalData
from engine.builder.graph import ModelSpec
from engine.builder.tokenizer import SpecialTokens

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MARKER_FILE = ".ortserve-model.json"
GENERATION_CONFIG = "generation_config.json"  # the sampling defaults (and end-of-generation ids) of a decoder
EMBEDDING_FILE = "embedding.onnx"  # decoders: the pooled-embedding graph beside model.onnx
EMBEDDING_CONFIG = "embedding_config.json"  # what engine/embedding.py reads (encoders and decoders)
HIDDEN_OUTPUT = "hidden_states"
FINAL_NORM_OUTPUT = "final_norm/out0"  # engine.builder.graph's final norm
FINAL_NORM_WEIGHT = "final_norm"  # its weight, an initializer in the activation dtype


def genai_config(spec: ModelSpec, special: SpecialTokens, *, max_length: int) -> dict[str, Any]:
    """genai_config.json as docs/ARCHITECTURE.md fixes it (the schema onnxruntime-genai reads)."""
    return {
        "model": {
            "type": spec.model_type,
            "context_length": spec.context_length,
            "vocab_size": spec.vocab_size,
            "bos_token_id": special.bos_id,
            "eos_token_id": special.eos_token_ids,
            "pad_token_id": special.pad_id,
            "decoder": {
                "filename": MODEL_FILE,
                "head_size": spec.head_size,
                "hidden_size": spec.hidden_size,
                "num_attention_heads": spec.num_heads,
                "num_key_value_heads": spec.num_kv_heads,
                "num_hidden_layers": spec.num_layers,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "max_length": max_length,
            "past_present_share_buffer": True,
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "top_k": 1,
            "top_p": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "early_stopping": True,
            "min_length": 0,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def generation_config(special: SpecialTokens, *, max_length: int) -> dict[str, Any]:
    return {
        "bos_token_id": special.bos_id,
        "eos_token_id": special.eos_token_ids,
        "pad_token_id": special.pad_id,
        "max_length": max_length,
        "do_sample": False,
    }


def check_target(out_dir: Path, overwrite: bool) -> None:
    """Raises OutputExistsError before any work when ``out_dir`` exists and may not be replaced."""
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"output folder {out_dir} already exists (pass overwrite=True to replace it)")


def write_model_folder(
    out_dir: Path,
    model: onnx.ModelProto | Callable[[ExternalData], onnx.ModelProto],
    spec: ModelSpec,
    tokenizer: Tokenizer,
    special: SpecialTokens,
    tok_config: dict[str, Any],
    *,
    max_length: int,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
    marker: dict[str, Any] | None = None,
    embedding_pooling: str | None = None,
) -> Path:
    """Writes a decoder folder into a temp folder beside ``out_dir`` and renames it into place.

    Beside the decoder, ``embedding.onnx`` (the same graph and weights file, its output the final norm's hidden
    states, engine/embedding.py) and its ``embedding_config.json``: pooled decoder embeddings, pooled by
    ``embedding_pooling`` (the model's own, e.g. a GGUF's pooling_type) or else the last token.

    Args:
        model: the decoder, or a function that builds it writing its weights into the ``ExternalData`` it is given
            (``graph.build_graph``'s ``data``): the weights then go to disk one tensor at a time.

    Returns:
        ``out_dir``, resolved.
    """
    def fill(tmp: Path) -> None:
        if callable(model):
            with ExternalData(tmp / DATA_FILE) as data:
                proto = model(data)
            onnx.save_model(proto, tmp / MODEL_FILE)  # its large initializers point into DATA_FILE already
            del proto
        else:
            onnx.save_model(model, tmp / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=DATA_FILE, size_threshold=1024)
        write_decoder_embedding(tmp, spec, special, max_length=max_length, pooling=embedding_pooling or "last")
        _write_json(tmp / "genai_config.json", genai_config(spec, special, max_length=max_length))
        _write_json(tmp / GENERATION_CONFIG, generation_config(special, max_length=max_length))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    return write_folder(out_dir, fill, overwrite=overwrite, marker=marker)


def write_embedding_folder(
    out_dir: Path,
    model: onnx.ModelProto,
    tokenizer: Tokenizer,
    tok_config: dict[str, Any],
    config: dict[str, Any],
    *,
    overwrite: bool = False,
    marker: dict[str, Any] | None = None,
) -> Path:
    """Writes an encoder folder (model.onnx + data, tokenizer files, embedding_config.json) atomically."""
    def fill(tmp: Path) -> None:
        onnx.save_model(model, tmp / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)
        _write_json(tmp / EMBEDDING_CONFIG, config)
        _write_json(tmp / "tokenizer_config.json", tok_config)
        tokenizer.save(str(tmp / "tokenizer.json"))

    return write_folder(out_dir, fill, overwrite=overwrite, marker=marker)


def write_decoder_embedding(folder: Path, spec: ModelSpec, special: SpecialTokens, *, max_length: int,
                            pooling: str = "last") -> None:
    """``embedding.onnx`` beside a saved decoder ``model.onnx``: the same nodes up to the final norm, whose output
    [B, S, H] (float32) is the graph's only output ``hidden_states``; no past KV (a batch of whole texts), no LM
    head. Its initializers still point into ``model.onnx.data``, so the weights are stored once.
    """
    proto = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    g = proto.graph
    producer = {out: n for n in g.node for out in n.output}
    if FINAL_NORM_OUTPUT not in producer:
        return  # not a graph of ours: no pooled output
    final = FINAL_NORM_OUTPUT
    extra: list[onnx.NodeProto] = []
    if _activation_dtype(g) != TensorProto.FLOAT:
        extra.append(onnx.helper.make_node("Cast", [final], [HIDDEN_OUTPUT], name="hidden_states/cast",
                                           to=TensorProto.FLOAT))
    else:
        extra.append(onnx.helper.make_node("Identity", [final], [HIDDEN_OUTPUT], name="hidden_states/identity"))
    # 1. Keep the nodes the hidden states need (walk back from the final norm); drop the past KV inputs.
    needed, stack = set(), [final]
    while stack:
        name = stack.pop()
        n = producer.get(name)
        if n is None or id(n) in needed:
            continue
        needed.add(id(n))
        stack.extend(i for i in n.input if i)
    past = {i.name for i in g.input if i.name.startswith("past_key_values.")}
    nodes = []
    for n in g.node:
        if id(n) in needed:
            n.input[:] = ["" if i in past else i for i in n.input]
            nodes.append(n)
    used = {i for n in nodes for i in n.input}
    inits = [t for t in g.initializer if t.name in used]
    inputs = [i for i in g.input if i.name in used and i.name not in past]
    out = onnx.helper.make_tensor_value_info(HIDDEN_OUTPUT, TensorProto.FLOAT,
                                             ["batch_size", "sequence_length", spec.hidden_size])
    graph = onnx.helper.make_graph(nodes + extra, "ortserve_decoder_embedding", inputs, [out], inits)
    emb = onnx.helper.make_model(graph, opset_imports=proto.opset_import, producer_name=proto.producer_name)
    emb.ir_version = proto.ir_version
    onnx.save_model(emb, folder / EMBEDDING_FILE)
    _write_json(folder / EMBEDDING_CONFIG, {
        "kind": "decoder",
        "architecture": spec.model_type,
        "filename": EMBEDDING_FILE,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids"},
        "hidden_output": HIDDEN_OUTPUT,
        "dimension": spec.hidden_size,
        "max_seq_length": max_length,
        "max_position_embeddings": spec.context_length,
        # NOTE(builder): a chat model's GGUF names no pooling (llama.cpp's --pooling picks one); then the last
        # token, the only one that has seen the whole text through causal attention.
        "pooling": pooling,
        "normalize": True,
        "add_special_tokens": True,
        "pad_token_id": special.pad_id,
        "vocab_size": spec.vocab_size,
        "source": "decoder",
    })


def folder_dtype(folder: Path) -> str | None:
    """A decoder folder's activation/KV dtype ("float32" or "float16"): its marker's, else its graph's past keys';
    None for an encoder folder or one that cannot be read."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
        if isinstance(marker, dict) and marker.get("dtype") in ("float32", "float16"):
            return marker["dtype"]
    except (OSError, ValueError):
        pass
    if not (folder / "genai_config.json").is_file() or not (folder / MODEL_FILE).is_file():
        return None
    try:
        g = onnx.load(str(folder / MODEL_FILE), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - a damaged graph is the loader's to report
        return None
    # NOTE(builder): our graphs keep the final norm's weight in the activation dtype; the past keys may be float16
    # beside float32 activations (kv_dtype), so they decide only for a graph that is not ours.
    norm = next((t.data_type for t in g.initializer if t.name == FINAL_NORM_WEIGHT), None)
    return {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16"}.get(norm or _activation_dtype(g))


def _activation_dtype(g: onnx.GraphProto) -> int:
    """The activation dtype of the decoder graph: its past KV inputs' (float32 when it has none)."""
    for i in g.input:
        if i.name.startswith("past_key_values."):
            return i.type.tensor_type.elem_type
    return TensorProto.FLOAT


def write_folder(out_dir: Path, fill: Callable[[Path], None], *, overwrite: bool = False,
                 marker: dict[str, Any] | None = None) -> Path:
    """Runs ``fill(tmp)`` on a temp folder beside ``out_dir`` and renames it into place.

    ``marker`` (cache bookkeeping) is written last as MARKER_FILE, with every file's size added, so
    ``marker_matches`` can tell a complete folder from a damaged one.

    NOTE(builder): readers never see a half-written folder: on any error the temp folder is removed
    and ``out_dir`` is untouched; with ``overwrite`` the old folder is replaced only after success.

    Returns:
        ``out_dir``, resolved.
    """
    out_dir = Path(out_dir).resolve()
    check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-{os.getpid()}-", dir=out_dir.parent))
    try:
        fill(tmp)
        if marker is not None:
            sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
            _write_json(tmp / MARKER_FILE, {**marker, "files": sizes})
        _set_modes(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{tmp.name[-8:]}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def remove_stale_temps(out_dir: Path) -> list[Path]:
    """Removes the temp folders of ``out_dir`` that a killed conversion left beside it (its process is gone): a
    conversion ended by SIGKILL or a power cut cannot clean up, and an 8B model's half folder is gigabytes. Never taken
    for a model (no marker, a dot name); returns what was removed.

    NOTE(builder): a temp folder's name carries its process id (``.<name>.tmp-<pid>-<random>``); one whose process
    still runs (a concurrent conversion) is left alone.
    """
    removed = []
    for tmp in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        pid = tmp.name[len(f".{out_dir.name}.tmp-"):].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def marker_matches(folder: Path, marker: dict[str, Any]) -> bool:
    """True when ``folder`` was completed with this marker and its files still have their sizes."""
    try:
        found = json.loads((folder / MARKER_FILE).read_text())
        sizes = found.pop("files")
        return found == marker and all((folder / n).stat().st_size == size for n, size in sizes.items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def has_generation_defaults(folder: Path, defaults: dict[str, Any]) -> bool:
    """True when ``folder``'s generation_config.json already holds every one of ``defaults``."""
    try:
        config = json.loads((folder / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(config.get(k) == v for k, v in defaults.items())


def write_generation_defaults(folder: Path, defaults: dict[str, Any]) -> None:
    """Merge ``defaults`` (a model creator's sampling settings) into ``folder``'s generation_config.json, and
    record its new size in the folder's marker so that ``marker_matches`` still holds. Each file is replaced
    whole (a temp file renamed into place), so a reader never sees half of one."""
    if not defaults or has_generation_defaults(folder, defaults):
        return
    path = folder / GENERATION_CONFIG
    config = json.loads(path.read_text()) if path.is_file() else {}
    _replace_json(path, {**config, **defaults})
    marker_path = folder / MARKER_FILE
    if marker_path.is_file():
        marker = json.loads(marker_path.read_text())
        marker.setdefault("files", {})[GENERATION_CONFIG] = path.stat().st_size
        _replace_json(marker_path, marker)


def _replace_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _write_json(tmp, obj)
    tmp.chmod(path.stat().st_mode & 0o777 if path.exists() else 0o644)
    os.replace(tmp, path)


def _set_modes(folder: Path) -> None:
    """mkdtemp makes 0700 folders: give the folder and its files the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
