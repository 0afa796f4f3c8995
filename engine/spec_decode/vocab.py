"""Whether a draft model can draft for a target: the same tokenizer (type, tokens by id, merges, BOS and EOS), as
llama.cpp's common_speculative_are_compatible checks. Reads the folders' tokenizer.json and genai_config.json only;
no onnxruntime.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.types import ModelLoadError

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: a larger model's vocabulary may carry a few more (padding) tokens.
MAX_SIZE_DIFFERENCE = 128


def check_same_vocabulary(target: Path, draft: Path) -> None:
    """Raise ModelLoadError naming the first difference between the two folders' tokenizers, if any.

    Args:
        target, draft: model folders (each with tokenizer.json and genai_config.json).
    """
    t_tok, d_tok = _read(target / "tokenizer.json"), _read(draft / "tokenizer.json")
    where = f"the draft model {draft.name} cannot draft for {target.name}"
    t_type, d_type = t_tok.get("model", {}).get("type"), d_tok.get("model", {}).get("type")
    if t_type != d_type:
        raise ModelLoadError(f"{where}: tokenizer type {d_type!r}, the target's is {t_type!r}")
    t_ids, d_ids = _tokens_by_id(t_tok), _tokens_by_id(d_tok)
    if abs(len(t_ids) - len(d_ids)) > MAX_SIZE_DIFFERENCE:
        raise ModelLoadError(f"{where}: {len(d_ids)} tokens, the target has {len(t_ids)} (more than "
                             f"{MAX_SIZE_DIFFERENCE} apart)")
    for token_id in range(min(len(t_ids), len(d_ids))):
        if t_ids[token_id] != d_ids[token_id]:
            raise ModelLoadError(f"{where}: token {token_id} is {d_ids[token_id]!r} in the draft, "
                                 f"{t_ids[token_id]!r} in the target")
    t_merges, d_merges = t_tok.get("model", {}).get("merges") or [], d_tok.get("model", {}).get("merges") or []
    for i, (a, b) in enumerate(zip(t_merges, d_merges)):
        if a != b:
            raise ModelLoadError(f"{where}: merge {i} is {b!r} in the draft, {a!r} in the target")
    if len(t_merges) != len(d_merges):
        raise ModelLoadError(f"{where}: {len(d_merges)} merges, the target has {len(t_merges)}")
    t_model, d_model = _read(target / "genai_config.json")["model"], _read(draft / "genai_config.json")["model"]
    for key in ("bos_token_id", "eos_token_id"):
        if _ids(t_model.get(key)) != _ids(d_model.get(key)):
            raise ModelLoadError(f"{where}: {key} {d_model.get(key)!r}, the target's is {t_model.get(key)!r}")


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _tokens_by_id(tokenizer: dict[str, Any]) -> list[str | None]:
    """Each id's token text (the model's vocabulary and the added tokens); None for an id that names none."""
    vocab: dict[str, int] = dict(tokenizer.get("model", {}).get("vocab") or {})
    if isinstance(tokenizer.get("model", {}).get("vocab"), list):  # Unigram: [[piece, score], ...]
        vocab = {piece: i for i, (piece, _) in enumerate(tokenizer["model"]["vocab"])}
    for added in tokenizer.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    out: list[str | None] = [None] * (max(vocab.values(), default=-1) + 1)
    for text, token_id in vocab.items():
        out[token_id] = text
    return out


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (value,)
