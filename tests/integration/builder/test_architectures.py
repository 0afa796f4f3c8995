"""Every architecture and ggml type the converter takes, on small GGUFs written with gguf-py: the converted
graph against the independent float64 reference (engine.builder.reference) on gguf-py's own dequantized
weights, and the sliding window beyond its width through chunked prefill, ragged batches and the engine."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import pytest
from gguf import GGMLQuantizationType as Q

from engine.async_engine import AsyncEngine
from engine.builder import convert_gguf
from engine.builder.ggml_quants import CONVERTERS
from engine.builder.gguf_reader import open_gguf
from engine.builder.reference import ReferenceModel
from engine.config import EngineConfig
from engine.types import SamplingParams
from tests.greedy_close import TOP_K, GreedyRun, assert_greedy_close
from tests.integration.builder.conftest import assert_greedy_like_reference
from tiny_gguf import TinyArch, gguf_dequantized_weights, write_tiny_gguf

MAX_LEN = 64
PROMPT = [1, 50, 60, 70, 80]
WINDOW = 6

# A Gemma 3 in miniature: the real 270M file's type mix (Q5_0 q/k/gate/up, Q8_0 v and embedding, Q4_K
# attention output, Q6_K down), a head size unlike hidden/heads, global rope 1e6 beside the local 1e4, and a
# 6-token window on layer 0 (pattern 2: layer 1 is global).
GEMMA3 = TinyArch(arch="gemma3", hidden=256, ffn=512, head_size=128, qk_norm=True, post_norms=True,
                  sliding_window=WINDOW, rope_theta=1e6, qtype=Q.Q5_0, embd_type=Q.Q8_0,
                  qtypes={"attn_v": Q.Q8_0, "attn_output": Q.Q4_K, "ffn_down": Q.Q6_K},
                  extra={"gemma3.attention.sliding_window_pattern": 2}, tokenizer="llama", add_space_prefix=False,
                  embd_std=0.1 / 16)


def build(tmp_path, cfg: TinyArch, *, accuracy_level: int = 0, dtype: str = "float32", name: str = "out", **kw):
    src = write_tiny_gguf(tmp_path / f"{name}.gguf", cfg)
    folder = convert_gguf(src, tmp_path / name, accuracy_level=accuracy_level, dtype=dtype, progress=False,
                          max_length=MAX_LEN, **kw)
    ref = ReferenceModel(open_gguf(src).spec, gguf_dequantized_weights(src, cfg))
    return src, folder, ref


def assert_greedy_matches(folder, ref, make_runner, ref_greedy, prompt=PROMPT, steps=24, tol=1e-3):
    tokens, logits = make_runner(folder).greedy(prompt, steps, MAX_LEN)
    _, ref_logits = ref_greedy(ref, prompt, steps)
    assert_greedy_like_reference(logits, ref_logits, tol)
    return tokens


@pytest.mark.parametrize("qtype", list(CONVERTERS), ids=lambda q: q.name)
def test_every_ggml_type_in_a_model(tmp_path, make_runner, ref_greedy, qtype):
    """All linears, the embedding (GatherBlockQuantized, offsets gathered beside it) and the tied LM head."""
    cfg = TinyArch(hidden=256, ffn=512, qtype=qtype, embd_type=qtype)
    _, folder, ref = build(tmp_path, cfg)
    assert_greedy_matches(folder, ref, make_runner, ref_greedy, steps=8)


@pytest.mark.parametrize("cfg", [
    pytest.param(TinyArch(arch="qwen3", qk_norm=True, head_size=32, qtype=Q.Q8_0), id="qwen3"),
    pytest.param(TinyArch(arch="gemma", qtype=Q.Q4_0), id="gemma"),
    pytest.param(TinyArch(arch="gemma2", post_norms=True, sliding_window=WINDOW, qtype=Q.Q8_0,
                          extra={"gemma2.attn_logit_softcapping": 8.0, "gemma2.final_logit_softcapping": 10.0}),
                 id="gemma2"),
    pytest.param(GEMMA3, id="gemma3"),
    pytest.param(TinyArch(arch="phi3", fused=True, qtype=Q.Q4_1), id="phi3"),
    pytest.param(TinyArch(rope_freqs=True, output_type=Q.Q6_K, hidden=256, ffn=512, qtype=Q.Q4_K,
                          extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}),
                 id="llama-rope_freqs-linear-scaling"),
    pytest.param(TinyArch(tokenizer="llama", qtype=Q.Q5_1), id="llama-sentencepiece"),
])
def test_architecture_matches_float64_reference(tmp_path, make_runner, ref_greedy, cfg):
    """24 greedy steps after a 5-token prompt: past the 6-token window where there is one."""
    _, folder, ref = build(tmp_path, cfg)
    tokens = assert_greedy_matches(folder, ref, make_runner, ref_greedy)
    assert len(set(tokens)) > 1, "the random model should not just repeat a token"


def test_hyperparameters_from_metadata(tmp_path):
    spec = open_gguf(write_tiny_gguf(tmp_path / "g3.gguf", GEMMA3)).spec
    assert spec.sliding_window == WINDOW and spec.sliding_layers == (True, False)
    assert (spec.rope_theta, spec.rope_theta_local) == (1e6, 1e4)
    assert spec.qk_norm and spec.post_norms and spec.head_size == 128 and spec.model_type == "gemma3_text"
    assert spec.embedding_multiplier == pytest.approx(16.0)
    default = TinyArch(arch="gemma3", qk_norm=True, post_norms=True, sliding_window=WINDOW)
    assert open_gguf(write_tiny_gguf(tmp_path / "d.gguf", default)).spec.sliding_layers == (True, True)  # period 6
    scaled = TinyArch(extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 8.0})
    assert open_gguf(write_tiny_gguf(tmp_path / "s.gguf", scaled)).spec.rope_scale == 8.0
    g2 = open_gguf(write_tiny_gguf(tmp_path / "g2.gguf", TinyArch(arch="gemma2", post_norms=True,
                                                                  sliding_window=WINDOW))).spec
    assert g2.sliding_layers == (True, False) and g2.rope_theta_local is None


def test_unsupported_rope_scaling_is_refused(tmp_path):
    from engine.builder import UnsupportedArchitectureError

    cfg = TinyArch(extra={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        open_gguf(write_tiny_gguf(tmp_path / "y.gguf", cfg))


@pytest.fixture(scope="module")
def gemma3_tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gemma3")
    _, folder, ref = build(tmp, GEMMA3)
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    windows = [a.i for n in graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
               if a.name == "local_window_size"]
    assert windows == [WINDOW, -1]  # GQA attends to local_window_size keys, the query's own included
    return folder, ref


def test_k_quant_offsets_run_before_their_matmul_and_fold_into_the_post_norm(gemma3_tiny):
    """The Q4_K attention output's offset term (blocksum(x) @ offsets.T) is computed ahead of its MatMulNBits
    (nodes run in graph order: the small ops read x while it is in cache) and enters the post-attention norm
    as its skip input, with no Add of its own; the float64 tests above check the sum stays exact."""
    folder, _ = gemma3_tiny
    nodes = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node
    order = {n.name: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    assert not [n.name for n in nodes if n.name.endswith("/offset_add")]
    for layer in range(2):
        offset, matmul = by_name[f"layers.{layer}.o_proj/offset_matmul"], by_name[f"layers.{layer}.o_proj"]
        blocksum = next(n for n in nodes if n.output[0] == offset.input[0])
        assert order[blocksum.name] < order[offset.name] < order[matmul.name]
        norm = by_name[f"layers.{layer}/post_attn_norm"]
        assert norm.op_type == "SkipSimplifiedLayerNormalization"
        assert list(norm.input[:2]) == [matmul.output[0], offset.output[0]]


def test_sliding_window_chunked_prefill_beyond_the_window(gemma3_tiny, make_runner):
    """A 30-token prompt fed in chunks that straddle the window gives the reference's logits everywhere."""
    folder, ref = gemma3_tiny
    r = make_runner(folder)
    prompt = np.random.default_rng(0).integers(4, 300, 30).tolist()
    ref.reset()
    expected = ref.forward(prompt)  # [30, V]
    kv = r.zeros(1, MAX_LEN)
    parts = []
    for start, end in [(0, 4), (4, 11), (11, 12), (12, 30)]:
        logits, kv = r.step(kv, [prompt[start:end]], [start])
        parts.append(logits[0])
    np.testing.assert_allclose(np.concatenate(parts), expected, atol=1e-3)


