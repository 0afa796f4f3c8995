"""Reads a GGUF file into ModelSpec + ModelWeights + tokenizer metadata, via an architecture table.

Architectures: llama (also Mistral and Llama 3.x with rope_freqs), qwen2, qwen3, gemma, gemma2, gemma3, phi3.

Validates the header, the architecture and every tensor type up front; memory-maps the file and converts one
tensor at a time (``StreamedWeights``), giving each tensor's pages back once it is converted, so a conversion holds
one converted tensor, not the model. Its own small parser (the gguf package's reader takes seconds on
a 49k-token vocabulary); only gguf's type constants are used. No onnx, no onnxruntime.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from engine.builder.errors import GGUFFormatError, UnsupportedArchitectureError, UnsupportedTensorTypeError
from engine.builder.ggml_quants import CONVERTERS, SUPPORTED_TYPES
from engine.builder.graph import LayerWeights, ModelSpec, ModelWeights
from engine.builder.quant import REQUANT_FORMATS, BlockQuantMatrix, LinearWeight, split_rows, to_q4_0

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# NOTE(builder): a tensor larger than this is converted in slices of rows: the ggml decoders' temporaries are several
# times a slice's size (Q6_K: ~10 bytes an element), which for a 128k-token LM head would be gigabytes.
CONVERT_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in ggml order (ne0 = contiguous row length first), ``data`` its raw bytes."""

    name: str
    tensor_type: T
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [n_bytes], a view into the memory-mapped file


class GGUFFile:
    """Parses a GGUF (v2/v3, little-endian) header: ``fields`` (key -> value) and ``tensors`` (name -> GGUFTensor).

    Raises:
        GGUFFormatError on a wrong magic/version, a truncated header or tensor data past the end.
        UnsupportedTensorTypeError on a ggml type id this gguf package does not know.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise GGUFFormatError(f"{path}: cannot read ({e})") from e
        self.buf = np.frombuffer(self._map, dtype=np.uint8)
        self.mv = memoryview(self.buf)
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
            raise GGUFFormatError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: {e})") from e

    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.mv, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        if self.pos + n > len(self.mv):
            raise ValueError("string runs past the end of the file")
        s = bytes(self.mv[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._read("<I"), self._read("<Q")
            if itype == _STRING:
                return [self._string() for _ in range(count)]
            if itype in _NUMPY:
                dt = np.dtype(_NUMPY[itype])
                arr = np.frombuffer(self.mv, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        if vtype in _SCALARS:
            return self._read(_SCALARS[vtype])
        raise ValueError(f"unknown GGUF value type {vtype}")

    def _parse(self) -> None:
        self.pos = 0
        if bytes(self.mv[:4]) != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (magic {bytes(self.mv[:4])!r}, expected b'GGUF')")
        self.pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        num_tensors, num_kv = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            self.fields[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            n_dims = self._read("<I")
            shape = tuple(self._read("<Q") for _ in range(n_dims))
            infos.append((name, self._read("<I"), shape, self._read("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = (self.pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, type_id, shape, offset in infos:
            try:
                ttype = T(type_id)
            except ValueError:
                raise UnsupportedTensorTypeError(name, f"id {type_id}", SUPPORTED_TYPES) from None
            block, type_size = GGML_QUANT_SIZES[ttype]
            n_bytes = int(np.prod(shape)) // block * type_size
            begin = start + offset
            if begin + n_bytes > len(self.buf):
                raise GGUFFormatError(
                    f"{self.path}: tensor {name!r} ends at byte {begin + n_bytes}, past the end of the file "
                    f"({len(self.buf)} bytes): the file is truncated")
            self.tensors[name] = GGUFTensor(name, ttype, shape, self.buf[begin : begin + n_bytes])

    def release(self, t: GGUFTensor) -> None:
        """Drops ``t``'s pages from this process's resident memory (they stay in the page cache; a later read of the
        tensor maps them again): a converted tensor's file pages no longer count against the conversion's RSS."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.data.ctypes.data - self.buf.ctypes.data
        begin = start // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, begin, start + t.data.nbytes - begin)


