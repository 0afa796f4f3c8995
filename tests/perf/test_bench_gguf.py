"""perf/gpu/bench_gguf.py: random Q4_0 blocks at the asked scale, and a bench GGUF that carries the vocabulary file's
tokenizer and a Llama shape's tensors (a tiny shape and vocabulary here; the GPU machine writes the 1B one)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from perf.gpu.bench_gguf import q4_0_blocks, write_bench_gguf
from perf.gpu.plot_issue38 import figure
from tests.perf.qwen2_files import folder_logits, write_qwen2_vocab


def test_q4_0_blocks_dequantize_to_weights_of_the_asked_scale():
    blocks = q4_0_blocks(np.random.default_rng(0), 64, 256, std=0.02)
    assert blocks.shape == (64, 256 // 32 * 18) and blocks.dtype == np.uint8
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    assert w.shape == (64, 256) and np.isfinite(w).all()
    assert w.std() == pytest.approx(0.02, rel=0.05)
    with pytest.raises(ValueError, match="multiples of 32"):
        q4_0_blocks(np.random.default_rng(0), 2, 40, std=0.02)


def _vocab(path: Path, n: int) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list([f"t{i}" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_bench_gguf_has_the_vocabulary_and_every_llama_tensor(tmp_path: Path):
    shape = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=96)
    out = write_bench_gguf(_vocab(tmp_path / "vocab.gguf", 96), tmp_path / "bench.gguf", shape)
    r = gguf.GGUFReader(str(out))
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data[:3]] == ["t0", "t1", "t2"]
    assert bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode() == "llama-bpe"
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 + 9 * 2 and "output.weight" not in tensors  # tied LM head
    up = tensors["blk.1.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.Q4_0 and list(up.shape) == [64, 128]
    assert tensors["output_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    untied = write_bench_gguf(tmp_path / "vocab.gguf", tmp_path / "untied.gguf", shape, untied=True)
    head = next(t for t in gguf.GGUFReader(str(untied)).tensors if t.name == "output.weight")
    assert head.tensor_type == gguf.GGMLQuantizationType.Q4_0 and list(head.shape) == [64, 96]
    with pytest.raises(ValueError, match="holds 96 tokens"):
        write_bench_gguf(tmp_path / "vocab.gguf", tmp_path / "bad.gguf", dict(shape, vocab_size=128))


def test_the_plot_reads_each_reports_first_run():
    report = {"ours-c1": {"runs": [{"summary": {"output_tokens_per_s": 700.0, "ttft": {"p50_ms": 9.0, "p99_ms": 12}}}]},
              "peer-c1": {"runs": []}}
    assert figure(report) == {"ours-c1": {"tok_s": 700.0, "ttft_p50_ms": 9.0, "ttft_p99_ms": 12}}
    grouped = {"peer_and_arrivals": {"ours-c1": {"tok_s": 700.0}}, "spec_centred_codes": {"spec-gguf-default-greedy": {}}}
    assert set(figure(grouped)) == {"ours-c1", "centred-spec-gguf-default-greedy"}


def test_offset_codes_have_the_mean_that_makes_a_random_model_repeat():
    rng = np.random.default_rng(1)
    centred = gguf.quants.dequantize(q4_0_blocks(rng, 64, 512, std=0.02), gguf.GGMLQuantizationType.Q4_0)
    offset = gguf.quants.dequantize(q4_0_blocks(rng, 64, 512, std=0.02, offset=True), gguf.GGMLQuantizationType.Q4_0)
    assert abs(centred.mean()) < 6e-4 and offset.mean() < -1.5e-3  # -d/2 with d = 0.02 / 4.61
    assert offset.std() == pytest.approx(0.02, rel=0.05)


def test_k_quant_blocks_dequantize_to_centred_weights_of_the_asked_scale():
    from perf.gpu.bench_gguf import q4_k_blocks, q6_k_blocks

    from engine.builder.ggml_quants import from_q4_k, from_q6_k

    rng = np.random.default_rng(2)
    for make, qtype, ours in ((q4_k_blocks, "Q4_K", from_q4_k), (q6_k_blocks, "Q6_K", from_q6_k)):
        blocks = make(rng, 64, 1024, std=0.02)
        w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
        assert w.shape == (64, 1024) and np.isfinite(w).all()
        assert w.std() == pytest.approx(0.02, rel=0.1) and abs(w.mean()) < 1e-3, qtype
        assert np.array_equal(ours(blocks, 64, 1024).dequantize(), w.astype(np.float64))  # the converter agrees


def test_the_q4_k_m_mix_puts_q6_k_where_llama_cpp_does():
    from perf.gpu.bench_gguf import tensor_type, use_more_bits

    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert tensor_type("output.weight", "Q4_K_M", 0, 32, tied=False) == "Q6_K"
    assert tensor_type("token_embd.weight", "Q4_K_M", 0, 32, tied=False) == "Q4_K"
    assert tensor_type("token_embd.weight", "Q4_K_M", 0, 32, tied=True) == "Q6_K"  # it is the LM head too
    assert tensor_type("blk.6.ffn_down.weight", "Q4_K_M", 6, 32, tied=False) == "Q6_K"
    assert tensor_type("blk.7.ffn_down.weight", "Q4_K_M", 7, 32, tied=False) == "Q4_K"
    assert tensor_type("blk.0.attn_v.weight", "Q4_K_M", 0, 32, tied=False) == "Q6_K"
    assert tensor_type("blk.0.attn_q.weight", "Q4_K_M", 0, 32, tied=False) == "Q4_K"
    assert tensor_type("output.weight", "Q4_0", 0, 32, tied=False) == "Q6_K"
    assert tensor_type("blk.0.ffn_down.weight", "Q4_0", 0, 32, tied=False) == "Q4_0"
    assert tensor_type("output.weight", "Q4_0-all", 0, 32, tied=False) == "Q4_0"


def test_a_qwen2_shape_pads_its_vocabulary_and_converts(tmp_path: Path):
    """A Qwen2-shaped Q4_K_M file (biases, a vocabulary padded with unused tokens) that ortserve converts and runs."""
    from engine.builder import convert_gguf

    write_qwen2_vocab(tmp_path / "vocab.gguf")
    shape = dict(hidden_size=256, num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=320,
                 arch="qwen2", rope_theta=1e6, context_length=4096, tied=False)
    out = write_bench_gguf(tmp_path / "vocab.gguf", tmp_path / "qwen.gguf", shape, mix="Q4_K_M")
    r = gguf.GGUFReader(str(out))
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 320 and bytes(tokens.parts[tokens.data[-1]]).decode() == "[PAD319]"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["output.weight"] == "Q6_K" and types["blk.0.ffn_down.weight"] == "Q6_K"
    assert types["blk.2.ffn_down.weight"] == "Q4_K" and types["blk.0.attn_q.bias"] == "F32"
    folder = convert_gguf(out, tmp_path / "qwen", progress=False)
    logits = folder_logits(folder, [1, 5, 9])
    assert logits.shape == (1, 3, 320) and np.isfinite(logits).all() and 0.1 < logits.std() < 10
