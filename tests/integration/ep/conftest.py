"""Fixtures for the device-layer integration tests: tiny real ONNX models built with onnx.helper."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def build_add_model(path: Path, elem_type: int = TensorProto.INT64, shape: list | None = None) -> Path:
    """y = x + 1 with x, y of `shape` (default dynamic [batch, seq]); opset 17, IR 8."""
    shape = shape or ["batch", "seq"]
    np_type = helper.tensor_dtype_to_np_dtype(elem_type)
    one = numpy_helper.from_array(np.array(1, dtype=np_type), name="one")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "add_one",
        [helper.make_tensor_value_info("x", elem_type, shape)],
        [helper.make_tensor_value_info("y", elem_type, shape)], initializer=[one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="session")
def make_add_model():
    """The model builder, for tests that need another dtype or a fixed shape."""
    return build_add_model


@pytest.fixture(scope="session")
def add_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """int64 y = x + 1, dynamic [batch, seq]: the shape and dtype of a decode input."""
    return build_add_model(tmp_path_factory.mktemp("ep_models") / "add_int64.onnx")
