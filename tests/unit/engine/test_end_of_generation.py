"""The end-of-generation set on hand-built vocabularies, rule by rule as llama.cpp's llama-vocab.cpp has them."""

from __future__ import annotations

from engine.end_of_generation import eog_token_ids


def vocab(*texts: str) -> dict[str, int]:
    return {t: i for i, t in enumerate(texts)}


def test_qwen_ends_on_endoftext_im_end_its_fim_repo_and_file_separator_tokens_and_closing_s():
    v = vocab("hello", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>",
              "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_call>", "</s>")
    assert eog_token_ids(v, eos_ids=[3]) == {1, 3, 7, 8, 9, 11}


def test_the_eos_eot_and_eom_ids_count_whatever_their_text():
    v = vocab("a", "b", "c", "d")
    assert eog_token_ids(v, eos_ids=[0], eot_id=1, eom_id=2) == {0, 1, 2}
    assert eog_token_ids(v) == frozenset()


def test_gguf_fim_ids_replace_the_text_search():
    v = vocab("<|fim_pad|>", "x", "<|repo_name|>", "y")
    assert eog_token_ids(v, fim_pad_id=1, fim_rep_id=3) == {1, 3}


def test_llama3_and_gemma_turn_ends():
    assert eog_token_ids(vocab("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"),
                         eos_ids=[1]) == {1, 2, 3}
    assert eog_token_ids(vocab("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
                         eos_ids=[1]) == {1, 4}


def test_harmony_vocabularies_end_on_return_and_call_but_not_on_end():
    v = vocab("<|start|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>")
    assert eog_token_ids(v, eos_ids=[2]) == {2, 3, 4}
    # without <|return|>/<|call|>, <|end|> (Phi-3/4) ends generation
    assert eog_token_ids(vocab("<|end|>", "<|user|>"), eos_ids=[]) == {0}


def test_tool_response_vocabularies_do_not_end_on_closing_s():
    assert eog_token_ids(vocab("<s>", "</s>", "<|tool_response>", "<turn|>")) == {2, 3}
    assert eog_token_ids(vocab("<s>", "</s>", "<|plamo:eos|>"), eos_ids=[2]) == {2}
    assert eog_token_ids(vocab("<s>", "</s>")) == {1}


def test_ids_past_the_vocabulary_are_dropped():
    assert eog_token_ids(vocab("a", "<|im_end|>"), eos_ids=[1, 99], vocab_size=2) == {1}