@dataclass(frozen=True)
class ArchMapping:
    """What differs between llama-like GGUF architectures; everything else is the shared graph.

    ``rope_interleaved``: llama.cpp's "normal" rope (llama GGUFs, whose converter permutes Q/K rows to
    adjacent pairs) vs NeoX rope (qwen2/3, gemma, phi3: half-split, rows as in HF).
    ``swa_pattern``: every n-th layer (the last of each n) is global, the others use the sliding window,
    as llama.cpp's ``set_swa_pattern(n)``; 0 means no sliding window even if the file names one.
    """

    model_type: str  # genai_config model.type
    rope_interleaved: bool = True
    activation: str = "silu"
    gemma_scale: bool = False  # embeddings times sqrt(hidden); attention scale per llama.cpp's gemma rule
    qk_norm: bool = False
    post_norms: bool = False
    swa_pattern: int = 0
    fused_qkv: bool = False  # attn_qkv.weight, and ffn_up holding gate then up (phi3)


ARCHITECTURES: dict[str, ArchMapping] = {
    "llama": ArchMapping("llama"),
    "qwen2": ArchMapping("qwen2", rope_interleaved=False),
    "qwen3": ArchMapping("qwen3", rope_interleaved=False, qk_norm=True),
    # NOTE(builder): llama.cpp's converters store gemma's RMSNorm weights as (1 + w) already.
    "gemma": ArchMapping("gemma", rope_interleaved=False, activation="gelu_tanh", gemma_scale=True),
    "gemma2": ArchMapping("gemma2", rope_interleaved=False, activation="gelu_tanh", gemma_scale=True,
                          post_norms=True, swa_pattern=2),
    "gemma3": ArchMapping("gemma3_text", rope_interleaved=False, activation="gelu_tanh", gemma_scale=True,
                          qk_norm=True, post_norms=True, swa_pattern=6),
    "phi3": ArchMapping("phi3", rope_interleaved=False, fused_qkv=True),
}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales 27B's queries by 1/sqrt(hidden/heads)


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
    scores: list[float] | None = None  # SentencePiece piece scores
    add_eos: bool = False
    add_space_prefix: bool = True  # SentencePiece: prepend "▁" to the text (llama.cpp's default: true)
    unk_id: int | None = None
    eot_id: int | None = None  # tokenizer.ggml.eot_token_id (an end-of-turn token, e.g. <end_of_turn>)
    # tokenizer.ggml.{eom,fim_pad,fim_rep,fim_sep}_token_id where the GGUF names them (end-of-generation ids)
    eom_id: int | None = None
    fim_ids: tuple[int | None, int | None, int | None] = (None, None, None)  # pad, repo, file separator


@dataclass
class GGUFModel:
    """Everything a conversion needs from one GGUF file."""

    path: Path
    architecture: str
    name: str
    spec: ModelSpec
    tokenizer: TokenizerMeta
    tensors: dict[str, GGUFTensor]
    pooling: str | None = None  # {arch}.pooling_type (embedding GGUFs): "mean", "cls" or "last"; None: not named
    file: GGUFFile | None = None

    def load_weights(self, on_tensor: Callable[[str], None] | None = None) -> ModelWeights:
        """Converts every tensor exactly (see engine.builder.ggml_quants); calls ``on_tensor(name)`` after each."""
        s = self.stream_weights(on_tensor)
        embedding = s.embedding
        return ModelWeights(embedding=embedding, layers=list(s.layers), output_norm=s.output_norm,
                            lm_head=embedding if s.tied else s.lm_head, rope_freq_factors=s.rope_freq_factors)

    def stream_weights(self, on_tensor: Callable[[str], None] | None = None,
                       requant: str | None = None) -> StreamedWeights:
        """The weights as ``build_graph`` reads them, each converted when read and not kept (see StreamedWeights);
        ``requant``: "q4_0" requantizes the linears stored in more than 4 bits (quant.to_q4_0), else exact."""
        return StreamedWeights(self, on_tensor, requant)

    @property
    def num_tensors(self) -> int:
        """Tensors a conversion reads (those of the kept layers)."""
        return len(self.converted_tensors())

    def converted_tensors(self) -> list[GGUFTensor]:
        """The tensors a conversion reads: all but those of layers dropped by ``max_layers``."""
        return [t for name, t in self.tensors.items()
                if not name.startswith("blk.") or int(name.split(".")[1]) < self.spec.num_layers]


