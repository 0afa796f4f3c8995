"""The end-of-generation (EOG) token set, decided as llama.cpp's llama-vocab.cpp decides it.

Pure Python over a vocabulary (token text -> id); the builder writes the set into a converted folder and the
model loader recomputes it for folders converted before (no reconversion). No onnxruntime import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# NOTE(engine): llama.cpp finds these by their text (its ref: ggml-org/llama.cpp issue 9606), in this order of
# precedence: a GGUF id (tokenizer.ggml.eot_token_id, ...) first, else the first matching vocabulary token.
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
             "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
# Every vocabulary token with one of these texts ends generation.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")


def eog_token_ids(
    vocab: Mapping[str, int],
    *,
    eos_ids: Iterable[int] = (),
    eot_id: int | None = None,
    eom_id: int | None = None,
    fim_pad_id: int | None = None,
    fim_rep_id: int | None = None,
    fim_sep_id: int | None = None,
    vocab_size: int | None = None,
) -> frozenset[int]:
    """The ids that end generation: the eos ids, eot, eom, the FIM pad/repo/file-separator tokens, and every
    token whose text llama.cpp lists as end-of-generation (``EOG_TEXTS``).

    Args:
        vocab: token text -> id, added tokens included (``tokenizers.Tokenizer.get_vocab(True)``).
        eos_ids: the model's eos id(s) (a GGUF's ``tokenizer.ggml.eos_token_id``, a folder's eos_token_id list).
        eot_id, eom_id, fim_*_id: the GGUF's own ids where it names them; None -> found by text, as llama.cpp.
        vocab_size: ids at or past it are dropped (None: ``len(vocab)``'s bound is not applied).
    Returns:
        The set, e.g. {128247, 151643, 151645, 151662, 151663, 151664} for Qwen2.5-Coder ("</s>", <|endoftext|>,
        <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>).
    """
    def by_text(given: int | None, texts: tuple[str, ...]) -> int | None:
        if given is not None:
            return given
        found = [vocab[t] for t in texts if t in vocab]
        return min(found) if found else None  # llama.cpp takes its map's first match; the lowest id here

    eog = {i for i in (by_text(fim_pad_id, FIM_PAD_TEXTS), by_text(fim_rep_id, FIM_REP_TEXTS),
                       by_text(fim_sep_id, FIM_SEP_TEXTS)) if i is not None}
    eog |= {vocab[t] for t in EOG_TEXTS if t in vocab}
    eog |= set(eos_ids)
    eog |= {i for i in (by_text(eot_id, EOT_TEXTS), by_text(eom_id, EOM_TEXTS)) if i is not None}
    if vocab_size is not None:
        eog = {i for i in eog if 0 <= i < vocab_size}
    texts = {vocab_text: i for vocab_text, i in vocab.items() if i in eog}
    # NOTE(engine): llama.cpp's workarounds: in gpt-oss (o200k_harmony, <|return|> + <|call|>) and solar-open
    # (<|calls|> + <|flush|>) vocabularies <|end|> ends a message, not the generation; in Gemma 4 (<|tool_response>)
    # and PLaMo (<|plamo:eos|>) vocabularies </s> is a normal token. Elsewhere a </s> ends generation even where
    # the vocabulary has it as a normal token (PaddleOCR's rule; Qwen2.5's HTML "</s>", id 128247, is one).
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        eog.discard(texts["<|end|>"])
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in vocab):
        eog.discard(texts["</s>"])
    return frozenset(eog)
