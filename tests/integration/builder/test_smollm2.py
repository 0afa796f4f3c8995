"""The real SmolLM2-135M-Instruct GGUF converted exactly: float64 reference parity, onnxruntime-genai
compatibility, the float16 build."""

from __future__ import annotations

import numpy as np
import onnxruntime_genai as og
import pytest

from engine.builder import convert_gguf
from engine.builder.convert import gguf_tokenizer
from engine.builder.gguf_reader import open_gguf
from engine.builder.reference import ReferenceModel
from tests.integration.builder.conftest import assert_greedy_like_reference

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
MAX_LEN = 128


@pytest.fixture(scope="module")
def prompt_ids(smollm2_gguf) -> list[int]:
    tok, _ = gguf_tokenizer(open_gguf(smollm2_gguf, max_layers=1))
    return tok.encode(PROMPT).ids


def test_truncated_model_matches_float64_reference(tmp_path, smollm2_gguf, prompt_ids, make_runner, ref_greedy):
    folder = convert_gguf(smollm2_gguf, tmp_path / "l4", accuracy_level=0, max_layers=4, max_length=MAX_LEN,
                          progress=False)
    model = open_gguf(smollm2_gguf, max_layers=4)
    ref = ReferenceModel(model.spec, model.load_weights())
    _, logits = make_runner(folder).greedy(prompt_ids, 16, MAX_LEN)
    _, ref_logits = ref_greedy(ref, prompt_ids, 16)
    assert_greedy_like_reference(logits, ref_logits, 1e-3)


def _genai_greedy(folder, prompt_ids: list[int], num_tokens: int) -> list[int]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + num_tokens, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt_ids, np.int32))
    out = []
    while not gen.is_done():
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    return out


def test_full_model_reference_ort_and_genai_agree(tmp_path, smollm2_gguf, prompt_ids, make_runner, ref_greedy):
    n = 12
    folder = convert_gguf(smollm2_gguf, tmp_path / "acc0", accuracy_level=0, max_length=MAX_LEN, progress=False)
    model = open_gguf(smollm2_gguf)
    ref_tokens, ref_logits = ref_greedy(ReferenceModel(model.spec, model.load_weights()), prompt_ids, n)
    ort_tokens, logits = make_runner(folder, threads=2).greedy(prompt_ids, n, MAX_LEN)
    assert_greedy_like_reference(logits, ref_logits, 1e-3)
    # NOTE(tests): onnxruntime-genai runs the folder as our loop does (the prompt in one run, then one row per step),
    # and the reference's tokens are ONNX Runtime's (checked above, 1e-3 apart against margins of >= 0.1 here)
    assert ort_tokens == ref_tokens
    # onnxruntime-genai stops after eos (2); compare up to and including it
    expected = ref_tokens[: ref_tokens.index(2) + 1] if 2 in ref_tokens else ref_tokens
    assert _genai_greedy(folder, prompt_ids, n) == expected
    tok, _ = gguf_tokenizer(model)
    assert "Paris" in tok.decode(ref_tokens)


def test_genai_loads_default_folder_and_matches_our_loop(smollm2_dir, prompt_ids, make_runner):
    n = 12
    ours, _ = make_runner(smollm2_dir, threads=2).greedy(prompt_ids, n, MAX_LEN)
    expected = ours[: ours.index(2) + 1] if 2 in ours else ours
    # NOTE(tests): exact on every CPU: two one-row decoders over the same folder (the prompt in one run, then one row
    # per step), the same kernels
    assert _genai_greedy(smollm2_dir, prompt_ids, n) == expected
    tok = og.Tokenizer(og.Model(str(smollm2_dir)))
    assert list(tok.encode(PROMPT)) == prompt_ids


def test_float16_build_close_to_reference(tmp_path, smollm2_gguf, prompt_ids, make_runner):
    folder = convert_gguf(smollm2_gguf, tmp_path / "fp16", dtype="float16", max_layers=2, max_length=MAX_LEN,
                          progress=False)
    runner = make_runner(folder)
    assert runner.kv_dtype == np.float16
    logits, _ = runner.step(runner.zeros(1, MAX_LEN), [prompt_ids], [0])
    model = open_gguf(smollm2_gguf, max_layers=2)
    ref = ReferenceModel(model.spec, model.load_weights()).forward(prompt_ids)
    rel = np.abs(logits[0] - ref).max() / np.abs(ref).max()
    assert rel < 0.02, f"float16 relative logit error {rel}"
    assert (logits[0].argmax(-1) == ref.argmax(-1)).mean() > 0.9
