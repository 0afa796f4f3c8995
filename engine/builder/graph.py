"""The decoder graph shared by GGUF conversion and synthetic models: same ops, only the weights differ.

Builds an onnx.ModelProto with ONNX Runtime contrib ops (GroupQueryAttention, MatMulNBits,
GatherBlockQuantized, (Skip)SimplifiedLayerNormalization). Imports onnx, never onnxruntime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.builder.external import ExternalData
from engine.builder.quant import BlockQuantMatrix, LinearWeight, concat_rows

log = logging.getLogger(__name__)

OPSET = 21
LOGITS_TO_KEEP = "logits_to_keep"  # optional int64 [1] input: logits only for the last N positions (0: all)
DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
TIED = "tied embedding"  # the share key of a tied embedding's codes (_Graph.packed)


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of a llama-like decoder (names as in Hugging Face configs).

    ``rope_interleaved`` is True when Q/K rows rotate adjacent pairs (ggml's "normal" rope, which is how
    llama GGUFs store Q/K) and False for the half-split (NeoX) layout used by qwen2/gemma GGUFs.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    context_length: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_interleaved: bool = True
    activation: str = "silu"  # "silu" or "gelu_tanh"
    embedding_multiplier: float | None = None  # gemma: sqrt(hidden_size)
    attention_scale: float | None = None  # None: 1/sqrt(head_size)
    model_type: str = "llama"  # genai_config model.type
    qk_norm: bool = False  # RMS-normalize each query and key head before rotary (qwen3, gemma3)
    post_norms: bool = False  # RMS-normalize the attention and MLP outputs before their residual add (gemma2/3)
    sliding_window: int | None = None  # keys a sliding-window layer attends to, itself included (llama.cpp n_swa)
    sliding_layers: tuple[bool, ...] = ()  # per layer: True where the layer uses the sliding window
    rope_theta_local: float | None = None  # rope base of the sliding-window layers (gemma3: 10000)
    rope_scale: float = 1.0  # linear rope scaling of the global layers: positions are divided by it
    attn_logit_softcap: float | None = None  # gemma2: scores = c * tanh(scores / c)
    final_logit_softcap: float | None = None  # gemma2: logits = c * tanh(logits / c)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_window) and layer < len(self.sliding_layers) and self.sliding_layers[layer]


@dataclass
class LayerWeights:
    """One decoder block. Linear weights are [out_features, in_features]; norms float [hidden]."""

    attn_norm: np.ndarray
    q: LinearWeight
    k: LinearWeight
    v: LinearWeight
    o: LinearWeight
    ffn_norm: np.ndarray
    gate: LinearWeight
    up: LinearWeight
    down: LinearWeight
    qkv_bias: np.ndarray | None = None  # [(num_heads + 2*num_kv_heads) * head_size] (qwen2)
    q_norm: np.ndarray | None = None  # [head_size], with ModelSpec.qk_norm
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # [hidden], with ModelSpec.post_norms
    post_ffn_norm: np.ndarray | None = None


@dataclass
class ModelWeights:
    """All weights. ``embedding`` [vocab, hidden] is quantized along hidden when a BlockQuantMatrix;
    ``lm_head`` [vocab, hidden] may be the same object (tied embeddings).

    ``build_graph`` also takes any object with these attributes whose values are made when read (a GGUF's
    ``engine.builder.gguf_reader.StreamedWeights``): it reads each once, in graph order, and keeps none of them, so
    with external data (``ExternalData``) only one tensor at a time is in memory.
    """

    embedding: LinearWeight
    layers: Sequence[LayerWeights]
    output_norm: np.ndarray
    lm_head: LinearWeight
    rope_freq_factors: np.ndarray | None = None  # [head_size/2] divisors of the rope frequencies (llama3)

    @property
    def tied(self) -> bool:
        """The LM head is the embedding (one initializer serves both)."""
        return self.lm_head is self.embedding


@dataclass
class _Graph:
    """Accumulates nodes and initializers; ``dtype`` is the activation dtype. With ``data`` every initializer's bytes
    go to the external data file as it is made, and the graph keeps only a pointer to them."""

    np_dtype: type
    onnx_dtype: int
    accuracy_level: int
    data: ExternalData | None = None
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    blocksums: dict[tuple[str, int], str] = field(default_factory=dict)
    casts: dict[tuple[str, int], str] = field(default_factory=dict)
    packed_names: dict[str, str] = field(default_factory=dict)  # share key -> initializer name
    exact_scales: bool = False  # float16 builds: keep K-quant linears in float32 (True) or round their scales
    float32_linears: list[str] = field(default_factory=list)  # float16 builds, exact_scales: linears kept in float32
    rounded_scales: list[str] = field(default_factory=list)  # float16 builds: linears whose scales were rounded

    def scale_dtype(self, scales: np.ndarray, name: str) -> tuple[type, int]:
        """The dtype a quantized weight's scales (and its MatMulNBits) run in: the activation dtype, or float32
        for a float16 build with ``exact_scales`` whose scales float16 cannot hold (``linear_parts``' note). Records
        ``name`` in ``rounded_scales`` or ``float32_linears`` when float16 cannot hold them (the build's log line)."""
        dt = self.np_dtype
        if dt == np.float32 or np.array_equal(scales.astype(dt).astype(np.float32), scales):
            return dt, self.onnx_dtype
        if not self.exact_scales:
            self.rounded_scales.append(name)
            return dt, self.onnx_dtype
        self.float32_linears.append(name)
        return np.float32, TensorProto.FLOAT

    def node(self, op: str, inputs: list[str], outputs: list[str] | int, name: str, domain: str = "", **attrs):
        """Adds a node; ``outputs`` as an int makes that many names from ``name``. Returns output names."""
        if isinstance(outputs, int):
            outputs = [f"{name}/out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def const(self, name: str, array: np.ndarray) -> str:
        if self.data is not None:
            self.inits.append(self.data.tensor(name, array))
        else:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def packed(self, name: str, w: BlockQuantMatrix, share: str | None = None) -> str:
        """The quantized codes [N, nb, bytes] as an initializer, once per ``share`` key: a tied embedding and LM head
        (GatherBlockQuantized and MatMulNBits) share it instead of storing the vocabulary twice."""
        key = share or name
        if key not in self.packed_names:
            self.packed_names[key] = self.const(name, w.packed)
        return self.packed_names[key]

    def act(self, name: str, array: np.ndarray, np_dtype: type | None = None) -> str:
        """An initializer in the activation dtype (or ``np_dtype``)."""
        return self.const(name, np.asarray(array, np.float64).astype(np_dtype or self.np_dtype))

    def cast(self, x: str, to: int) -> str:
        """``x`` cast to the ONNX type ``to`` (one Cast node per input and type)."""
        if (x, to) not in self.casts:
            (self.casts[(x, to)],) = self.node("Cast", [x], 1, f"{x}/cast{to}", to=to)
        return self.casts[(x, to)]

    # --- linear layers -------------------------------------------------------------------------

    def linear(self, x: str, w: LinearWeight, name: str, bias: np.ndarray | None = None,
               share: str | None = None) -> str:
        """y = x @ w.T (+ bias). x: [B, S, K] -> [B, S, N]. ``share``: see ``packed``."""
        y, correction = self.linear_parts(x, w, name, bias, share)
        if correction is not None:
            (y,) = self.node("Add", [y, correction], 1, f"{name}/offset_add")
        return y

    def linear_parts(self, x: str, w: LinearWeight, name: str, bias: np.ndarray | None = None,
                     share: str | None = None) -> tuple[str, str | None]:
        """``x @ w.T`` as two terms whose sum is exact: (MatMulNBits, blocksum(x) @ offsets.T or None).

        A caller whose next op adds anyway (a post-norm becomes a SkipSimplifiedLayerNormalization) takes the
        correction as that op's skip input instead of an Add node of its own.
        """
        if isinstance(w, np.ndarray):
            (y,) = self.node("MatMul", [x, self.act(f"{name}.weight_t", w.T)], 1, name)
            if bias is not None:
                (y,) = self.node("Add", [y, self.act(f"{name}.bias", bias)], 1, f"{name}/bias")
            return y, None
        # NOTE(builder): MatMulNBits takes its scales in the activation dtype. K-quant sub-block scales (an f16
        # times a 6- or 8-bit integer) need up to 19 significant bits, so float16 rounds them by at most 2**-11 of
        # each block's scale: the size of the float16 activations' own rounding, and below what llama.cpp's CUDA
        # kernels do to the activations (8-bit). A float16 build rounds them by default: the linear stays one
        # float16 MatMulNBits on the GPU's fast path (the Llama-3.1-8B Q4_K_M on the H200: docs/perf/sizes.md).
        # ``exact_scales`` keeps every value exact instead: such a linear runs in float32 between two Casts
        # (listed in ``float32_linears``), on the GPUs' slower float32 kernels.
        dt, onnx_dt = self.scale_dtype(w.scales, name)
        if dt != self.np_dtype:
            x = self.cast(x, onnx_dt)
        n, k = w.shape
        correction = None
        if w.offsets is not None:
            # NOTE(builder): exact offsets (Q4_1, K-quant mins): x @ W.T = MatMulNBits(u, s) + blocksum(x) @ offsets.T.
            # Their nodes come before the MatMulNBits: ONNX Runtime runs nodes in graph order, and the small
            # ones read x while it is still in cache, not after the MatMulNBits has streamed its weights
            # through it (Gemma 3 270M, 2 AVX2 cores: about 1 ms of a 28 ms decode step).
            bsum = self.blocksum(x, k, w.block_size)
            offsets_t = self.act(f"{name}.block_offsets_t", w.offsets.T, dt)  # [K/bs, N]
            (correction,) = self.node("MatMul", [bsum, offsets_t], 1, f"{name}/offset_matmul")
        inputs = [x, self.packed(f"{name}.qweight", w, share), self.act(f"{name}.scales", w.scales.reshape(-1), dt)]
        if bias is not None:
            inputs += ["", "", self.act(f"{name}.bias", bias, dt)]
        (y,) = self.node(
            "MatMulNBits", inputs, 1, name, "com.microsoft",
            K=k, N=n, bits=w.bits, block_size=w.block_size, accuracy_level=self.accuracy_level,
        )
        if dt != self.np_dtype:
            if correction is not None:
                (y,) = self.node("Add", [y, correction], 1, f"{name}/offset_add")
                correction = None
            (y,) = self.node("Cast", [y], 1, f"{name}/cast_back", to=self.onnx_dtype)
        return y, correction

    def rms_norm(self, x: str, weight: np.ndarray, name: str, eps: float, skip: str | None = None) -> str:
        """RMS norm of ``x`` (+ ``skip``, added first, in one SkipSimplifiedLayerNormalization)."""
        if skip is None:
            (y,) = self.node("SimplifiedLayerNormalization", [x, self.act(f"{name}.weight", weight)], 1, name,
                             axis=-1, epsilon=eps, stash_type=1)
            return y
        (y, _, _, _) = self.node("SkipSimplifiedLayerNormalization", [x, skip, self.act(f"{name}.weight", weight)],
                                 [f"{name}/out0", "", "", ""], name, "com.microsoft", epsilon=eps)
        return y

    def blocksum(self, x: str, k: int, block_size: int) -> str:
        """Sum of x over consecutive blocks along its last axis: [B, S, K] -> [B, S, K/bs]; cached per x."""
        key = (x, block_size)
        if key not in self.blocksums:
            shape = self.const(f"{x}/blocks_shape", np.array([0, 0, k // block_size, block_size], np.int64))
            (xb,) = self.node("Reshape", [x, shape], 1, f"{x}/blocks")  # [B, S, K/bs, bs]
            axes = self.const(f"{x}/blocks_axes", np.array([-1], np.int64))
            (self.blocksums[key],) = self.node("ReduceSum", [xb, axes], 1, f"{x}/blocksum", keepdims=0)
        return self.blocksums[key]

    def linears(self, x: str, ws: list[LinearWeight], name: str, bias: np.ndarray | None = None) -> str:
        """Several linears on one input as one fused op when possible: [B, S, K] -> [B, S, sum(N)]."""
        fused = concat_rows(ws)
        if fused is not None:
            return self.linear(x, fused, name, bias)
        ys = []
        offset = 0
        for i, w in enumerate(ws):
            n = w.shape[0]
            part_bias = None if bias is None else bias[offset : offset + n]
            ys.append(self.linear(x, w, f"{name}.{i}", part_bias))
            offset += n
        (y,) = self.node("Concat", ys, 1, f"{name}/concat", axis=-1)
        return y


def rope_cache(spec: ModelSpec, freq_factors: np.ndarray | None, *, local: bool = False,
               ) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches for GroupQueryAttention: float64 [context_length, head_size/2] each.

    ``local``: the sliding-window layers' cache (``rope_theta_local``, no linear scaling), as llama.cpp's
    ``rope_freq_base_train_swa``; the global cache divides positions by ``rope_scale``.
    """
    half = spec.head_size // 2
    theta = spec.rope_theta_local if local and spec.rope_theta_local else spec.rope_theta
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2.0 / spec.head_size)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    positions = np.arange(spec.context_length, dtype=np.float64)
    if not local:
        positions = positions / spec.rope_scale
    angles = positions[:, None] * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def _keep_last_positions(g: _Graph, h: str) -> str:
    """Slice the last ``logits_to_keep`` positions of ``h`` [B, S, H] before the LM head (0 keeps all).

    A prefill chunk only needs its last position's logits; the LM head over every position is ~20% of a
    prompt's work and a [S, vocab] float32 output. Rows are independent, so the kept logits are the same.
    """
    keep = g.const(LOGITS_TO_KEEP, np.array([0], np.int64))  # the default: all positions
    (positive,) = g.node("Greater", [keep, g.const("zero_i64_1d", np.array([0], np.int64))], 1, "keep/positive")
    (neg,) = g.node("Neg", [keep], 1, "keep/neg")
    (start,) = g.node("Where", [positive, neg, "zero_i64_1d"], 1, "keep/start")  # [1]: -keep, or 0 for all
    ends = g.const("keep/ends", np.array([np.iinfo(np.int64).max], np.int64))
    (out,) = g.node("Slice", [h, start, ends, g.const("keep/axes", np.array([1], np.int64))], 1, "keep/slice")
    return out


def _embedding(g: _Graph, emb: LinearWeight, tied: bool) -> str:
    """input_ids [B, S] -> [B, S, H]: an exact gather of the (quantized) embedding rows.

    GatherBlockQuantized has no additive offset, so offset formats (Q4_1, K-quant mins) also gather their
    per-block offsets [V, H/bs] and add them, broadcast over each block, in float32 or the activation dtype.
    """
    if not isinstance(emb, BlockQuantMatrix):
        (x,) = g.node("Gather", [g.act("embed.weight", emb), "input_ids"], 1, "embed", axis=0)
        return x
    dt, _ = g.scale_dtype(emb.scales, "embed")  # see _Graph.linear_parts: K-quant scales in a float16 build
    hidden = emb.shape[1]
    # [V, nb, bytes] codes quantized along their last axis, scales [V, nb, 1]: the MatMulNBits layout, so the
    # LM head of a tied model reads the same initializer.
    (x,) = g.node(
        "GatherBlockQuantized",
        [g.packed("lm_head.qweight" if tied else "embed.qweight", emb, TIED if tied else None), "input_ids",
         g.act("embed.scales", emb.scales[..., None], dt)],
        1, "embed", "com.microsoft", bits=emb.bits, block_size=emb.block_size, gather_axis=0, quantize_axis=2,
    )  # [B, S, nb, bs]
    if emb.offsets is not None:  # + offsets [V, nb] gathered: [B, S, nb] -> [B, S, nb, 1], broadcast over blocks
        (off,) = g.node("Gather", [g.act("embed.offsets", emb.offsets, dt), "input_ids"], 1, "embed/offsets",
                        axis=0)
        (off,) = g.node("Unsqueeze", [off, g.const("embed/offsets_axes", np.array([-1], np.int64))], 1,
                        "embed/offsets_unsqueeze")
        (x,) = g.node("Add", [x, off], 1, "embed/offsets_add")
    (x,) = g.node("Reshape", [x, g.const("embed/hidden_shape", np.array([0, 0, hidden], np.int64))], 1,
                  "embed/rows")  # [B, S, H]
    if dt != g.np_dtype:
        (x,) = g.node("Cast", [x], 1, "embed/cast", to=g.onnx_dtype)
    return x


def _head_norm(g: _Graph, x: str, weight: np.ndarray | None, heads: int, head_size: int, eps: float,
               name: str) -> str:
    """RMS norm of each head: [B, S, heads*hd] -> [B, S, heads, hd] -> norm over hd -> [B, S, heads*hd]."""
    if weight is None:
        raise ValueError(f"{name}: qk_norm needs q_norm and k_norm weights")
    (xh,) = g.node("Reshape", [x, g.const(f"{name}/heads_shape", np.array([0, 0, heads, head_size], np.int64))],
                   1, f"{name}/heads")
    (xn,) = g.node("SimplifiedLayerNormalization", [xh, g.act(f"{name}.weight", weight)], 1, name, axis=-1,
                   epsilon=eps, stash_type=1)
    (y,) = g.node("Reshape", [xn, g.const(f"{name}/flat_shape", np.array([0, 0, heads * head_size], np.int64))],
                  1, f"{name}/flat")
    return y


def build_graph(
    spec: ModelSpec,
    weights: ModelWeights,
    *,
    dtype: str = "float32",
    accuracy_level: int = 4,
    on_layer: Callable[[int], None] | None = None,
    data: ExternalData | None = None,
    kv_dtype: str | None = None,
    exact_scales: bool = False,
) -> onnx.ModelProto:
    """Builds the decoder graph (I/O names and shapes as in docs/ARCHITECTURE.md).

    Beside those, the optional input ``logits_to_keep`` (int64 [1], default 0 = all) limits ``logits`` to
    the last N positions, ``[B, N, vocab]``; the engine sets it to 1 for prefill chunks.

    Args:
        spec: model hyperparameters.
        weights: the model's weights (quantized or float).
        dtype: activation and KV dtype, "float32" or "float16"; logits are always float32.
        accuracy_level: MatMulNBits accuracy_level (0 exact reference, 4 int8 activations).
        on_layer: called with the layer index after each decoder block is added (progress bars).
        data: where the weights go as they are made (the model's external data file); None keeps them inside
            the returned model.
        kv_dtype: the KV cache's dtype when it differs from ``dtype`` (float16 KV beside float32 activations, as
            llama.cpp keeps it on the CPU): attention then runs in ``kv_dtype`` between two Casts. None: ``dtype``.
        exact_scales: a float16 build keeps the linears whose scales float16 cannot hold exactly (K-quants) in
            float32 between two Casts; False (the default) rounds those scales to float16 (``_Graph.linear_parts``).
    Returns:
        The model; without ``data`` its weights are still inside it (save with external data).
    """
    np_dtype, onnx_dtype = DTYPES[dtype]
    kv_np_dtype, kv_onnx_dtype = DTYPES[kv_dtype or dtype]
    g = _Graph(np_dtype, onnx_dtype, accuracy_level, data, exact_scales=exact_scales)
    tied = weights.tied
    hd, nh, kvh = spec.head_size, spec.num_heads, spec.num_kv_heads

    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", spec.vocab_size])]
    for i in range(spec.num_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(
                f"past_key_values.{i}.{kind}", kv_onnx_dtype, ["batch_size", kvh, "past_sequence_length", hd]))
            outputs.append(helper.make_tensor_value_info(
                f"present.{i}.{kind}", kv_onnx_dtype, ["batch_size", kvh, "present_sequence_length", hd]))

    # 1. GQA's sequence lengths from the mask: seqlens_k = sum(mask) - 1, total = mask width (int32).
    # NOTE(builder): the sum runs in float32 (exact for counts below 2**24): GPU EPs such as WebGPU have no
    # int64 arithmetic, and one int64 node left on the CPU EP forbids graph capture.
    (mask_f,) = g.node("Cast", ["attention_mask"], 1, "mask_to_float", to=TensorProto.FLOAT)  # [B, T]
    (mask_sum,) = g.node("ReduceSum", [mask_f, g.const("mask_axes", np.array([1], np.int64))], 1,
                         "mask_reduce_sum", keepdims=0)  # [B]
    (mask_sub,) = g.node("Sub", [mask_sum, g.const("one_f32", np.array(1.0, np.float32))], 1, "mask_sub_one")
    (seqlens_k,) = g.node("Cast", [mask_sub], 1, "seqlens_k", to=TensorProto.INT32)  # [B]
    (mask_shape,) = g.node("Shape", ["attention_mask"], 1, "mask_shape")
    (width,) = g.node("Gather", [mask_shape, g.const("one_idx", np.array(1, np.int64))], 1, "mask_width", axis=0)
    (total_len,) = g.node("Cast", [width], 1, "total_seq_len", to=TensorProto.INT32)  # scalar

    # Rotary caches [context_length, hd/2]: the global one, and the sliding-window layers' own when they differ.
    cos, sin = rope_cache(spec, weights.rope_freq_factors)
    rope_global = rope_local = (g.act("cos_cache", cos, kv_np_dtype), g.act("sin_cache", sin, kv_np_dtype))
    if any(spec.is_sliding(i) for i in range(spec.num_layers)) and (spec.rope_theta_local or spec.rope_scale != 1):
        cos, sin = rope_cache(spec, weights.rope_freq_factors, local=True)
        rope_local = (g.act("cos_cache_local", cos, kv_np_dtype), g.act("sin_cache_local", sin, kv_np_dtype))

    # 2. Embedding: [B, S] -> [B, S, H].
    x = _embedding(g, weights.embedding, tied=tied)
    if spec.embedding_multiplier is not None:
        (x,) = g.node("Mul", [x, g.act("embed.multiplier", np.array(spec.embedding_multiplier))], 1, "embed/scale")

    eps = float(spec.rms_norm_eps)
    residual, pending = x, None  # pending: the block output not yet added to the residual
    for i, lw in enumerate(weights.layers):
        p = f"layers.{i}"
        # 3. Pre-attention RMS norm (fused with the previous block's residual add).
        if pending is None:
            (h,) = g.node("SimplifiedLayerNormalization", [residual, g.act(f"{p}.attn_norm", lw.attn_norm)], 1,
                          f"{p}/attn_norm", axis=-1, epsilon=eps, stash_type=1)
        else:
            h, _, _, residual = g.node(
                "SkipSimplifiedLayerNormalization", [pending, residual, g.act(f"{p}.attn_norm", lw.attn_norm)],
                [f"{p}/attn_norm/out0", "", "", f"{p}/attn_norm/residual"], f"{p}/attn_norm", "com.microsoft",
                epsilon=eps)
        # 4. Fused QKV [B, S, (nh + 2*kvh)*hd] and attention with rotary inside, KV in the shared buffer.
        qkv = g.linears(h, [lw.q, lw.k, lw.v], f"{p}.qkv_proj", lw.qkv_bias)
        qkv_inputs = [qkv, "", ""]
        if spec.qk_norm:  # per-head RMS norm of q and k before GQA rotates them
            q, k, v = g.node("Split", [qkv, g.const(f"{p}/qkv_sizes", np.array([nh * hd, kvh * hd, kvh * hd]))],
                             3, f"{p}/qkv_split", axis=-1)
            qkv_inputs = [_head_norm(g, q, lw.q_norm, nh, hd, eps, f"{p}/q_norm"),
                          _head_norm(g, k, lw.k_norm, kvh, hd, eps, f"{p}/k_norm"), v]
        if kv_onnx_dtype != onnx_dtype:  # attention in the KV dtype: [B, S, (nh + 2*kvh)*hd] cast in
            qkv_inputs = [x and g.node("Cast", [x], 1, f"{x}/to_kv", to=kv_onnx_dtype)[0] for x in qkv_inputs]
        sliding = spec.is_sliding(i)
        cos_name, sin_name = rope_local if sliding else rope_global
        # NOTE(builder): since ONNX Runtime 1.23 (PR 25927) GQA's window is local_window_size keys, the query's
        # own included: llama.cpp's n_swa (masked when p_query - p_key >= n_swa) and HF's sliding_window.
        # Positions come from the mask, so the window holds with chunked prefill and the shared KV buffer alike.
        attrs = dict(num_heads=nh, kv_num_heads=kvh, do_rotary=1, rotary_interleaved=int(spec.rope_interleaved),
                     local_window_size=int(spec.sliding_window) if sliding else -1)
        if spec.attention_scale is not None:
            attrs["scale"] = float(spec.attention_scale)
        if spec.attn_logit_softcap:
            attrs["softcap"] = float(spec.attn_logit_softcap)
        attn, _, _ = g.node(
            "GroupQueryAttention",
            [*qkv_inputs, f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k, total_len,
             cos_name, sin_name, "position_ids"],
            [f"{p}/attn/out0", f"present.{i}.key", f"present.{i}.value"], f"{p}/attn", "com.microsoft", **attrs)
        if kv_onnx_dtype != onnx_dtype:  # [B, S, nh*hd] back to the activation dtype
            (attn,) = g.node("Cast", [attn], 1, f"{p}/attn/to_act", to=onnx_dtype)
        if spec.post_norms:  # the post-norm adds o_proj's offset correction (if any) on its way in
            o, correction = g.linear_parts(attn, lw.o, f"{p}.o_proj")  # [B, S, H]
            o = g.rms_norm(o, lw.post_attn_norm, f"{p}/post_attn_norm", eps, skip=correction)
        else:
            o = g.linear(attn, lw.o, f"{p}.o_proj")
        # 5. Post-attention norm, fused gate/up, activation, down.
        h, _, _, residual = g.node(
            "SkipSimplifiedLayerNormalization", [o, residual, g.act(f"{p}.ffn_norm", lw.ffn_norm)],
            [f"{p}/ffn_norm/out0", "", "", f"{p}/ffn_norm/residual"], f"{p}/ffn_norm", "com.microsoft", epsilon=eps)
        gate_up = g.linears(h, [lw.gate, lw.up], f"{p}.gate_up_proj")  # [B, S, 2*F]
        gate, up = g.node("Split", [gate_up], 2, f"{p}/gate_up_split", axis=-1, num_outputs=2)
        if spec.activation == "silu":
            (sig,) = g.node("Sigmoid", [gate], 1, f"{p}/act_sigmoid")
            (act,) = g.node("Mul", [gate, sig], 1, f"{p}/act_silu")
        elif spec.activation == "gelu_tanh":
            (act,) = g.node("Gelu", [gate], 1, f"{p}/act_gelu", approximate="tanh")
        else:
            raise ValueError(f"activation must be silu or gelu_tanh, got {spec.activation!r}")
        (mlp,) = g.node("Mul", [act, up], 1, f"{p}/act_mul")  # [B, S, F]
        if spec.post_norms:
            pending, correction = g.linear_parts(mlp, lw.down, f"{p}.down_proj")
            pending = g.rms_norm(pending, lw.post_ffn_norm, f"{p}/post_ffn_norm", eps, skip=correction)
        else:
            pending = g.linear(mlp, lw.down, f"{p}.down_proj")
        if on_layer is not None:
            on_layer(i)

    # 6. Final norm and LM head; logits are float32 whatever the activation dtype.
    h, _, _, _ = g.node(
        "SkipSimplifiedLayerNormalization", [pending, residual, g.act("final_norm", weights.output_norm)],
        ["final_norm/out0", "", "", ""], "final_norm", "com.microsoft", epsilon=eps)
    h = _keep_last_positions(g, h)  # [B, S, H] -> [B, min(S, keep), H]
    logits = g.linear(h, weights.lm_head, "lm_head", share=TIED if tied else None)
    if onnx_dtype != TensorProto.FLOAT:
        (logits,) = g.node("Cast", [logits], 1, "logits/cast", to=TensorProto.FLOAT)
    if spec.final_logit_softcap:  # c * tanh(logits / c), in float32
        cap = g.const("final_softcap", np.array(spec.final_logit_softcap, np.float32))
        (scaled,) = g.node("Div", [logits, cap], 1, "softcap/div")
        (logits,) = g.node("Tanh", [scaled], 1, "softcap/tanh")
        (logits,) = g.node("Mul", [logits, cap], 1, "softcap/mul")
    producer = next(n for n in reversed(g.nodes) if logits in n.output)
    producer.output[list(producer.output).index(logits)] = "logits"
    if g.float32_linears:
        log.info("float16 build, exact scales: %d linear layers have scales float16 cannot hold exactly (K-quant "
                 "sub-block scales) and run in float32 between two Casts", len(g.float32_linears))
    if g.rounded_scales:
        log.info("float16 build: %d quantized weights have K-quant sub-block scales rounded to float16 (at most "
                 "2**-11 of each scale; --exact-scales keeps them in float32)", len(g.rounded_scales))

    # NOTE(builder): LOGITS_TO_KEEP is a graph input with a default (an overridable initializer): callers
    # that don't know it (onnxruntime-genai, plain session.run) get every position's logits as before.
    inputs.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    graph = helper.make_graph(g.nodes, "ortserve_decoder", inputs, outputs, g.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
        producer_name="ortserve.engine.builder",
    )
    model.ir_version = 10
    return model
