"""Sentence-transformers folders (a BERT-family encoder in safetensors) -> an ortserve embedding model folder.

Reads config.json, model.safetensors, tokenizer.json, modules.json, 1_Pooling/config.json and
sentence_bert_config.json; writes model.onnx (+ .data), tokenizer.json (no truncation, no padding: the engine
checks lengths itself), tokenizer_config.json and embedding_config.json (engine/embedding.py reads it).
Imports onnx and safetensors, never onnxruntime.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

from engine.builder.errors import BuildError, UnsupportedArchitectureError
from engine.builder.folder import check_target, write_embedding_folder

OPSET = 21
ENCODER_ARCHITECTURES = ("BertModel",)
# 1_Pooling/config.json keys -> our pooling names (sentence-transformers' Pooling module)
_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_MODULES = {"Transformer", "Pooling", "Normalize"}  # sentence_transformers.models.* this converter maps


@dataclass(frozen=True)
class EncoderSpec:
    """A BERT encoder's hyperparameters (Hugging Face config names) and the sentence-transformers head."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_norm_eps: float
    max_seq_length: int  # the window sentence-transformers truncates to (its max_seq_length)
    pooling: str  # "mean", "cls", "max" or "last"
    normalize: bool  # a Normalize module follows the pooling
    pad_token_id: int = 0