def test_sliding_window_ragged_batched_decode(gemma3_tiny, make_runner):
    """Rows with different past lengths (shorter and longer than the window) decode as they would alone."""
    folder, ref = gemma3_tiny
    r = make_runner(folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 300, n).tolist() for n in (3, 9, 25)]
    kvs = [r.step(r.zeros(1, MAX_LEN), [p], [0])[1] for p in prompts]
    batch_kv = {n: np.concatenate([kv[n] for kv in kvs]) for n in kvs[0]}
    batched, _ = r.step(batch_kv, [[50], [51], [52]], [len(p) for p in prompts])
    for b, p in enumerate(prompts):
        ref.reset()
        expected = ref.forward(p + [50 + b])[-1]
        np.testing.assert_allclose(batched[b, -1], expected, atol=1e-3)


def test_engine_serves_a_sliding_window_model(gemma3_tiny, ref_greedy):
    """The engine's shared KV buffer, narrow decode masks, chunked prefill and batching keep the window exact:
    three concurrent requests generate the float64 reference's greedy tokens far past the window."""
    folder, ref = gemma3_tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 300, n).tolist() for n in (5, 13, 21)]
    expected = [GreedyRun.from_logits(ref_greedy(ref, p, 30)[1]) for p in prompts]
    engine = AsyncEngine.from_model_dir(folder, EngineConfig(max_batch=3, prefill_chunk=8, seed=0))

    async def one(i):
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
        return GreedyRun.from_engine([out async for out in engine.generate(prompts[i], params, f"r{i}")])

    async def all_three():
        return await asyncio.gather(*(one(i) for i in range(3)))

    try:
        got = asyncio.run(all_three())
    finally:
        engine.shutdown()
    # NOTE(tests): float32 against float64, batched: equal up to a choice closer than 2e-3 (twice the logit error
    # allowed above), where the two may round apart (tests/integration/builder/conftest.py)
    for i, (ref_run, run) in enumerate(zip(expected, got)):
        assert len(run.tokens) == 30
        assert_greedy_close(ref_run, run, 2e-3, f"request {i} against the float64 reference")


