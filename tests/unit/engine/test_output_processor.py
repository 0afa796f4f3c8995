"""OutputProcessor: CoreOutputs -> RequestOutput deltas, stop strings -> aborts, stale outputs dropped."""

from __future__ import annotations

import asyncio

from engine.types import CoreOutput
from engine.detokenizer import IncrementalDetokenizer
from engine.output_processor import OutputProcessor, RequestState, merge_outputs
from engine.types import FinishReason, SamplingParams


def make_state(tok, rid, stop=(), seq=1):
    params = SamplingParams(stop=stop)
    return RequestState(rid, 3, params, IncrementalDetokenizer(tok, [5, 6, 7], stop=stop), seq=seq)


def drain(state):
    out = []
    while not state.queue.empty():
        out.append(state.queue.get_nowait())
    return out


def test_stop_string_finishes_and_asks_the_core_to_abort(bpe_tokenizer):
    async def main():
        proc = OutputProcessor()
        state = make_state(bpe_tokenizer, "a", stop=("lazy",))
        proc.add(state)
        ids = bpe_tokenizer.encode("the lazy dog").ids
        aborts = []
        for t in ids:
            aborts += proc.process([CoreOutput("a", (t,), seq=1)])
        outs = drain(state)
        assert aborts == [("a", 0)] and "a" not in proc.states
        assert "".join(o.text for o in outs) == "the "
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
        assert [o.finished for o in outs].count(True) == 1
        assert outs[-1].num_generated_tokens == len(outs)

    asyncio.run(main())


def test_eos_finish_flushes_held_text_and_does_not_decode_the_stop_token(bpe_tokenizer):
    async def main():
        proc = OutputProcessor()
        state = make_state(bpe_tokenizer, "b", stop=("hello world",))
        proc.add(state)
        ids = bpe_tokenizer.encode("hello").ids
        im_end = bpe_tokenizer.token_to_id("<|im_end|>")
        aborts = proc.process([CoreOutput("b", (t,), seq=1) for t in ids])
        aborts += proc.process([CoreOutput("b", (im_end,), FinishReason.STOP, seq=1)])
        outs = drain(state)
        assert not aborts
        assert "".join(o.text for o in outs) == "hello"  # the held-back prefix of the stop string
        assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].token_ids == (im_end,)

    asyncio.run(main())


def test_outputs_of_an_older_request_with_the_same_id_are_dropped(bpe_tokenizer):
    async def main():
        proc = OutputProcessor()
        state = make_state(bpe_tokenizer, "c", seq=2)
        proc.add(state)
        proc.process([CoreOutput("c", (40,), seq=1), CoreOutput("other", (41,), seq=2)])
        assert drain(state) == []
        proc.process([CoreOutput("c", (40,), seq=2)])
        assert len(drain(state)) == 1

    asyncio.run(main())


def test_merge_outputs_concatenates_deltas(bpe_tokenizer):
    async def main():
        proc = OutputProcessor()
        state = make_state(bpe_tokenizer, "d")
        proc.add(state)
        ids = bpe_tokenizer.encode("Hello world").ids
        proc.process([CoreOutput("d", (t,), seq=1) for t in ids[:-1]])
        proc.process([CoreOutput("d", (ids[-1],), FinishReason.LENGTH, seq=1)])
        merged = merge_outputs(drain(state))
        assert merged.text == "Hello world" and merged.token_ids == tuple(ids)
        assert merged.finished and merged.finish_reason is FinishReason.LENGTH

    asyncio.run(main())


def test_a_stop_string_ends_one_choice_and_the_request_ends_with_the_last_choice(bpe_tokenizer):
    async def main():
        proc = OutputProcessor()
        params = SamplingParams(stop=("lazy",), n=2)
        detoks = [IncrementalDetokenizer(bpe_tokenizer, [5, 6, 7], stop=("lazy",)) for _ in range(2)]
        state = RequestState("n", 3, params, detoks[0], seq=1, more_detokenizers=detoks[1:])
        proc.add(state)
        lazy = bpe_tokenizer.encode("the lazy dog").ids
        calm = bpe_tokenizer.encode("a calm cat").ids
        aborts = []
        for a, b in zip(calm, lazy):
            aborts += proc.process([CoreOutput("n", (a,), seq=1, index=0), CoreOutput("n", (b,), seq=1, index=1)])
        assert aborts == [("n", 1)] and "n" in proc.states  # choice 1 stopped; choice 0 still runs
        proc.process([CoreOutput("n", (5,), seq=1, index=1)])  # a late output of the stopped choice: dropped
        proc.process([CoreOutput("n", (5,), FinishReason.LENGTH, seq=1, index=0)])
        outs = drain(state)
        assert "n" not in proc.states
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished and outs[-1].index == 0
        ends = {o.index: o.finish_reason for o in outs if o.finish_reason is not None}
        assert ends == {0: FinishReason.LENGTH, 1: FinishReason.STOP}
        assert "".join(o.text for o in outs if o.index == 1) == "the "
        # three tokens of choice 0, then its last; choice 1's two up to "lazy" (later ones are dropped)
        assert len(lazy) == 3 and outs[-1].num_generated_tokens == 3 + 1 + 2

    asyncio.run(main())


def test_draft_checks_add_up_on_the_finished_output_even_when_a_stop_string_ends_it(bpe_tokenizer):
    async def main():
        proc = OutputProcessor()
        state = make_state(bpe_tokenizer, "a", stop=("lazy",))
        proc.add(state)
        ids = bpe_tokenizer.encode("the big lazy dog").ids
        # a decode step, then a check that kept 2 of 3 draft tokens and ran into the stop string
        proc.process([CoreOutput("a", tuple(ids[:1]), seq=1)])
        proc.process([CoreOutput("a", tuple(ids[1:]), seq=1, spec_check=(3, 2))])
        outs = drain(state)
        assert [o.spec_decode for o in outs[:-1]] == [None] * (len(outs) - 1)
        stats = outs[-1].spec_decode
        assert outs[-1].finished and stats is not None
        assert (stats.per_step_drafted, stats.per_step_accepted) == ((3,), (2,))
        assert stats.mean_acceptance_length == 3.0 and stats.draft_acceptance_rate == 2 / 3
        assert stats.acceptance_histogram(4) == [0, 0, 1, 0, 0]

    asyncio.run(main())
