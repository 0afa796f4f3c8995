"""engine.builder: GGUF -> ONNX Runtime GenAI model folders, synthetic models, and the model cache.

Offline tooling: the server never imports it at request time, and nothing here imports onnxruntime.
The CLI calls pull_model / convert_gguf / resolve_model and maps BuildError subclasses by class.
"""

from engine.builder.errors import (
    BuildError,
    ChecksumError,
    DownloadError,
    GGUFFormatError,
    OutputExistsError,
    UnknownModelError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    UnsupportedTokenizerError,
)
from engine.builder.convert import convert_gguf
from engine.builder.pull import (
    DEFAULT_MODEL, KNOWN_MODELS, fetch_gguf, local_model_folder, model_cache_dir, pull_model, resolve_model,
)
from engine.builder.synthetic import SyntheticSpec, build_synthetic

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "BuildError",
    "ChecksumError",
    "DownloadError",
    "GGUFFormatError",
    "OutputExistsError",
    "SyntheticSpec",
    "UnknownModelError",
    "UnsupportedArchitectureError",
    "UnsupportedTensorTypeError",
    "UnsupportedTokenizerError",
    "build_synthetic",
    "convert_gguf",
    "fetch_gguf",
    "local_model_folder",
    "model_cache_dir",
    "pull_model",
    "resolve_model",
]