@pytest.mark.parametrize("exact_scales", [False, True], ids=["rounded", "exact"])
def test_float16_build_k_quant_scales(tmp_path, make_runner, exact_scales):
    """K-quant scales do not fit float16: rounded to float16 (the default, one float16 MatMulNBits), or with
    ``exact_scales`` those linears run in float32 between Casts; both stay accurate."""
    _, folder, ref = build(tmp_path, GEMMA3, dtype="float16", accuracy_level=4, exact_scales=exact_scales)
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    k_quant = onnx.TensorProto.FLOAT if exact_scales else onnx.TensorProto.FLOAT16
    assert inits["layers.0.o_proj.scales"].data_type == k_quant  # Q4_K
    assert inits["layers.0.down_proj.scales"].data_type == k_quant  # Q6_K
    assert inits["layers.0.qkv_proj.scales"].data_type == onnx.TensorProto.FLOAT16  # Q5_0/Q8_0: f16 scales
    casts_back = [n.name for n in graph.node if n.name.endswith("/cast_back")]
    assert bool(casts_back) == exact_scales, casts_back
    runner = make_runner(folder)
    logits, _ = runner.step(runner.zeros(1, MAX_LEN), [PROMPT], [0])
    ref.reset()
    expected = ref.forward(PROMPT)
    rel = np.abs(logits[0] - expected).max() / np.abs(expected).max()
    assert rel < 0.05, f"float16 relative logit error {rel}"
