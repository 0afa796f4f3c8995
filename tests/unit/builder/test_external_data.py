"""engine.builder.external: initializers written to the data file as they are made, read back by onnx exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine.builder import external
from engine.builder.external import ExternalData


def test_each_tensor_is_written_at_once_and_read_back_exactly(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(external, "CHUNK_BYTES", 1000)  # several writes for one tensor
    rng = np.random.default_rng(0)
    arrays = {"small": np.arange(4, dtype=np.int64), "codes": rng.integers(0, 256, (300, 7, 16), dtype=np.uint8),
              "scales": rng.normal(size=(300, 7)).astype(np.float32).T,  # not C-contiguous
              "half": rng.normal(size=(64, 33)).astype(np.float16)}
    with ExternalData(tmp_path / "model.onnx.data") as data:
        protos = [data.tensor(name, a) for name, a in arrays.items()]
        assert data.num_tensors == 3  # the small one stays inline
    assert (tmp_path / "model.onnx.data").stat().st_size == data.bytes_written
    small, *big = protos
    assert small.data_location == TensorProto.DEFAULT and numpy_helper.to_array(small).tolist() == [0, 1, 2, 3]
    for p in big:
        assert p.data_location == TensorProto.EXTERNAL and not p.raw_data
    # a graph of those initializers, saved and loaded back with its external data by onnx itself
    graph = helper.make_graph([], "g", [], [], protos)
    onnx.save_model(helper.make_model(graph), tmp_path / "model.onnx")
    loaded = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "model.onnx")).graph.initializer}
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype and np.array_equal(loaded[name], a), name


def test_large_tensors_start_on_the_alignment(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(external, "ALIGN_FROM_BYTES", 4096)
    with ExternalData(tmp_path / "d.bin") as data:
        data.tensor("odd", np.ones(2001, np.uint8))
        big = data.tensor("big", np.ones(5000, np.uint8))
    offset = int({e.key: e.value for e in big.external_data}["offset"])
    assert offset == external.ALIGN_BYTES  # padded past the first tensor's 2001 bytes
