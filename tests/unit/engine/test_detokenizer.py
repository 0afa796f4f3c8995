"""IncrementalDetokenizer: whole characters only, stop strings cut and never streamed, on a real BPE."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer


def stream(tok, text, *, stop=(), include=False, prompt="Hi", finish_on_stop=True):
    """Feed ``text``'s tokens one at a time; return (deltas, matched stop, token steps)."""
    prompt_ids = tok.encode(prompt).ids
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stop, include_stop_str_in_output=include)
    deltas, matched = [], None
    for i, token_id in enumerate(ids):
        matched = detok.update([token_id])
        last = i == len(ids) - 1
        deltas.append(detok.next_delta(finished=last or matched is not None))
        if matched is not None and finish_on_stop:
            break
    return deltas, matched, ids


def test_multibyte_characters_are_never_split(bpe_tokenizer):
    text = "Llama 🦙 says 你好 and 🇯🇵!"  # none of these characters is in the training corpus
    deltas, _, ids = stream(bpe_tokenizer, text)
    assert "".join(deltas) == text
    assert len(ids) > len(text.split())  # the rare characters really are byte tokens
    assert "" in deltas  # some steps ended inside a character and sent nothing
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # would raise on a lone surrogate


def test_cjk_and_emoji_from_corpus_round_trip(bpe_tokenizer):
    text = "日本語のテキスト 😀 👍🏽 café"
    deltas, _, _ = stream(bpe_tokenizer, text)
    assert "".join(deltas) == text


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(bpe_tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "fox jum"  # spans several tokens
    deltas, matched, _ = stream(bpe_tokenizer, text, stop=(stop,))
    assert matched == stop
    assert "".join(deltas) == "The quick brown "
    seen = ""
    for delta in deltas:
        seen += delta
        assert stop not in seen and not seen.endswith("fox")


def test_partial_stop_at_the_end_is_released_when_finished(bpe_tokenizer):
    text = "hello there END"
    deltas, matched, _ = stream(bpe_tokenizer, text, stop=("ENDING",))
    assert matched is None
    assert "".join(deltas) == text
    assert not deltas[-2].endswith("EN")  # held back until the finish decided it


def test_include_stop_str_in_output(bpe_tokenizer):
    deltas, matched, _ = stream(bpe_tokenizer, "return 42\n\nmore", stop=("42",), include=True)
    assert matched == "42"
    assert "".join(deltas) == "return 42"


def test_earliest_of_several_stop_strings_wins(bpe_tokenizer):
    deltas, matched, _ = stream(bpe_tokenizer, "alpha beta gamma delta", stop=("delta", "beta"))
    assert matched == "beta"
    assert "".join(deltas) == "alpha "


def test_stop_terminated_token_is_not_decoded(bpe_tokenizer):
    im_end = bpe_tokenizer.token_to_id("<|im_end|>")
    ids = bpe_tokenizer.encode("Hello world").ids
    detok = IncrementalDetokenizer(bpe_tokenizer, [], skip_special_tokens=False)
    detok.update(ids)
    detok.update([im_end], stop_terminated=True)
    assert detok.next_delta(finished=True) == "Hello world"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab c日😀\n")), min_size=1, max_size=40), st.data())
def test_stream_equals_batch_decode_cut_at_the_first_stop(bpe_tokenizer, text, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 3))]
    deltas, matched, ids = stream(bpe_tokenizer, text, stop=(stop,))
    full = bpe_tokenizer.decode(ids)
    cut = full.find(stop)
    assert matched == stop and cut >= 0
    assert "".join(deltas) == full[:cut]


def _byte_fallback_tokenizer():
    """A SentencePiece-style vocabulary (pieces with scores, <0xNN> byte pieces), as engine.builder makes."""
    from engine.builder.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, build_spm_tokenizer

    pieces = ["\u2581", *"abcdefghij", "\u2581a", "\u2581b", "ab"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [TOKEN_CONTROL] * 4 + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * len(pieces)
    scores = [0.0] * 260 + [-float(i) for i in range(len(pieces))]
    return build_spm_tokenizer(tokens, scores, types, bos_id=2, eos_id=1, add_bos=False, add_space_prefix=False)


def test_byte_fallback_bytes_that_never_form_a_character():
    """A model may emit byte pieces that are not valid UTF-8 (DecodeStream then raises): the text keeps
    U+FFFD for them and decoding goes on with the next pieces, every token accounted for."""
    tok = _byte_fallback_tokenizer()
    ab, space_a = tok.token_to_id("ab"), tok.token_to_id("\u2581a")
    emoji = [4 + b for b in "\U0001f389".encode()]  # a whole character from four byte pieces
    ids = [ab, 4 + 0xF0, 4 + 0x9F, space_a, *emoji, 4 + 0xC3, ab]
    detok = IncrementalDetokenizer(tok, [ab])
    for token_id in ids:
        detok.update([token_id])
    assert detok.next_delta(finished=True) == detok.text == "ab\ufffd\ufffd a\U0001f389\ufffdab"


def test_preserved_special_tokens_stay_in_the_text_and_others_do_not(bpe_tokenizer):
    im_start, im_end, eot = (bpe_tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    body = bpe_tokenizer.encode("hello world").ids
    ids = [im_start, *body, eot, *body, im_end]
    prompt = bpe_tokenizer.encode("Hi").ids
    plain = IncrementalDetokenizer(bpe_tokenizer, prompt)
    plain.update(ids)
    assert plain.text == "hello worldhello world"  # every special token skipped, as before
    kept = IncrementalDetokenizer(bpe_tokenizer, prompt, preserved_token_ids=[im_start, im_end])
    deltas = []
    for token_id in ids:
        kept.update([token_id])
        deltas.append(kept.next_delta())
    assert "".join(deltas) == kept.text == "<|im_start|>hello worldhello world<|im_end|>"
