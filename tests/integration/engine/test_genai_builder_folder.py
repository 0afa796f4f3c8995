"""Folders in the shape onnxruntime-genai's own model builder writes: no position_ids input (GroupQueryAttention
derives positions from the mask's lengths), a symbolic head dimension on the KV inputs, no logits_to_keep. The
engine serves them and answers as onnxruntime-genai does on the same folder."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxruntime_genai as og
import pytest
from onnx import helper, numpy_helper

from engine.async_engine import AsyncEngine
from engine.builder import SyntheticSpec, build_synthetic
from engine.config import EngineConfig
from engine.model_loader import check_graph, read_model_folder
from engine.types import SamplingParams
from tests.greedy_close import TINY_MAX_GAP_NATS, TOP_K, GreedyRun, assert_greedy_close

PROMPTS = [[1, 40, 77, 300, 20, 9], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


def genai_builder_shape(src: Path, dst: Path) -> Path:
    """A copy of ``src`` rewritten to onnxruntime-genai's builder's I/O: position_ids and logits_to_keep gone,
    the KV head dimension symbolic."""
    shutil.copytree(src, dst)
    model = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    g = model.graph
    for node in g.node:
        if node.op_type == "GroupQueryAttention":
            del node.input[9:]  # cos/sin caches stay; position_ids (input 9) goes
    keep = next(i for i in g.initializer if i.name == "logits_to_keep")
    g.node.insert(0, helper.make_node("Constant", [], ["logits_to_keep"], value=numpy_helper.from_array(
        numpy_helper.to_array(keep), "logits_to_keep_value")))
    g.initializer.remove(keep)
    for name in ("position_ids", "logits_to_keep"):
        g.input.remove(next(i for i in g.input if i.name == name))
    for vi in [*g.input, *g.output]:
        if vi.name.startswith(("past_key_values.", "present.")):
            vi.type.tensor_type.shape.dim[3].dim_param = "head_size"
    onnx.save_model(model, str(dst / "model.onnx"))  # the weights stay in model.onnx.data
    cfg_path = dst / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["model"]["decoder"]["inputs"]["position_ids"]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai_shape")
    ours = build_synthetic(root / "ours", SyntheticSpec(vocab_size=512, max_length=128, seed=3))
    return ours, genai_builder_shape(ours, root / "genai")


def genai_greedy(folder: Path, prompt: list[int], n: int) -> GreedyRun:
    """onnxruntime-genai's greedy tokens, with the top-k of the logits each was chosen from."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array(prompt, np.int32))
    out, rows = [], []
    while not gen.is_done():
        rows.append(np.asarray(gen.get_logits()).reshape(-1).copy())
        gen.generate_next_token()
        out.append(int(gen.get_next_tokens()[0]))
    run = GreedyRun.from_logits(rows)
    assert list(run.tokens) == out  # the logits read are the ones it chose from
    return run


def engine_greedy(folder: Path, prompts: list[list[int]], n: int) -> list[GreedyRun]:
    """All prompts at once (batched decode, ragged lengths, a 4-token prefill budget so prompts are chunked)."""
    engine = AsyncEngine.from_model_dir(folder, EngineConfig(max_batch=2, prefill_chunk=4, seed=0))

    async def one(i):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)
        return GreedyRun.from_engine([out async for out in engine.generate(prompts[i], params, f"g{i}")])

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def test_folder_has_the_genai_builder_shape(folders):
    _, genai = folders
    folder = read_model_folder(genai)
    session = ort.InferenceSession(str(folder.model_file), providers=["CPUExecutionProvider"])
    io = check_graph(folder, session)
    assert io.position_ids is None
    kv = next(i for i in session.get_inputs() if i.name == "past_key_values.0.key")
    assert kv.shape[3] == "head_size"
    assert "logits_to_keep" not in {i.name for i in session.get_overridable_initializers()}


def test_engine_answers_like_onnxruntime_genai(folders):
    ours, genai = folders
    n = 20
    expected = [genai_greedy(genai, p, n) for p in PROMPTS]
    # NOTE(tests): onnxruntime-genai decodes each prompt alone, the engine both in one batch: up to a near-tie
    for folder, what in ((genai, "genai's folder"), (ours, "our builder's folder of the same weights")):
        for i, got in enumerate(engine_greedy(folder, PROMPTS, n)):
            assert_greedy_close(expected[i], got, TINY_MAX_GAP_NATS, f"prompt {i} on {what}")
