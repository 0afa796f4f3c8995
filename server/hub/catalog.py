"""The hub's catalog: every model a server may serve (from --model, --models, --models-dir and a --config file's list),
its names, its kind, its own settings, and the memory it needs (weights + KV, estimated from its folder).

Pure configuration: reads folders' JSON files and sizes, never loads a session (no onnxruntime import).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.settings import ModelSpec, Settings

# NOTE(hub): what a loaded model costs beyond its weights and KV, besides: the engine process's interpreter, the
# runtime's arenas and the tokenizer (measured ~150-250 MB RSS for the small CPU models); one figure for all.
PROCESS_OVERHEAD_BYTES = 200 * 1024**2
_DEFAULT_MAX_LENGTH = 2048  # engine.model_loader.DEFAULT_MAX_LENGTH (no engine import here)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'8G', '512M', '1.5GiB' or a plain byte count -> bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"memory_budget must be bytes or a size such as 8G or 512M, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** "_kmgt".index(unit)) if unit else int(number)


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_budget(device: Any = None, ram: int | None = None) -> tuple[int, str]:
    """What the loaded models may hold together when --memory-budget is not given: the device's own memory on a
    GPU, the machine's RAM on the CPU; less a margin (10%, at most 2 GiB) for the runtime and everything else.

    Args:
        device: the server's selected device (an ep.device.DeviceRecord; None: the CPU). A device that reports no
            memory of its own (the CUDA EP on Linux) falls back to RAM, said in the returned source.
        ram: the machine's RAM in bytes (default: this machine's).

    Returns:
        (budget bytes, where the total came from: for the log and /models).
    """
    total, source = None, "RAM"
    if device is not None and device.device_type != "CPU":
        total = device.memory_bytes()
        name = f"{device.ep_name} {device.device_type}"
        source = f"{name} memory" if total is not None else f"RAM ({name} reports no memory; set --memory-budget)"
    if total is None:
        total = ram if ram is not None else ram_bytes()
    return total - min(total // 10, 2 * 1024**3), source


def format_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 1024**2:.0f} MiB" if num_bytes < 1024**3 else f"{num_bytes / 1024**3:.2f} GiB"


@dataclass
class CatalogModel:
    """One servable model: its spec (per-model settings), served name, every name that routes to it."""

    spec: ModelSpec
    name: str
    names: list[str]
    kind: str | None  # "chat" | "embedding"; None until the folder is known (a known name not pulled yet)
    folder: Path | None = None
    pinned: bool = False
    # with --embeddings: the chat model's own pooled embeddings are served under its names too
    chat_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # before its first load: the folder it will load from, once found on disk (folder_on_disk)
    local_folder: Path | None = None

    def settings_for(self, settings: Settings) -> Settings:
        """The server's settings with this model's own (its folder as --model, its overrides)."""
        spec = self.spec
        update: dict[str, Any] = {"model": str(self.folder or spec.model), "served_model_name": self.name}
        for key in ("max_model_len", "max_batch", "provider", "chat_template"):
            if getattr(spec, key) is not None:
                update[key] = getattr(spec, key)
        return settings.model_copy(update=update)


def folder_on_disk(model: CatalogModel) -> Path | None:
    """The folder ``model`` loads from, when it is on disk: its resolved folder, else the one its first load will
    take without a download or conversion (engine.builder.local_model_folder: no hashing), remembered once found;
    None while it is not on disk (a known name not pulled, a GGUF not converted)."""
    if model.folder is not None:
        return model.folder
    if model.local_folder is None:
        from engine.builder import local_model_folder  # no onnxruntime behind this import

        model.local_folder = local_model_folder(model.spec.model)
    return model.local_folder


def kind_of_folder(folder: Path) -> str:
    """chat for a decoder folder (genai_config.json), embedding for an encoder (embedding_config.json only)."""
    return "chat" if (folder / "genai_config.json").is_file() else "embedding"


def _known_kind(name: str) -> str | None:
    from engine.builder.pull import KNOWN_MODELS, SENTENCE_TRANSFORMERS_ZIP  # no onnxruntime behind this import

    source = KNOWN_MODELS.get(name)
    if source is None:
        return None
    return "embedding" if source.kind == SENTENCE_TRANSFORMERS_ZIP else "chat"


def _looks_like_path(model: str) -> bool:
    return os.sep in model or model.endswith(".gguf") or Path(model).exists()


def _default_name(model: str) -> str:
    if not _looks_like_path(model):
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def _folder_models(models_dir: str) -> list[ModelSpec]:
    """Each .gguf file and model folder directly inside ``models_dir``, by name."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {models_dir} is not a folder")
    specs = []
    for path in sorted(root.iterdir()):
        if path.suffix == ".gguf" and path.is_file():
            specs.append(ModelSpec(model=str(path), name=path.stem))
        elif path.is_dir() and any((path / f).is_file() for f in ("genai_config.json", "embedding_config.json",
                                                                  "config.json")):
            specs.append(ModelSpec(model=str(path), name=path.name))
    return specs


