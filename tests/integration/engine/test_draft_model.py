"""Speculative decoding with a draft model on real sessions: the tiny model drafting for itself and for a different
tiny model of the same vocabulary (every path: catch-up, batched draft runs, checks, prefix reuse, n > 1, grammars),
a refused pair, and the real pair (Qwen2.5-Coder 1.5B drafted by 0.5B) giving the drafts-off greedy text."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.types import FinishReason, ModelLoadError, SamplingParams, StructuredOutput
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


# A schema whose every answer is short and completes: the tiny random model's JSON ends by itself.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


def constrained(kind: str = "json_schema", spec: str = json.dumps(SCHEMA), **kw) -> SamplingParams:
    values = dict(max_tokens=48, temperature=0.0, logprobs=True, top_logprobs=TOP_K)
    values.update(kw)
    return SamplingParams(structured=StructuredOutput(kind, spec), **values)


def finished_json(outputs: list) -> dict:
    """The answer of a constrained request that completed, checked against SCHEMA."""
    assert outputs[-1].finish_reason is FinishReason.STOP, [o.text for o in outputs]
    answer = json.loads("".join(o.text for o in outputs))
    jsonschema.validate(answer, SCHEMA)
    return answer


def test_a_constrained_request_drafts_inside_its_grammar(engines) -> None:
    """The draft model drafts only what the grammar allows (masked as the target is), each row of the check is masked
    after the draft tokens before it, and the grammar rolls back over rejected tokens: the output is the drafts-off
    output (near-tie rule) and valid, and most drafted tokens are kept."""
    drafted, plain = engines
    prompts = [list(range(5, 45)), list(range(300, 331)), [7, 8, 9] * 10]

    async def main():
        out = []
        for i, prompt in enumerate(prompts):
            out.append((await generate(drafted, prompt, constrained(), f"dj{i}"),
                        await generate(plain, prompt, constrained(), f"pj{i}")))
        return out

    for i, (with_drafts, without) in enumerate(asyncio.run(main())):
        assert finished_json(with_drafts) == finished_json(without)
        assert_same_greedy(with_drafts, without, f"prompt {i}")
        stats = with_drafts[-1].spec_decode
        # its drafts were checked, and (drafting for itself, inside the same mask) nearly all kept
        assert stats is not None and stats.num_spec_steps >= 1, stats
        assert stats.num_accepted_draft_tokens >= 0.8 * stats.num_draft_tokens, stats


def test_a_sampled_constrained_request_drafts_inside_its_grammar_and_stays_valid(engines, tiny_model: Path,
                                                                                 other_tiny: Path) -> None:
    """Speculative sampling under a grammar: q is the draft's masked law, p the target's; answers stay valid, and a
    draft model that disagrees (another random model) has drafts rejected and rolled back, valid all the same."""
    drafted, _ = engines
    other = make_engine(tiny_model, draft_model=str(other_tiny), draft_p_min=0.0, draft_max=4)
    try:
        async def main():
            return ([await generate(drafted, list(range(5, 45)), constrained(temperature=0.9, seed=s), f"ds{s}")
                     for s in range(4)],
                    [await generate(other, list(range(5, 45)), constrained(temperature=0.0), "og"),
                     *[await generate(other, list(range(5, 45)), constrained(temperature=0.9, seed=s), f"os{s}")
                       for s in range(4)]])

        mine, others = asyncio.run(main())
        for outputs in (*mine, *others):
            finished_json(outputs)
        checks = [o[-1].spec_decode for o in (*mine, *others) if o[-1].spec_decode is not None]
        assert sum(c.num_spec_steps for c in checks) >= 4
        # the other model's drafts are partly rejected: rollbacks happened and the answers are still valid
        rejected = sum(c.num_draft_tokens - c.num_accepted_draft_tokens for c in checks)
        assert rejected > 0
    finally:
        other.shutdown()


def test_prompt_lookup_drafts_stop_where_the_grammar_forbids_and_are_checked_masked(tiny_model: Path) -> None:
    """Prompt lookup under a grammar: the answer's JSON repeats what the prompt holds, so its n-grams match; the
    drafts are cut where the grammar forbids a token and checked row by row under the mask."""
    engine = make_engine(tiny_model, speculative_tokens=8)
    plain = make_engine(tiny_model)
    answer = '{"ok":true,"color":"green","n":7}'
    prompt = engine.tokenizer.encode(answer * 6)
    try:
        async def main():
            return (await generate(engine, prompt, constrained(), "lookup"),
                    await generate(plain, prompt, constrained(), "plain"))

        with_drafts, without = asyncio.run(main())
        assert finished_json(with_drafts) == finished_json(without)
        assert_same_greedy(with_drafts, without)
        stats = with_drafts[-1].spec_decode
        assert stats is not None and stats.num_spec_steps >= 1
    finally:
        engine.shutdown()
        plain.shutdown()


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
    """The folder `ortserve serve --draft-model qwen2.5-coder-0.5b` drafts with (six raw parts joined and converted
    once into the cache, its 5- and 8-bit linears requantized to Q4_0: --draft-quant's default)."""
    from engine.builder import pull_model

    return pull_model("qwen2.5-coder-0.5b", progress=False, requant="q4_0")


BOOK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": ["title", "year"], "additionalProperties": False}


def test_the_real_pair_gives_the_drafts_off_greedy_text(qwen_model: Path, qwen_draft_model: Path) -> None:
    """Every bench workload, and a JSON schema answer (drafted inside its grammar), as drafts-off greedy decoding
    gives them."""
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
            ids = drafted.tokenizer.encode(drafted.chat_template.render(
                [{"role": "user", "content": "Name a classic novel and its year as JSON."}]))
            params = constrained(spec=json.dumps(BOOK), max_tokens=40)
            out.append((await generate(drafted, ids, params, "d-book"), await generate(plain, ids, params, "p-book")))
            return out

        results = asyncio.run(main())
        for workload, (with_drafts, without) in zip((*WORKLOADS, "json_schema"), results):
            assert_same_greedy(with_drafts, without, workload)
        book = results[-1][0]
        assert book[-1].finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads("".join(o.text for o in book)), BOOK)
        assert book[-1].spec_decode is not None and book[-1].spec_decode.num_accepted_draft_tokens > 0
        assert drafted.stats().extra["spec_drafts_total"] > 0
    finally:
        drafted.shutdown()
        plain.shutdown()


def test_the_target_and_its_draft_stop_their_threads_spinning_after_each_run(engines) -> None:
    """Two sessions run in turn on the same cores: each stops its intra-op threads spinning as a run ends, so neither
    pool spins against the other's next run (EngineConfig.stop_spinning); a model with no draft keeps spinning."""
    drafted, plain = engines

    def entry(session) -> str:
        return session.get_session_options().get_session_config_entry("session.force_spinning_stop")

    assert entry(drafted._core.runner.session) == "1"
    assert entry(drafted._core.core.draft_model.runner.session) == "1"
    with pytest.raises(RuntimeError, match="force_spinning_stop"):  # not set: threads may spin on between runs
        entry(plain._core.runner.session)
