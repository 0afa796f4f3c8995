"""Errors raised by the offline model builder (GGUF reading, conversion, pulling).

Callers (the CLI) map them by class; no onnxruntime import here.
"""

from __future__ import annotations


class BuildError(Exception):
    """Base of everything engine.builder raises on purpose; the message is user-facing."""


class GGUFFormatError(BuildError):
    """The file is not a readable GGUF (wrong magic, truncated, inconsistent header)."""


class UnsupportedArchitectureError(BuildError):
    """general.architecture has no entry in the architecture table."""


class UnsupportedTensorTypeError(BuildError):
    """A tensor is stored in a ggml type the converter cannot map exactly (e.g. Q4_K, Q6_K)."""

    def __init__(self, tensor_name: str, type_name: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"tensor {tensor_name!r} has ggml type {type_name}, which this converter does not support "
            f"(supported: {', '.join(supported)})"
        )
        self.tensor_name = tensor_name
        self.type_name = type_name


class UnsupportedTokenizerError(BuildError):
    """The GGUF tokenizer model or pre-tokenizer cannot be rebuilt as a tokenizers tokenizer.json."""


class OutputExistsError(BuildError):
    """The output folder exists and overwrite was not asked for."""


class ChecksumError(BuildError):
    """A downloaded file does not have the expected size or sha256."""


class DownloadError(BuildError):
    """Fetching a model package failed."""


class UnknownModelError(BuildError):
    """A model name is neither a known name, a folder nor a .gguf file."""


class DtypeMismatchError(BuildError):
    """A model folder's dtype is not the one asked for, and the folder names no source to convert again."""
