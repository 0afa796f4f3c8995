"""Small Qwen2 GGUF files for the perf/gpu tests (test_bench_gguf, test_draft_pair): a vocabulary file the converter
takes, and a converted folder's logits through ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def write_qwen2_vocab(path: Path) -> Path:
    """A Qwen2 vocabulary file (tokenizer fields only): a real byte-level BPE vocabulary of 300 tokens (the converter
    builds it), ids 1 and 2 BOS and EOS."""
    from engine.builder.tokenizer import synthetic_vocab

    tokens, merges, types = synthetic_vocab(300)
    v = gguf.GGUFWriter(str(path), "qwen2")
    v.add_tokenizer_model("gpt2")
    v.add_tokenizer_pre("qwen2")
    v.add_token_list(tokens)
    v.add_token_types(types)
    v.add_token_merges([f"{a} {b}" for a, b in merges])
    v.add_bos_token_id(1)
    v.add_eos_token_id(2)
    v.write_header_to_file()
    v.write_kv_data_to_file()
    v.write_tensors_to_file()
    v.close()
    return path


def folder_logits(folder: Path, ids: list[int], num_kv_heads: int = 2, head_size: int = 64) -> np.ndarray:
    """A converted folder's logits ``[1, len(ids), V]`` for ``ids`` as a first prompt (ONNX Runtime, CPU)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    n = len(ids)
    feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n)[None]}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, num_kv_heads, n, head_size), np.float32)
    return session.run(["logits"], feeds)[0]
