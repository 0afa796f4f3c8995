"""One cached folder per (file, dtype) (issue 45): a GGUF resolved for float32 and for float16 gets two folders, each
marked with its dtype and found again without converting; a folder of the other dtype is converted again from the
source its marker names, or refused with a message that says what to do; never served in the wrong dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_gguf import TinyArch, write_tiny_gguf

from engine.builder import SyntheticSpec, build_synthetic, resolve_model
from engine.builder.errors import DtypeMismatchError
from engine.builder.folder import MARKER_FILE, folder_dtype


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf", TinyArch())


def test_each_dtype_of_a_gguf_has_its_own_folder(tmp_path: Path, tiny: Path):
    cache = tmp_path / "cache"
    f32 = resolve_model(tiny, cache, progress=False, dtype="float32")
    f16 = resolve_model(tiny, cache, progress=False, dtype="float16")
    assert f32 != f16 and f16.name == f32.name + "-float16"
    assert (folder_dtype(f32), folder_dtype(f16)) == ("float32", "float16")
    assert json.loads((f16 / MARKER_FILE).read_text())["dtype"] == "float16"
    mtimes = {f: (f / "model.onnx.data").stat().st_mtime_ns for f in (f32, f16)}
    assert resolve_model(tiny, cache, progress=False, dtype="float16") == f16  # found again, not converted
    assert resolve_model(tiny, cache, progress=False) == f32  # no dtype: float32, as before
    assert {f: (f / "model.onnx.data").stat().st_mtime_ns for f in (f32, f16)} == mtimes


def test_a_folder_of_the_other_dtype_is_converted_again_from_its_source(tmp_path: Path, tiny: Path):
    cache = tmp_path / "cache"
    f16 = resolve_model(tiny, cache, progress=False, dtype="float16")
    served = resolve_model(f16, cache, progress=False, dtype="float32")  # the CPU asked to serve a float16 folder
    assert served != f16 and folder_dtype(served) == "float32"
    assert resolve_model(f16, cache, progress=False, dtype="float16") == f16
    assert resolve_model(f16, cache, progress=False) == f16  # no dtype asked: the folder as it is


def test_a_folder_of_the_other_dtype_without_a_source_is_refused_clearly(tmp_path: Path):
    folder = build_synthetic(tmp_path / "half", SyntheticSpec(dtype="float16"))
    with pytest.raises(DtypeMismatchError) as info:
        resolve_model(folder, tmp_path / "cache", progress=False, dtype="float32")
    message = str(info.value)
    assert "holds a float16 model" in message and "serves float32" in message and "--dtype float16" in message


def test_float16_kv_beside_float32_activations_is_a_float32_folder(tmp_path: Path, tiny: Path):
    from engine.builder import convert_gguf

    folder = convert_gguf(tiny, tmp_path / "kv16", progress=False, kv_dtype="float16")
    assert folder_dtype(folder) == "float32"  # the activations decide; half the KV is not another model
    assert resolve_model(folder, tmp_path / "cache", progress=False, dtype="float32") == folder


def test_float16_kv_gives_the_float32_kv_logits(tmp_path: Path, tiny: Path, make_runner):
    """Keys and values rounded to float16 (llama.cpp's CPU default) move a tiny model's logits by well under 1%."""
    from engine.builder import convert_gguf

    runs = {}
    for kv in ("float32", "float16"):
        folder = convert_gguf(tiny, tmp_path / kv, progress=False, accuracy_level=0, kv_dtype=kv)
        runner = make_runner(folder)
        assert runner.kv_dtype.__name__ == kv
        runs[kv] = runner.greedy([1, 5, 9, 13, 200, 77, 41], 12, 64)
    (tokens32, logits32), (tokens16, logits16) = runs["float32"], runs["float16"]
    for a, b in zip(logits32, logits16):
        assert abs(a - b).max() <= 0.01 * abs(a).max()
    assert tokens32 == tokens16


def _matmul_bits(folder: Path) -> list[int]:
    import onnx

    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    return [next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"]


def test_a_draft_models_q4_0_copy_has_its_own_folder_of_4_bit_linears(tmp_path: Path):
    """--draft-quant q4_0 (the default for a draft model): the GGUF's 5- and 8-bit linears (8-bit MatMulNBits when
    converted exactly) requantized to 4 bits, in a folder of its own, marked, found again without converting, and
    loadable by ONNX Runtime; the exact conversion beside it keeps its 8-bit linears."""
    import onnxruntime as ort

    from gguf import GGMLQuantizationType as Q

    gguf_file = write_tiny_gguf(tmp_path / "draft.gguf", TinyArch(qtype=Q.Q5_0, output_type=Q.Q8_0))
    cache = tmp_path / "cache"
    exact = resolve_model(gguf_file, cache, progress=False)
    q4 = resolve_model(gguf_file, cache, progress=False, requant="q4_0")
    assert q4 != exact and q4.name == exact.name + "-q4_0"
    assert json.loads((q4 / MARKER_FILE).read_text())["requant"] == "q4_0"
    assert "requant" not in json.loads((exact / MARKER_FILE).read_text())
    assert set(_matmul_bits(exact)) == {8} and set(_matmul_bits(q4)) == {4}
    assert (q4 / "model.onnx.data").stat().st_size < 0.7 * (exact / "model.onnx.data").stat().st_size
    mtime = (q4 / "model.onnx.data").stat().st_mtime_ns
    assert resolve_model(gguf_file, cache, progress=False, requant="q4_0") == q4
    assert (q4 / "model.onnx.data").stat().st_mtime_ns == mtime  # found again, not converted
    assert resolve_model(q4, cache, progress=False, requant="q4_0") == q4  # a folder: used as it is
    q4_f16 = resolve_model(q4, cache, progress=False, dtype="float16")  # a GPU: converted again, still 4-bit
    assert q4_f16.name == exact.name + "-float16-q4_0" and set(_matmul_bits(q4_f16)) == {4}
    ort.InferenceSession(str(q4 / "model.onnx"), providers=["CPUExecutionProvider"])
