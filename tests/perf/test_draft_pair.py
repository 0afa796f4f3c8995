"""perf/gpu/draft_pair.py: a target and draft pair with planted agreement (issue 48's GPU bench). At a tiny Qwen2 shape
here (the GPU machine writes the 1.5B and 0.5B ones): ortserve's converter and ONNX Runtime give the planted greedy
tokens, the target counting up from the last token id and the draft off by one exactly after its missed ids; and
llama.cpp's K-quant fallback for rows that are no whole number of super-blocks (the real 0.5B's 896)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from perf.gpu.bench_gguf import q5_0_blocks, q8_0_blocks, tensor_type
from perf.gpu.draft_pair import misses, write_pair_member
from tests.perf.qwen2_files import folder_logits, write_qwen2_vocab

VOCAB = 320
SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512, vocab_size=VOCAB,
             arch="qwen2", rope_theta=1e6, context_length=4096, tied=True)


def _greedy_next(folder: Path, ids: list[int]) -> int:
    """The converted model's argmax after ``ids``."""
    return int(np.argmax(folder_logits(folder, ids)[0, -1]))


def test_the_planted_pair_gives_the_planted_greedy_tokens_through_the_converter(tmp_path: Path):
    from engine.builder import convert_gguf

    vocab = write_qwen2_vocab(tmp_path / "vocab.gguf")
    target = write_pair_member(vocab, tmp_path / "target.gguf", SHAPE, None, seed=0, num_frequencies=32)
    draft = write_pair_member(vocab, tmp_path / "draft.gguf", SHAPE, 0.5, seed=1, num_frequencies=32)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(draft)).tensors}
    assert types["token_embd.weight"] == "F16" and types["output.weight"] == "Q8_0"
    assert types["blk.0.ffn_up.weight"] == "Q4_K"  # the layers keep the Q4_K_M mix
    t_folder = convert_gguf(target, tmp_path / "target", progress=False)
    d_folder = convert_gguf(draft, tmp_path / "draft", progress=False)
    missed = misses(VOCAB, 0.5)
    checked = {True: 0, False: 0}
    for last in (5, 17, 40, 77, 123, 200, 251, 290):
        prefix = [3, 9, last]  # what came before the last token does not matter
        assert _greedy_next(t_folder, prefix) == last + 1
        assert _greedy_next(d_folder, prefix) == last + 1 + int(missed[last])
        checked[bool(missed[last])] += 1
    assert checked[True] and checked[False]  # both kinds of position were seen


def test_k_quants_fall_back_where_rows_are_no_whole_super_block():
    assert tensor_type("blk.0.attn_q.weight", "Q4_K_M", 0, 24, tied=True, cols=896) == "Q5_0"
    assert tensor_type("blk.0.attn_v.weight", "Q4_K_M", 0, 24, tied=True, cols=896) == "Q8_0"  # Q6_K's fallback
    assert tensor_type("blk.0.ffn_down.weight", "Q4_K_M", 0, 24, tied=True, cols=4864) == "Q6_K"  # 19 super-blocks
    rng = np.random.default_rng(0)
    for make, kind in ((q5_0_blocks, gguf.GGMLQuantizationType.Q5_0), (q8_0_blocks, gguf.GGMLQuantizationType.Q8_0)):
        w = gguf.quants.dequantize(make(rng, 64, 896, std=0.02), kind)
        assert w.shape == (64, 896) and w.std() == pytest.approx(0.02, rel=0.1)
