"""ONNX external data written as the graph is built: each initializer's bytes go to one data file at once, in
chunks, and the graph keeps only a small TensorProto that points into the file (location, offset, length).

So no ModelProto ever holds the weights, and a model of any size is built with one tensor in memory at a time.
No onnxruntime import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

INLINE_BYTES = 1024  # smaller tensors stay inside model.onnx (onnx.save_model's default size_threshold)
CHUNK_BYTES = 64 << 20  # one write() at most: a large tensor is written as slices of its own buffer, no copy
# NOTE(builder): large tensors start at a multiple of 64 KiB (onnx's allocation granularity), so ONNX Runtime can
# memory-map each one straight from the file on any OS instead of reading it into a buffer of its own.
ALIGN_BYTES = 64 << 10
ALIGN_FROM_BYTES = 1 << 20


class ExternalData:
    """Appends initializers to one external data file; a context manager that closes (and fsyncs) it.

    Usage:
        >>> with ExternalData(folder / "model.onnx.data") as data:  # doctest: +SKIP
        ...     proto = data.tensor("w", np.ones((4096, 4096), np.float32))  # 64 MiB written now
        >>> proto.data_location == TensorProto.EXTERNAL  # doctest: +SKIP

    Args:
        path: the data file to create; the TensorProtos name it by its file name (the model sits beside it).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: BinaryIO | None = open(self.path, "wb")
        self.bytes_written = 0  # the file's length so far (tensor bytes and alignment padding)
        self.num_tensors = 0

    def __enter__(self) -> ExternalData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        """Writes ``array`` (any numeric dtype, C order or not) and returns the initializer that points at it.

        Tensors under INLINE_BYTES are returned whole instead (scalars, shapes, axes: the graph reads them).
        """
        array = np.ascontiguousarray(array)
        if array.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        if self._file is None:
            raise ValueError(f"{self.path} is closed")
        if array.nbytes >= ALIGN_FROM_BYTES and self.bytes_written % ALIGN_BYTES:
            pad = ALIGN_BYTES - self.bytes_written % ALIGN_BYTES
            self._file.write(bytes(pad))
            self.bytes_written += pad
        offset = self.bytes_written
        flat = memoryview(array.reshape(-1).view(np.uint8))  # [nbytes] over the array's own buffer
        for start in range(0, len(flat), CHUNK_BYTES):
            self._file.write(flat[start : start + CHUNK_BYTES])
        self.bytes_written += array.nbytes
        self.num_tensors += 1
        proto = TensorProto()
        proto.name = name
        proto.data_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
        proto.dims.extend(array.shape)
        for key, value in (("location", self.path.name), ("offset", offset), ("length", array.nbytes)):
            entry = proto.external_data.add()
            entry.key, entry.value = key, str(value)
        proto.data_location = TensorProto.EXTERNAL
        return proto