def read_st_folder(folder: Path) -> tuple[EncoderSpec, dict[str, Any]]:
    """(spec, config.json) of a sentence-transformers folder; BuildError when a part is not supported."""
    config = _json(folder / "config.json")
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if archs[0] not in ENCODER_ARCHITECTURES and config.get("model_type") != "bert":
        raise UnsupportedArchitectureError(
            f"{folder}: architecture {archs[0]!r} is not supported (supported: {', '.join(ENCODER_ARCHITECTURES)})")
    if config.get("position_embedding_type", "absolute") != "absolute" or config.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedArchitectureError(f"{folder}: only absolute positions and the erf GELU are supported")
    modules = _json(folder / "modules.json") if (folder / "modules.json").is_file() else [
        {"type": "sentence_transformers.models.Transformer", "path": ""},
        {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"}]
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    if unknown := [k for k in kinds if k not in _MODULES]:
        raise BuildError(f"{folder}: modules.json names modules this converter cannot map: {unknown} "
                         f"(supported: {sorted(_MODULES)})")
    pooling_path = next((m.get("path") or "1_Pooling" for m, k in zip(modules, kinds) if k == "Pooling"), None)
    pooling = "mean"  # sentence-transformers' own default for a bare Transformer
    if pooling_path is not None and (folder / pooling_path / "config.json").is_file():
        pool_cfg = _json(folder / pooling_path / "config.json")
        chosen = [name for key, name in _POOLING_KEYS.items() if pool_cfg.get(key)]
        if any(pool_cfg.get(key) for key in _UNSUPPORTED_POOLING) or len(chosen) != 1:
            raise BuildError(f"{folder / pooling_path / 'config.json'}: exactly one of {list(_POOLING_KEYS)} must be "
                             f"true (concatenated or weighted poolings are not supported)")
        pooling = chosen[0]
    st_cfg = _json(folder / "sentence_bert_config.json") if (folder / "sentence_bert_config.json").is_file() else {}
    max_pos = int(config["max_position_embeddings"])
    spec = EncoderSpec(
        hidden_size=int(config["hidden_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]), intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]), max_position_embeddings=max_pos,
        layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
        max_seq_length=min(int(st_cfg.get("max_seq_length") or max_pos), max_pos),
        pooling=pooling, normalize="Normalize" in kinds, pad_token_id=int(config.get("pad_token_id") or 0))
    return spec, config


def load_bert_weights(path: Path) -> dict[str, np.ndarray]:
    """model.safetensors as float32 arrays, names without a leading ``bert.`` (BertModel vs BertFor* files)."""
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors raises SafetensorError and OSErrors
        raise BuildError(f"cannot read {path}: {exc}") from exc
    return {name.removeprefix("bert."): np.asarray(t, np.float32) for name, t in tensors.items()}


def build_encoder_graph(spec: EncoderSpec, w: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The BERT encoder: input_ids, attention_mask int64 [B, S] -> last_hidden_state float32 [B, S, H].

    Post-norm blocks as in Hugging Face's BertLayer, in ONNX Runtime's fused ops (the ones its own BERT
    optimizer emits): Attention with the padding mask (masked keys get -10000 before the softmax, which is
    exp() == 0 in float32, as Hugging Face's additive mask), SkipLayerNormalization for residual + bias +
    LayerNorm, BiasGelu (erf GELU). token_type_ids are 0 for single texts, so type row 0 is folded into the
    position table.
    """
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    eps = spec.layer_norm_eps

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, inputs: list[str], name: str, domain: str | None = None, num_outputs: int = 1, **attrs):
        outputs = [f"{name}/out{i}" for i in range(num_outputs)]
        nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if num_outputs == 1 else outputs

    def get(name: str) -> np.ndarray:
        if name not in w:
            raise BuildError(f"model.safetensors has no tensor {name!r}")
        return w[name]

    # 1. Embeddings: word[ids] + (position + type 0)[0:S], then LayerNorm. [B, S] -> [B, S, H]
    word = node("Gather", [const("embeddings.word", get("embeddings.word_embeddings.weight")), "input_ids"],
                "embed/word", axis=0)
    pos_type = get("embeddings.position_embeddings.weight") + get("embeddings.token_type_embeddings.weight")[0]
    seq_len = node("Shape", ["input_ids"], "embed/seq_len", start=1, end=2)  # [1]
    positions = node("Slice", [const("embeddings.position_type", pos_type), const("zero_1d", np.array([0], np.int64)),
                               seq_len, const("zero_axes", np.array([0], np.int64))], "embed/positions")  # [S, H]
    x = node("Add", [word, positions], "embed/add")
    x = node("LayerNormalization", [x, const("embeddings.ln.weight", get("embeddings.LayerNorm.weight")),
                                    const("embeddings.ln.bias", get("embeddings.LayerNorm.bias"))],
             "embed/ln", axis=-1, epsilon=eps)
    mask = node("Cast", ["attention_mask"], "mask_int32", to=TensorProto.INT32)  # [B, S], 1 = a real token

    for i in range(spec.num_layers):
        p = f"encoder.layer.{i}"
        # 2. Self-attention: fused QKV weights [H, 3H] (Q | K | V columns), bias [3H].
        qkv_w = np.concatenate([get(f"{p}.attention.self.{n}.weight").T for n in ("query", "key", "value")], axis=1)
        qkv_b = np.concatenate([get(f"{p}.attention.self.{n}.bias") for n in ("query", "key", "value")])
        attn = node("Attention", [x, const(f"{p}.qkv.weight", qkv_w), const(f"{p}.qkv.bias", qkv_b), mask],
                    f"{p}/attention", "com.microsoft", num_heads=spec.num_heads)  # [B, S, H]
        o = node("MatMul", [attn, const(f"{p}.o.weight_t", get(f"{p}.attention.output.dense.weight").T)], f"{p}/o")
        # 3. LayerNorm(o + bias + x): outputs (out, mean, inv_std, sum); only out is used.
        x = node("SkipLayerNormalization",
                 [o, x, const(f"{p}.attn_ln.weight", get(f"{p}.attention.output.LayerNorm.weight")),
                  const(f"{p}.attn_ln.bias", get(f"{p}.attention.output.LayerNorm.bias")),
                  const(f"{p}.o.bias", get(f"{p}.attention.output.dense.bias"))],
                 f"{p}/attn_ln", "com.microsoft", epsilon=eps)
        # 4. Feed-forward: GELU(x W1 + b1) W2, then LayerNorm(. + b2 + x). [B, S, H] -> [B, S, F] -> [B, S, H]
        h = node("MatMul", [x, const(f"{p}.up.weight_t", get(f"{p}.intermediate.dense.weight").T)], f"{p}/up")
        h = node("BiasGelu", [h, const(f"{p}.up.bias", get(f"{p}.intermediate.dense.bias"))], f"{p}/gelu",
                 "com.microsoft")
        d = node("MatMul", [h, const(f"{p}.down.weight_t", get(f"{p}.output.dense.weight").T)], f"{p}/down")
        x = node("SkipLayerNormalization",
                 [d, x, const(f"{p}.ffn_ln.weight", get(f"{p}.output.LayerNorm.weight")),
                  const(f"{p}.ffn_ln.bias", get(f"{p}.output.LayerNorm.bias")),
                  const(f"{p}.down.bias", get(f"{p}.output.dense.bias"))],
                 f"{p}/ffn_ln", "com.microsoft", epsilon=eps)
    nodes[-1].output[0] = "last_hidden_state"

    graph = helper.make_graph(
        nodes, "ortserve_encoder",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "sequence_length"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT,
                                       ["batch_size", "sequence_length", spec.hidden_size])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              producer_name="ortserve.engine.builder")
    model.ir_version = 10
    return model


def embedding_config(spec: EncoderSpec, *, source: str) -> dict[str, Any]:
    """embedding_config.json of an encoder folder (the schema engine/embedding.py reads)."""
    return {
        "kind": "encoder",
        "architecture": "bert",
        "filename": "model.onnx",
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask"},
        "hidden_output": "last_hidden_state",
        "dimension": spec.hidden_size,
        "max_seq_length": spec.max_seq_length,
        "max_position_embeddings": spec.max_position_embeddings,
        "pooling": spec.pooling,
        "normalize": spec.normalize,
        "add_special_tokens": True,
        "pad_token_id": spec.pad_token_id,
        "vocab_size": spec.vocab_size,
        "source": source,
    }


def convert_sentence_transformer(
    source: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    marker: dict | None = None,
) -> Path:
    """Converts a sentence-transformers folder (or a .zip of one) into an embedding model folder.

    Args:
        source: the folder, or a zip holding it (at its root or in one top folder).
        out_dir: the folder to create; written atomically (folder.write_embedding_folder).
        overwrite: replace ``out_dir`` if it exists.
        marker: cache bookkeeping written last (see folder.write_model_folder).
    Returns:
        The folder, resolved.
    Raises:
        BuildError subclasses (missing files, unsupported architecture, pooling or modules).
    """
    out_dir = Path(out_dir)
    check_target(out_dir.resolve(), overwrite)
    source = Path(source)
    with tempfile.TemporaryDirectory(prefix=".st-", dir=out_dir.resolve().parent if out_dir.parent.exists()
                                     else None) as tmp:
        folder = _unpacked(source, Path(tmp)) if source.suffix == ".zip" else source
        spec, _ = read_st_folder(folder)
        weights = load_bert_weights(folder / "model.safetensors")
        graph = build_encoder_graph(spec, weights)
        del weights
        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exceptions
            raise BuildError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from exc
        # NOTE(builder): the folder's tokenizer.json pads and truncates to 128 (how it was exported); the engine
        # pads batches itself and refuses (or, when asked, truncates) inputs longer than max_seq_length.
        tok.no_truncation()
        tok.no_padding()
        tok_cfg = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        tok_cfg["model_max_length"] = spec.max_seq_length
        return write_embedding_folder(out_dir, graph, tok, tok_cfg, embedding_config(spec, source=source.name),
                                      overwrite=overwrite, marker=marker)


def _unpacked(zip_path: Path, tmp: Path) -> Path:
    """Extract a zipped sentence-transformers folder; returns the folder holding config.json."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            zf.extractall(tmp)
    except (zipfile.BadZipFile, OSError) as exc:
        raise BuildError(f"cannot unpack {zip_path}: {exc}") from exc
    found = sorted(tmp.rglob("config.json"), key=lambda p: len(p.parts))
    if not found:
        raise BuildError(f"{zip_path} holds no config.json (not a sentence-transformers folder)")
    return found[0].parent


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BuildError(f"{path.parent} has no {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BuildError(f"cannot read {path}: {exc}") from exc


