"""Reads a GGUF file into ModelSpec + ModelWeights + tokenizer metadata, via an architecture table.

Validates the header, the architecture and every tensor type up front; memory-maps the file, so only
the repacked weights are held in memory. No onnx, no onnxruntime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, ReaderTensor

from engine.builder.errors import GGUFFormatError, UnsupportedArchitectureError, UnsupportedTensorTypeError
from engine.builder.graph import LayerWeights, ModelSpec, ModelWeights
from engine.builder.quant import BlockQuantMatrix, LinearWeight, from_q4_0, from_q4_1, from_q8_0

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class ArchMapping:
    """What differs between llama-like GGUF architectures; everything else is the shared graph.

    ``rope_interleaved``: llama.cpp's "normal" rope (llama GGUFs, whose converter permutes Q/K rows to
    adjacent pairs) vs NeoX rope (qwen2, gemma: half-split, rows as in HF).
    """

    model_type: str  # genai_config model.type
    rope_interleaved: bool = True
    activation: str = "silu"
    embedding_multiplier: Callable[[int], float] | None = None  # f(hidden_size)


ARCHITECTURES: dict[str, ArchMapping] = {
    "llama": ArchMapping("llama"),
    "qwen2": ArchMapping("qwen2", rope_interleaved=False),
    # NOTE(builder): llama.cpp's converter already stores gemma's RMSNorm weights as (1 + w).
    "gemma": ArchMapping("gemma", rope_interleaved=False, activation="gelu_tanh",
                         embedding_multiplier=lambda hidden: float(np.sqrt(hidden))),
}


@dataclass(frozen=True)
class TokenizerMeta:
    """The tokenizer.* metadata of a GGUF."""

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int] | None
    merges: list[tuple[str, str]]
    bos_id: int
    eos_id: int
    pad_id: int
    add_bos: bool
    chat_template: str | None


@dataclass
class GGUFModel:
    """Everything a conversion needs from one GGUF file."""

    path: Path
    architecture: str
    name: str
    spec: ModelSpec
    tokenizer: TokenizerMeta
    reader: GGUFReader
    tensors: dict[str, ReaderTensor]

    def load_weights(self, on_tensor: Callable[[str], None] | None = None) -> ModelWeights:
        """Converts every tensor exactly (see engine.builder.quant); calls ``on_tensor(name)`` after each."""
        return _load_weights(self, on_tensor)


def open_gguf(path: str | Path, *, max_layers: int | None = None) -> GGUFModel:
    """Opens and validates a GGUF file (header, architecture, hyperparameters, tensor types).

    Args:
        path: the .gguf file.
        max_layers: keep only the first N decoder blocks (tests build truncated models).
    Raises:
        GGUFFormatError, UnsupportedArchitectureError, UnsupportedTensorTypeError.
    """
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/IndexError/struct errors on bad files
        raise GGUFFormatError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    mapping = ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedTensorTypeError(t.name, t.tensor_type.name, SUPPORTED_TYPES)
        if t.data.nbytes != t.n_bytes:
            raise GGUFFormatError(f"{path}: tensor {t.name!r} is truncated ({t.data.nbytes} of {t.n_bytes} bytes)")

    hidden = meta.int(f"{arch}.embedding_length")
    num_heads = meta.int(f"{arch}.attention.head_count")
    head_size = meta.int(f"{arch}.attention.key_length", hidden // num_heads)
    rope_dims = meta.int(f"{arch}.rope.dimension_count", head_size)
    if rope_dims != head_size:
        raise UnsupportedArchitectureError(f"{path}: partial rotary ({rope_dims} of {head_size} dims) is not supported")
    num_layers = meta.int(f"{arch}.block_count")
    if max_layers is not None:
        num_layers = min(num_layers, max_layers)
    tok = _tokenizer_meta(meta)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFFormatError(f"{path}: no token_embd.weight tensor")
    spec = ModelSpec(
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta.int(f"{arch}.attention.head_count_kv", num_heads),
        head_size=head_size,
        intermediate_size=meta.int(f"{arch}.feed_forward_length"),
        vocab_size=int(embd.shape[1]),
        context_length=meta.int(f"{arch}.context_length"),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_interleaved=mapping.rope_interleaved,
        activation=mapping.activation,
        embedding_multiplier=mapping.embedding_multiplier(hidden) if mapping.embedding_multiplier else None,
        model_type=mapping.model_type,
    )
    name = str(meta.get("general.name", path.stem))
    return GGUFModel(path, arch, name, spec, tok, reader, tensors)


class _Metadata:
    """Typed access to GGUF key/values with clear errors for missing keys."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFFormatError(f"{self.path}: missing metadata key {key!r}")
            return default
        try:
            return field.contents()
        except Exception as e:
            raise GGUFFormatError(f"{self.path}: unreadable metadata key {key!r} ({e})") from e

    def int(self, key: str, default: Any = ...) -> int:
        return int(self.get(key, default))