def build_catalog(settings: Settings, one_model: bool) -> list[CatalogModel]:
    """The models of a server: --model first (the default chat model), then --embedding-model, then the hub's.

    Args:
        settings: the server's settings (``model`` already resolved to a folder by the CLI where it was a name).
        one_model: the server serves only --model (and --embedding-model): they are pinned, as a one-model
            server's model always was.

    Raises:
        ValueError: two models claim one name.
    """
    entries: list[CatalogModel] = []
    first_name = settings.served_model_name or _default_name(settings.model)
    first = CatalogModel(ModelSpec(model=settings.model, name=first_name), first_name,
                         [first_name, settings.model], None, pinned=one_model, chat_embeddings=settings.embeddings)
    entries.append(first)
    if settings.embedding_model:
        name = settings.served_embedding_model_name or _default_name(settings.embedding_model)
        entries.append(CatalogModel(ModelSpec(model=settings.embedding_model, name=name, kind="embedding"), name,
                                    [name, settings.embedding_model], "embedding", pinned=one_model))
    specs = list(settings.models) + (_folder_models(settings.models_dir) if settings.models_dir else [])
    for spec in specs:
        name = spec.name or _default_name(spec.model)
        entries.append(CatalogModel(spec, name, [name, *spec.aliases, spec.model], spec.kind, pinned=spec.pinned))
    seen: dict[str, CatalogModel] = {}
    for entry in entries:
        for alias in dict.fromkeys(entry.names):
            other = seen.get(alias)
            if other is not None and other is not entry and alias == entry.name:
                raise ValueError(f"two models are named {alias!r} ({other.spec.model} and {entry.spec.model})")
            seen.setdefault(alias, entry)
        folder = Path(entry.spec.model).expanduser()
        if folder.is_dir():
            entry.folder = folder.resolve()
            entry.kind = entry.kind or kind_of_folder(entry.folder)
    first.kind = first.kind or "chat"  # --model is the chat model unless its folder says otherwise
    return entries


def resolve_kind(model: CatalogModel) -> str:
    """The model's kind, from its folder or its known name (chat when neither tells)."""
    if model.kind is None:
        model.kind = kind_of_folder(model.folder) if model.folder is not None else \
            (_known_kind(model.spec.model) or "chat")
    return model.kind


def estimate_bytes(folder: Path, settings: Settings) -> int:
    """Weights + KV (+ a process's overhead) a model folder needs when loaded with these settings.

    The KV: every slot holds max_model_len positions of every layer's K and V (engine.kv_cache), i.e.
    layers x 2 x kv_heads x head_size x max_model_len x max_batch x 4 bytes (float32; 2 for float16).
    """
    weights = sum(p.stat().st_size for p in folder.iterdir()
                  if p.is_file() and (p.name.startswith("model.onnx") or p.suffix == ".data")
                  and not p.name.startswith("embedding"))
    genai = folder / "genai_config.json"
    if not genai.is_file():  # an encoder: weights and activations only
        return weights + PROCESS_OVERHEAD_BYTES
    config = json.loads(genai.read_text(encoding="utf-8"))
    model, search = config["model"], config.get("search", {})
    decoder = model["decoder"]
    limit = model.get("context_length") or search.get("max_length") or _DEFAULT_MAX_LENGTH
    length = settings.max_model_len or min(limit, search.get("max_length") or _DEFAULT_MAX_LENGTH)
    head_size = decoder.get("head_size") or decoder["hidden_size"] // decoder["num_attention_heads"]
    kv_heads = decoder.get("num_key_value_heads") or decoder["num_attention_heads"]
    dtype_bytes = 2 if "16" in str(config.get("ortserve", {}).get("dtype", "float32")) else 4
    kv = decoder["num_hidden_layers"] * 2 * kv_heads * head_size * length * settings.max_batch * dtype_bytes
    return weights + kv + PROCESS_OVERHEAD_BYTES
