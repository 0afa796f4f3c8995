"""The model's tokenizer (tokenizer.json via Hugging Face ``tokenizers``) and its special tokens.

No onnxruntime import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.types import ModelLoadError

# End-of-turn markers of common chat templates: when such a token exists and the template uses it, it
# ends a request like eos does.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class Tokenizer:
    """Encode/decode text for one model.

    Args:
        hf: the loaded ``tokenizers.Tokenizer``.
    """

    def __init__(self, hf: HFTokenizer) -> None:
        self.hf = hf

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """Size including added tokens."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are recognized.

        ``add_special_tokens`` adds what the tokenizer's post-processor adds (e.g. BOS); rendered chat
        templates already contain their special tokens, so the default is False.
        """
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def special_token_id(self, token: str) -> int | None:
        """The id of ``token`` if a grammar must name it as a token rather than spell it, else None.

        That is a special added token (``[TOOL_CALLS]``), and also any added token written ``<...>`` (Qwen's
        ``<tool_call>`` is added but not special): NOTE(tools): llguidance treats those as special too, so
        their bytes never match grammar text.
        """
        token_id = self.hf.token_to_id(token)
        if token_id is None:
            return None
        added = self.hf.get_added_tokens_decoder().get(token_id)
        if added is None:
            return None
        return token_id if added.special or (token.startswith("<") and token.endswith(">")) else None