def open_gguf(path: str | Path, *, max_layers: int | None = None) -> GGUFModel:
    """Opens and validates a GGUF file (header, architecture, hyperparameters, tensor types).

    Args:
        path: the .gguf file.
        max_layers: keep only the first N decoder blocks (tests build truncated models).
    Raises:
        GGUFFormatError, UnsupportedArchitectureError, UnsupportedTensorTypeError.
    """
    path = Path(path)
    gguf = GGUFFile(path)
    meta = _Metadata(gguf.fields, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    mapping = ARCHITECTURES[arch]
    tensors = gguf.tensors
    for t in tensors.values():
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise UnsupportedTensorTypeError(t.name, t.tensor_type.name, SUPPORTED_TYPES)

    hidden = meta.int(f"{arch}.embedding_length")
    num_heads = meta.int(f"{arch}.attention.head_count")
    head_size = meta.int(f"{arch}.attention.key_length", hidden // num_heads)
    if meta.int(f"{arch}.attention.value_length", head_size) != head_size:
        raise UnsupportedArchitectureError(f"{path}: keys and values of different head sizes are not supported")
    rope_dims = meta.int(f"{arch}.rope.dimension_count", head_size)
    if rope_dims != head_size:
        raise UnsupportedArchitectureError(f"{path}: partial rotary ({rope_dims} of {head_size} dims) is not supported")
    if any(name.startswith("rope_factors_long") or ".rope_factors_long" in name for name in tensors):
        raise UnsupportedArchitectureError(f"{path}: LongRoPE (rope_factors_long, 128k Phi-3) is not supported")
    total_layers = meta.int(f"{arch}.block_count")
    num_layers = min(total_layers, max_layers) if max_layers is not None else total_layers
    tok = _tokenizer_meta(meta)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFFormatError(f"{path}: no token_embd.weight tensor")
    window = meta.int(f"{arch}.attention.sliding_window", 0) if mapping.swa_pattern else 0
    sliding = _sliding_layers(meta, arch, mapping.swa_pattern, total_layers) if window else ()
    attention_scale = None
    if mapping.gemma_scale and total_layers == _GEMMA_27B_LAYERS.get(arch):
        attention_scale = float(np.float32(1.0) / np.sqrt(np.float32(hidden // num_heads)))
    softcap = {key: float(meta.get(f"{arch}.{key}", 0.0)) or None
               for key in ("attn_logit_softcapping", "final_logit_softcapping")}
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
        embedding_multiplier=float(np.sqrt(np.float32(hidden), dtype=np.float32)) if mapping.gemma_scale else None,
        attention_scale=attention_scale,
        model_type=mapping.model_type,
        qk_norm=mapping.qk_norm,
        post_norms=mapping.post_norms,
        sliding_window=window or None,
        sliding_layers=tuple(sliding[:num_layers]),
        rope_theta_local=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
        rope_scale=_rope_scale(meta, arch, path),
        attn_logit_softcap=softcap["attn_logit_softcapping"],
        final_logit_softcap=softcap["final_logit_softcapping"],
    )
    name = str(meta.get("general.name", path.stem))
    # llama.cpp's enum llama_pooling_type: 0 none, 1 mean, 2 cls, 3 last (4 rank: a reranker's, not ours)
    pooling = {1: "mean", 2: "cls", 3: "last"}.get(int(meta.get(f"{arch}.pooling_type", 0) or 0))
    return GGUFModel(path, arch, name, spec, tok, tensors, pooling, gguf)


def _sliding_layers(meta: _Metadata, arch: str, pattern: int, num_layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window: ``{arch}.attention.sliding_window_pattern`` (a per-layer bool
    array, or the period n), else the architecture's period (llama.cpp's set_swa_pattern: il % n < n - 1)."""
    value = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
    if isinstance(value, list):
        if len(value) < num_layers:
            raise GGUFFormatError(f"{meta.path}: sliding_window_pattern has {len(value)} entries for {num_layers} layers")
        return tuple(bool(v) for v in value[:num_layers])
    n = int(value)
    return tuple(n == 0 or i % n < n - 1 for i in range(num_layers))


def _rope_scale(meta: _Metadata, arch: str, path: Path) -> float:
    """The linear rope scaling factor (1.0 without scaling); other scaling types are refused."""
    kind = meta.get(f"{arch}.rope.scaling.type", None)
    if kind is None:
        return float(meta.get(f"{arch}.rope.scale_linear", 1.0) or 1.0)
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind == "none" or factor == 1.0:
        return 1.0
    if kind == "linear":
        return factor
    raise UnsupportedArchitectureError(
        f"{path}: rope scaling {kind!r} is not supported (supported: none, linear, and llama3's rope_freqs)")


class _Metadata:
    """Typed access to GGUF key/values with clear errors for missing keys."""

    def __init__(self, fields: dict[str, Any], path: Path) -> None:
        self.fields, self.path = fields, path

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self.fields:
            if default is ...:
                raise GGUFFormatError(f"{self.path}: missing metadata key {key!r}")
            return default
        return self.fields[key]

    def int(self, key: str, default: Any = ...) -> int:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise GGUFFormatError(f"{self.path}: metadata key {key!r} should be a number, got {value!r}")
        return int(value)


def _tokenizer_meta(meta: _Metadata) -> TokenizerMeta:
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = meta.get("tokenizer.ggml.token_type", None)
    scores = meta.get("tokenizer.ggml.scores", None)
    eos = meta.int("tokenizer.ggml.eos_token_id")
    model = str(meta.get("tokenizer.ggml.model"))
    unk = meta.get("tokenizer.ggml.unknown_token_id", None)
    eot = meta.get("tokenizer.ggml.eot_token_id", None)

    def opt(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id", None)
        return None if value is None else int(value)

    return TokenizerMeta(
        model=model,
        pre=str(meta.get("tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=None if types is None else [int(t) for t in types],
        merges=merges,  # type: ignore[arg-type]
        bos_id=meta.int("tokenizer.ggml.bos_token_id", eos),
        eos_id=eos,
        pad_id=meta.int("tokenizer.ggml.padding_token_id", eos),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        chat_template=meta.get("tokenizer.chat_template", None),
        scores=None if scores is None else [float(x) for x in scores],
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        unk_id=None if unk is None else int(unk),
        eot_id=None if eot is None else int(eot),
        eom_id=opt("eom"),
        fim_ids=(opt("fim_pad"), opt("fim_rep"), opt("fim_sep")),
    )


def convert_tensor(t: GGUFTensor, chunk_elements: int = CONVERT_CHUNK_ELEMENTS) -> LinearWeight:
    """One 2-D GGUF tensor [N rows, K] -> BlockQuantMatrix or float32 [N, K], exactly.

    A quantized tensor of more than ``chunk_elements`` is converted a slice of rows at a time into arrays made
    once (rows are independent in every ggml format), so the decoders' temporaries stay a slice's size.
    """
    if len(t.shape) != 2:
        raise GGUFFormatError(f"tensor {t.name!r} should be 2-D, has shape {t.shape}")
    k, n = int(t.shape[0]), int(t.shape[1])  # ggml order: ne0 (contiguous) first
    tt = t.tensor_type
    if tt in (T.F32, T.F16, T.BF16):
        return convert_vector(t).reshape(n, k)
    if tt not in CONVERTERS:
        raise UnsupportedTensorTypeError(t.name, tt.name, SUPPORTED_TYPES)
    convert = CONVERTERS[tt]
    try:
        rows = max(1, chunk_elements // max(k, 1))
        if rows >= n:
            return convert(t.data, n, k)
        if t.data.nbytes % n:
            raise ValueError(f"{t.data.nbytes} bytes are not {n} whole rows")
        row_bytes = t.data.nbytes // n
        out: BlockQuantMatrix | None = None
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            part = convert(t.data[start * row_bytes : stop * row_bytes], stop - start, k)
            if out is None:  # the whole tensor's arrays, shaped after the first slice's
                out = BlockQuantMatrix(
                    part.bits, part.block_size, np.empty((n, *part.packed.shape[1:]), part.packed.dtype),
                    np.empty((n, *part.scales.shape[1:]), part.scales.dtype),
                    None if part.offsets is None else np.empty((n, *part.offsets.shape[1:]), part.offsets.dtype))
            out.packed[start:stop] = part.packed
            out.scales[start:stop] = part.scales
            if out.offsets is not None:
                out.offsets[start:stop] = part.offsets
        return out
    except ValueError as e:  # a row length that is not a whole number of blocks
        raise GGUFFormatError(f"tensor {t.name!r} ({tt.name}, shape {t.shape}): {e}") from e


def convert_vector(t: GGUFTensor) -> np.ndarray:
    """A float tensor (F32/F16/BF16: norm weights, biases, rope factors) -> flat float32."""
    if t.tensor_type == T.F32:
        return t.data.view(np.float32).copy()
    if t.tensor_type == T.F16:
        return t.data.view(np.float16).astype(np.float32)
    if t.tensor_type == T.BF16:
        return (t.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise UnsupportedTensorTypeError(t.name, t.tensor_type.name, ("F32", "F16", "BF16"))


class StreamedWeights:
    """A GGUF's weights as ``build_graph`` reads them (``graph.ModelWeights``' attributes): each tensor is converted
    when its attribute is read (a layer when ``layers[i]`` is), handed over and not kept, and its file pages are
    given back (``GGUFFile.release``). ``on_tensor(name)`` is called after each tensor.

    NOTE(builder): reading an attribute twice converts twice; build_graph reads each once, in graph order (a tied
    LM head converts the embedding's scales a second time, its codes are shared).
    """

    def __init__(self, model: GGUFModel, on_tensor: Callable[[str], None] | None = None,
                 requant: str | None = None) -> None:
        if requant is not None and requant not in REQUANT_FORMATS:
            raise ValueError(f"requant must be one of {REQUANT_FORMATS} or None, got {requant!r}")
        self.model = model
        self.on_tensor = on_tensor
        self.requant = requant  # "q4_0": every linear stored in more than 4 bits requantized (quant.to_q4_0)
        self.mapping = ARCHITECTURES[model.architecture]
        self.tied = "output.weight" not in model.tensors
        self.layers: Sequence[LayerWeights] = _Layers(self)

    def _get(self, name: str) -> GGUFTensor:
        t = self.model.tensors.get(name)
        if t is None:
            raise GGUFFormatError(f"{self.model.path}: missing tensor {name!r}")
        return t

    def _done(self, t: GGUFTensor) -> None:
        if self.model.file is not None:
            self.model.file.release(t)
        if self.on_tensor:
            self.on_tensor(t.name)

    def matrix(self, name: str) -> LinearWeight:
        t = self._get(name)
        w = convert_tensor(t)
        self._done(t)
        return to_q4_0(w) if self.requant == "q4_0" else w

    def vector(self, name: str, *, required: bool = True) -> np.ndarray | None:
        if not required and name not in self.model.tensors:
            return None
        t = self._get(name)
        v = convert_vector(t)
        self._done(t)
        return v

    @property
    def embedding(self) -> LinearWeight:
        return self.matrix("token_embd.weight")

    @property
    def lm_head(self) -> LinearWeight:
        return self.matrix("token_embd.weight" if self.tied else "output.weight")

    @property
    def output_norm(self) -> np.ndarray:
        return self.vector("output_norm.weight")

    @property
    def rope_freq_factors(self) -> np.ndarray | None:
        return self.vector("rope_freqs.weight", required=False)

    def layer(self, i: int) -> LayerWeights:
        """Decoder block ``i``, converted now."""
        spec, tensors, mapping = self.model.spec, self.model.tensors, self.mapping
        matrix, vector = self.matrix, self.vector
        hd, nh, kvh, f = spec.head_size, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
        p = f"blk.{i}"
        bias = None
        if f"{p}.attn_q.bias" in tensors:
            bias = np.concatenate([vector(f"{p}.attn_q.bias"), vector(f"{p}.attn_k.bias"), vector(f"{p}.attn_v.bias")])
        if mapping.fused_qkv and f"{p}.attn_qkv.weight" in tensors:  # phi3: [q; k; v] rows in one tensor
            q, k, v = split_rows(matrix(f"{p}.attn_qkv.weight"), [nh * hd, kvh * hd, kvh * hd])
        else:
            q, k, v = matrix(f"{p}.attn_q.weight"), matrix(f"{p}.attn_k.weight"), matrix(f"{p}.attn_v.weight")
        if mapping.fused_qkv and f"{p}.ffn_gate.weight" not in tensors:  # phi3: ffn_up holds [gate; up]
            gate, up = split_rows(matrix(f"{p}.ffn_up.weight"), [f, f])
        else:
            gate, up = matrix(f"{p}.ffn_gate.weight"), matrix(f"{p}.ffn_up.weight")
        return LayerWeights(
            attn_norm=vector(f"{p}.attn_norm.weight"), q=q, k=k, v=v, o=matrix(f"{p}.attn_output.weight"),
            ffn_norm=vector(f"{p}.ffn_norm.weight"), gate=gate, up=up, down=matrix(f"{p}.ffn_down.weight"),
            qkv_bias=bias,
            q_norm=vector(f"{p}.attn_q_norm.weight", required=spec.qk_norm),
            k_norm=vector(f"{p}.attn_k_norm.weight", required=spec.qk_norm),
            post_attn_norm=vector(f"{p}.post_attention_norm.weight", required=spec.post_norms),
            post_ffn_norm=vector(f"{p}.post_ffw_norm.weight", required=spec.post_norms),
        )


class _Layers(Sequence):
    """``StreamedWeights.layers``: block i is converted when indexed."""

    def __init__(self, weights: StreamedWeights) -> None:
        self._weights = weights

    def __len__(self) -> int:
        return self._weights.model.spec.num_layers

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._weights.layer(i % len(self))