def _tokenizer_meta(meta: _Metadata) -> TokenizerMeta:
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type", None)
    eos = meta.int("tokenizer.ggml.eos_token_id")
    return TokenizerMeta(
        model=str(meta.get("tokenizer.ggml.model")),
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=None if types is None else [int(t) for t in types],
        merges=merges,  # type: ignore[arg-type]
        bos_id=meta.int("tokenizer.ggml.bos_token_id", eos),
        eos_id=eos,
        pad_id=meta.int("tokenizer.ggml.padding_token_id", eos),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template", None),
    )


def convert_tensor(t: ReaderTensor, *, for_embedding: bool = False) -> LinearWeight:
    """One 2-D GGUF tensor [N rows, K] -> BlockQuantMatrix or float32 [N, K], exactly.

    ``for_embedding``: offset formats (Q4_1) are dequantized to float32, since GatherBlockQuantized
    has no per-block offset.
    """
    k, n = int(t.shape[0]), int(t.shape[1])  # ggml order: ne0 (contiguous) first
    tt = t.tensor_type
    if tt == T.F32:
        return np.asarray(t.data, np.float32).reshape(n, k)
    if tt == T.F16:
        return np.asarray(t.data, np.float16).reshape(n, k).astype(np.float32)
    if tt == T.BF16:
        raw = np.asarray(t.data).view(np.uint16).reshape(n, k).astype(np.uint32) << 16
        return raw.view(np.float32)
    converters = {T.Q4_0: from_q4_0, T.Q4_1: from_q4_1, T.Q8_0: from_q8_0}
    if tt not in converters:
        raise UnsupportedTensorTypeError(t.name, tt.name, SUPPORTED_TYPES)
    w = converters[tt](t.data, n, k)
    if for_embedding and w.offsets is not None:
        return w.dequantize().astype(np.float32)
    return w


def _vector(t: ReaderTensor) -> np.ndarray:
    if t.tensor_type not in (T.F32, T.F16, T.BF16):
        raise UnsupportedTensorTypeError(t.name, t.tensor_type.name, ("F32", "F16", "BF16"))
    return convert_tensor_1d(t)


def convert_tensor_1d(t: ReaderTensor) -> np.ndarray:
    """A 1-D float tensor (norm weights, biases, rope factors) -> float32 [n]."""
    if t.tensor_type == T.BF16:
        return (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(-1)
    return np.asarray(t.data, np.float32).reshape(-1)


def _load_weights(model: GGUFModel, on_tensor: Callable[[str], None] | None) -> ModelWeights:
    tensors, spec = model.tensors, model.spec

    def get(name: str, *, required: bool = True) -> ReaderTensor | None:
        t = tensors.get(name)
        if t is None and required:
            raise GGUFFormatError(f"{model.path}: missing tensor {name!r}")
        return t

    def matrix(name: str, **kw) -> LinearWeight:
        w = convert_tensor(get(name), **kw)
        if on_tensor:
            on_tensor(name)
        return w

    def vector(name: str) -> np.ndarray:
        v = _vector(get(name))
        if on_tensor:
            on_tensor(name)
        return v

    layers = []
    for i in range(spec.num_layers):
        p = f"blk.{i}"
        bias = None
        if f"{p}.attn_q.bias" in tensors:
            bias = np.concatenate([vector(f"{p}.attn_q.bias"), vector(f"{p}.attn_k.bias"), vector(f"{p}.attn_v.bias")])
        layers.append(LayerWeights(
            attn_norm=vector(f"{p}.attn_norm.weight"),
            q=matrix(f"{p}.attn_q.weight"), k=matrix(f"{p}.attn_k.weight"), v=matrix(f"{p}.attn_v.weight"),
            o=matrix(f"{p}.attn_output.weight"),
            ffn_norm=vector(f"{p}.ffn_norm.weight"),
            gate=matrix(f"{p}.ffn_gate.weight"), up=matrix(f"{p}.ffn_up.weight"), down=matrix(f"{p}.ffn_down.weight"),
            qkv_bias=bias,
        ))
    embedding = matrix("token_embd.weight", for_embedding=True)
    lm_head: LinearWeight
    if "output.weight" in tensors:
        lm_head = matrix("output.weight")
    elif isinstance(embedding, np.ndarray) and get("token_embd.weight").tensor_type == T.Q4_1:
        lm_head = convert_tensor(get("token_embd.weight"))  # keep the LM head exact and quantized
    else:
        lm_head = embedding  # tied
    rope = vector("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    if isinstance(embedding, BlockQuantMatrix) and embedding.bits not in (4, 8):
        raise UnsupportedTensorTypeError("token_embd.weight", str(embedding.bits), SUPPORTED_TYPES)
    return ModelWeights(embedding=embedding, layers=layers, output_norm=vector("output_norm.weight"),
                        lm_head=lm_head, rope_freq_factors=rope)
