"""convert_gguf on small GGUF files written here with the gguf package: every supported tensor type and
architecture against a reference built from gguf's own dequantization, and every bad-input error."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.builder import (
    GGUFFormatError,
    OutputExistsError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    UnsupportedTokenizerError,
    convert_gguf,
)
from engine.builder.gguf_reader import open_gguf
from engine.builder.graph import LayerWeights, ModelWeights
from engine.builder.reference import ReferenceModel
from engine.builder.tokenizer import CHATML_TEMPLATE, synthetic_vocab

H, F, NH, KVH, LAYERS, VOCAB = 64, 128, 4, 2, 2, 320


def write_tiny_gguf(path: Path, *, arch: str = "llama", qtype: Q = Q.Q4_0, embd_type: Q = Q.Q8_0,
                    tokenizer_model: str = "gpt2", qkv_bias: bool = False, seed: int = 0) -> Path:
    """A complete small GGUF (random weights quantized by gguf.quants, a byte-level BPE vocabulary)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(KVH)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens, merges, types = synthetic_vocab(VOCAB)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML_TEMPLATE)

    def tensor(name: str, n: int, k: int, t: Q, std: float) -> None:
        x = rng.normal(0, std, size=(n, k)).astype(np.float32)
        if t == Q.F32:
            w.add_tensor(name, x)
        elif t == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, t), raw_dtype=t)

    hd = H // NH
    tensor("token_embd.weight", VOCAB, H, embd_type, 0.1)
    w.add_tensor("output_norm.weight", rng.uniform(0.8, 1.2, H).astype(np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", rng.uniform(0.8, 1.2, H).astype(np.float32))
        w.add_tensor(f"{p}.ffn_norm.weight", rng.uniform(0.8, 1.2, H).astype(np.float32))
        for name, n, k in [("attn_q", NH * hd, H), ("attn_k", KVH * hd, H), ("attn_v", KVH * hd, H),
                           ("attn_output", H, H), ("ffn_gate", F, H), ("ffn_up", F, H), ("ffn_down", H, F)]:
            tensor(f"{p}.{name}.weight", n, k, qtype, 3 * k ** -0.5)
            if qkv_bias and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"{p}.{name}.bias", rng.normal(0, 0.1, n).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_dequantized_weights(path: Path) -> ModelWeights:
    """ModelWeights from gguf's own reader and dequantizer (independent of engine.builder.quant)."""
    reader = gguf.GGUFReader(str(path))
    t = {x.name: gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float64) for x in reader.tensors}
    layers = []
    for i in range(LAYERS):
        p = f"blk.{i}"
        bias = None
        if f"{p}.attn_q.bias" in t:
            bias = np.concatenate([t[f"{p}.attn_q.bias"], t[f"{p}.attn_k.bias"], t[f"{p}.attn_v.bias"]])
        layers.append(LayerWeights(
            attn_norm=t[f"{p}.attn_norm.weight"], q=t[f"{p}.attn_q.weight"], k=t[f"{p}.attn_k.weight"],
            v=t[f"{p}.attn_v.weight"], o=t[f"{p}.attn_output.weight"], ffn_norm=t[f"{p}.ffn_norm.weight"],
            gate=t[f"{p}.ffn_gate.weight"], up=t[f"{p}.ffn_up.weight"], down=t[f"{p}.ffn_down.weight"],
            qkv_bias=bias))
    emb = t["token_embd.weight"]
    return ModelWeights(embedding=emb, layers=layers, output_norm=t["output_norm.weight"], lm_head=emb)


@pytest.mark.parametrize("arch,qtype,embd_type", [
    ("llama", Q.Q4_0, Q.Q8_0),
    ("llama", Q.Q4_1, Q.Q4_1),
    ("llama", Q.Q8_0, Q.Q4_0),
    ("llama", Q.F16, Q.F32),
    ("qwen2", Q.Q4_1, Q.Q8_0),
])
def test_tiny_gguf_matches_gguf_dequantized_reference(tmp_path, make_runner, ref_greedy, arch, qtype, embd_type):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch, qtype=qtype, embd_type=embd_type,
                          qkv_bias=arch == "qwen2")
    folder = convert_gguf(src, tmp_path / "out", accuracy_level=0, progress=False, max_length=64)
    model = open_gguf(src)
    assert model.spec.rope_interleaved == (arch == "llama")
    ref = ReferenceModel(model.spec, gguf_dequantized_weights(src))
    prompt = [1, 50, 60, 70, 80]
    tokens, logits = make_runner(folder).greedy(prompt, 24, 64)
    ref_tokens, ref_logits = ref_greedy(ref, prompt, 24)
    err = max(np.abs(a - b).max() for a, b in zip(logits, ref_logits))
    assert err < 1e-3, f"max logit error {err}"
    assert tokens == ref_tokens


# --- bad input: a clear BuildError, and nothing (not even a temp folder) left in the output's parent ----


def _assert_nothing_written(parent: Path, keep: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == keep


def test_wrong_magic(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    out = tmp_path / "out"
    with pytest.raises(GGUFFormatError, match="magic"):
        convert_gguf(bad, out, progress=False)
    _assert_nothing_written(tmp_path, {"bad.gguf"})


@pytest.mark.parametrize("num_bytes", [20, 3000, 60_000_000])
def test_truncated_gguf(tmp_path, smollm2_gguf, num_bytes):
    bad = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(num_bytes))
    with pytest.raises(GGUFFormatError, match="truncated"):
        convert_gguf(bad, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path, {"cut.gguf"})


def test_unsupported_architecture(tmp_path):
    src = write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(UnsupportedArchitectureError, match="mamba"):
        convert_gguf(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path, {"m.gguf"})


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    src = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 144), np.uint8), raw_dtype=Q.Q4_K)  # [4, 256] Q4_K
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedTensorTypeError, match=r"blk\.0\.ffn_down\.weight.*Q4_K") as info:
        convert_gguf(src, tmp_path / "out", progress=False)
    assert (info.value.tensor_name, info.value.type_name) == ("blk.0.ffn_down.weight", "Q4_K")
    _assert_nothing_written(tmp_path, {"k.gguf"})


def test_unsupported_tokenizer_model(tmp_path):
    src = write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(UnsupportedTokenizerError, match="llama"):
        convert_gguf(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path, {"spm.gguf"})


def test_existing_output_dir_needs_overwrite(tmp_path):
    src = write_tiny_gguf(tmp_path / "t.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="overwrite"):
        convert_gguf(src, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    _assert_nothing_written(tmp_path, {"t.gguf", "out"})
    convert_gguf(src, out, progress=False, overwrite=True)
    assert (out / "model.onnx").is_file() and not (out / "keep.txt").exists()
    _assert_nothing_written(tmp_path, {"t.gguf", "out"})


def test_failure_while_writing_leaves_old_folder(tmp_path, monkeypatch):
    """An error after conversion started (here: saving the ONNX file) leaves the previous folder intact."""
    src = write_tiny_gguf(tmp_path / "t.gguf")
    out = convert_gguf(src, tmp_path / "out", progress=False)
    before = sorted(p.name for p in out.iterdir())

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("engine.builder.folder.onnx.save_model", boom)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(src, out, progress=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    _assert_nothing_written(tmp_path, {"t.gguf", "out"})
    shutil.rmtree(out)
