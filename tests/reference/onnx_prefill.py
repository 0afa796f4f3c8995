"""A whole-graph prefill reference: an ONNX decoder run chunk by chunk over one max-length KV buffer, no engine."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort


def last_logits(session: ort.InferenceSession, ids: list[int], chunks: list[tuple[int, int]],
                max_len: int) -> np.ndarray:
    """Prefill ``ids`` in ``chunks`` over one ``max_len`` KV buffer fed back each run; the last position's logits
    (perf/gqa_window.py's and tests/integration/builder/test_gemma3.py's reference)."""
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    kv = {i.name: np.zeros((1, i.shape[1], max_len, i.shape[3]), np.float32) for i in past}
    names = [o.name for o in session.get_outputs()]
    for start, end in chunks:
        mask = np.zeros((1, max_len), np.int64)
        mask[0, :end] = 1
        feed = {"input_ids": np.array([ids[start:end]], np.int64), "attention_mask": mask,
                "position_ids": np.arange(start, end, dtype=np.int64)[None], "logits_to_keep": np.array([1]), **kv}
        out = session.run(None, feed)
        kv = {n.replace("present", "past_key_values"): v for n, v in zip(names[1:], out[1:])}
    return out[0][0, -1]
