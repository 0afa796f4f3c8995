"""Writes an ONNX Runtime GenAI model folder atomically (temp folder beside the target, then rename).

Owns the genai_config.json / generation_config.json schema; no onnxruntime import.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import onnx
from tokenizers import Tokenizer

from engine.builder.errors import OutputExistsError
from engine.builder.graph import ModelSpec
from engine.builder.tokenizer import SpecialTokens

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
MARKER_FILE = ".ortserve-model.json"


def genai_config(spec: ModelSpec, special: SpecialTokens, *, max_length: int) -> dict[str, Any]:
    """genai_config.json as docs/ARCHITECTURE.md fixes it (the schema onnxruntime-genai reads)."""
    return {
        "model": {
            "type": spec.model_type,
            "context_length": spec.context_length,
            "vocab_size": spec.vocab_size,
            "bos_token_id": special.bos_id,
            "eos_token_id": [special.eos_id],
            "pad_token_id": special.pad_id,
            "decoder": {
                "filename": MODEL_FILE,
                "head_size": spec.head_size,
                "hidden_size": spec.hidden_size,
                "num_attention_heads": spec.num_heads,
                "num_key_value_heads": spec.num_kv_heads,
                "num_hidden_layers": spec.num_layers,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "max_length": max_length,
            "past_present_share_buffer": True,
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "top_k": 1,
            "top_p": 1.0,
            "temperature": 1.0,
            "repetition_penalty": 1.0,
            "early_stopping": True,
            "min_length": 0,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
        },
    }


def generation_config(special: SpecialTokens, *, max_length: int) -> dict[str, Any]:
    return {
        "bos_token_id": special.bos_id,
        "eos_token_id": [special.eos_id],
        "pad_token_id": special.pad_id,
        "max_length": max_length,
        "do_sample": False,
    }


def check_target(out_dir: Path, overwrite: bool) -> None:
    """Raises OutputExistsError before any work when ``out_dir`` exists and may not be replaced."""
    if out_dir.exists() and not overwrite:
        raise OutputExistsError(f"output folder {out_dir} already exists (pass overwrite=True to replace it)")


def write_model_folder(
    out_dir: Path,
    model: onnx.ModelProto,
    spec: ModelSpec,
    tokenizer: Tokenizer,
    special: SpecialTokens,
    tok_config: dict[str, Any],
    *,
    max_length: int,
    overwrite: bool = False,
    extra_files: dict[str, str] | None = None,
    marker: dict[str, Any] | None = None,
) -> Path:
    """Writes the whole folder into a temp folder beside ``out_dir`` and renames it into place.

    ``marker`` (cache bookkeeping) is written last as MARKER_FILE, with every file's size added, so
    ``marker_matches`` can tell a complete folder from a damaged one.

    NOTE(builder): readers never see a half-written folder: on any error the temp folder is removed
    and ``out_dir`` is untouched; with ``overwrite`` the old folder is replaced only after success.

    Returns:
        ``out_dir``, resolved.
    """
    out_dir = Path(out_dir).resolve()
    check_target(out_dir, overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        onnx.save_model(model, tmp / MODEL_FILE, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)
        _write_json(tmp / "genai_config.json", genai_config(spec, special, max_length=max_length))
        _write_json(tmp / "generation_config.json", generation_config(special, max_length=max_length))
        _write_json(tmp / "tokenizer_config.json", tok_config)
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if marker is not None:
            sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
            _write_json(tmp / MARKER_FILE, {**marker, "files": sizes})
        _set_modes(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{tmp.name[-8:]}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def marker_matches(folder: Path, marker: dict[str, Any]) -> bool:
    """True when ``folder`` was completed with this marker and its files still have their sizes."""
    try:
        found = json.loads((folder / MARKER_FILE).read_text())
        sizes = found.pop("files")
        return found == marker and all((folder / n).stat().st_size == size for n, size in sizes.items())
    except (OSError, ValueError, KeyError, AttributeError):
        return False


def _set_modes(folder: Path) -> None:
    """mkdtemp makes 0700 folders: give the folder and its files the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
