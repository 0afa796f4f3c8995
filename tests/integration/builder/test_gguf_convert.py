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
from engine.builder.reference import ReferenceModel
from tests.integration.builder.conftest import assert_greedy_like_reference
from tiny_gguf import TinyArch, gguf_dequantized_weights, write_tiny_gguf


def convert_and_compare(tmp_path, make_runner, ref_greedy, cfg: TinyArch, *, steps: int = 24,
                        prompt: list[int] | None = None, max_len: int = 64, tol: float = 1e-3):
    """Converts ``cfg``'s GGUF at accuracy level 0 and checks greedy logits against the float64 reference."""
    src = write_tiny_gguf(tmp_path / "tiny.gguf", cfg)
    folder = convert_gguf(src, tmp_path / "out", accuracy_level=0, progress=False, max_length=max_len)
    model = open_gguf(src)
    ref = ReferenceModel(model.spec, gguf_dequantized_weights(src, cfg))
    prompt = prompt or [1, 50, 60, 70, 80]
    _, logits = make_runner(folder).greedy(prompt, steps, max_len)
    _, ref_logits = ref_greedy(ref, prompt, steps)
    assert_greedy_like_reference(logits, ref_logits, tol)
    return model, folder


@pytest.mark.parametrize("arch,qtype,embd_type", [
    ("llama", Q.Q4_0, Q.Q8_0),
    ("llama", Q.Q4_1, Q.Q4_1),
    ("llama", Q.Q8_0, Q.Q4_0),
    ("llama", Q.F16, Q.F32),
    ("qwen2", Q.Q4_1, Q.Q8_0),
])
def test_tiny_gguf_matches_gguf_dequantized_reference(tmp_path, make_runner, ref_greedy, arch, qtype, embd_type):
    cfg = TinyArch(arch=arch, qtype=qtype, embd_type=embd_type, qkv_bias=arch == "qwen2")
    model, _ = convert_and_compare(tmp_path, make_runner, ref_greedy, cfg)
    assert model.spec.rope_interleaved == (arch == "llama")


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
    src = write_tiny_gguf(tmp_path / "m.gguf", TinyArch(arch="mamba"))
    with pytest.raises(UnsupportedArchitectureError, match="mamba"):
        convert_gguf(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path, {"m.gguf"})


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    src = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 66), np.uint8), raw_dtype=Q.IQ2_XXS)  # [4, 256] IQ2_XXS
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedTensorTypeError, match=r"blk\.0\.ffn_down\.weight.*IQ2_XXS.*Q4_K") as info:
        convert_gguf(src, tmp_path / "out", progress=False)
    assert (info.value.tensor_name, info.value.type_name) == ("blk.0.ffn_down.weight", "IQ2_XXS")
    _assert_nothing_written(tmp_path, {"k.gguf"})


def test_unsupported_tokenizer_model(tmp_path):
    src = write_tiny_gguf(tmp_path / "t5.gguf", TinyArch())
    data = src.read_bytes().replace(b"gpt2", b"t5xx", 1)  # tokenizer.ggml.model, same length
    src.write_bytes(data)
    with pytest.raises(UnsupportedTokenizerError, match="t5xx"):
        convert_gguf(src, tmp_path / "out", progress=False)
    _assert_nothing_written(tmp_path, {"t5.gguf"})


def test_existing_output_dir_needs_overwrite(tmp_path):
    src = write_tiny_gguf(tmp_path / "t.gguf", TinyArch())
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
    src = write_tiny_gguf(tmp_path / "t.gguf", TinyArch())
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
