"""engine.core_wire: step outputs and exceptions across the engine-process pipe, and the reader's framing."""

from __future__ import annotations

import multiprocessing
import threading

from engine.types import CoreOutput
from engine.core_wire import (
    AbortRequests, AddRequest, FrameReader, StepOutputs, decode_exception, decode_outputs, dumps, encode_exception,
    encode_outputs, loads,
)
from engine.types import (
    EngineError, EngineOverloadedError, FinishReason, InvalidRequestError, PromptTooLongError, SamplingParams,
    TokenLogprob,
)


def test_outputs_cross_as_they_were() -> None:
    outputs = [
        CoreOutput("a", (5,), seq=1, first_scheduled_s=12.5, spec_check=(4, 3)),
        CoreOutput("b", (6, 7), FinishReason.STOP, (TokenLogprob(6, -0.1, ((9, -2.0),)), TokenLogprob(7, -0.2)),
                   seq=2, index=1, num_cached_tokens=3, grammar_complete=True, spec_check=(2, 1)),
        CoreOutput("c", (), FinishReason.ERROR, error="boom", seq=3,
                   exception=EngineOverloadedError("full", retry_after_s=2.0)),
    ]
    back = decode_outputs(loads(dumps(StepOutputs(encode_outputs(outputs), None, None))).rows)
    assert [type(o) for o in back] == [CoreOutput] * 3
    assert back[:2] == outputs[:2] and back[1].finish_reason is FinishReason.STOP
    assert back[1].logprobs[0] == TokenLogprob(6, -0.1, ((9, -2.0),))
    exc = back[2].exception
    assert type(exc) is EngineOverloadedError and str(exc) == "full" and exc.retry_after_s == 2.0
    assert back[2][:9] == outputs[2][:9]


def test_exceptions_keep_class_message_and_attributes() -> None:
    for exc in (PromptTooLongError(100, 64), InvalidRequestError("bad", param="n", code="invalid_value")):
        back = decode_exception(loads(dumps(encode_exception(exc))))
        assert type(back) is type(exc) and str(back) == str(exc) and vars(back) == vars(exc)

    class Local(Exception):
        pass

    back = decode_exception(encode_exception(Local("here")))  # a class the other side could not import
    assert type(back) is EngineError and "Local: here" in str(back)


def test_the_frame_reader_splits_what_one_read_brings() -> None:
    ours, theirs = multiprocessing.Pipe()
    messages = [b"", b"x", b"y" * 70_000, b"z" * 3, b"w" * 300_000]
    writer = threading.Thread(target=lambda: ([theirs.send_bytes(m) for m in messages], theirs.close()))
    writer.start()
    reader, got = FrameReader(ours.fileno()), []
    try:
        while True:
            got += reader.read()
    except EOFError:
        pass
    writer.join()
    assert got == messages


def test_messages_are_named_records_that_survive_the_pipe() -> None:
    add = AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, n=3), seq=7, arrival_s=12.5)
    back = loads(dumps(add))
    assert type(back) is AddRequest and back == add and back.params.n == 3
    abort = loads(dumps(AbortRequests(["r1"], 2)))
    assert type(abort) is AbortRequests and abort.request_ids == ["r1"] and abort.index == 2


def test_a_request_is_built_with_its_choices_and_their_grammars() -> None:
    add = AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, n=3), seq=7, arrival_s=12.5)
    request = add.to_request(frozenset({0}), 64, ["g0", "g1", "g2"])
    choices = (request, *request.forks)
    assert [c.index for c in choices] == [0, 1, 2] and [c.constraint for c in choices] == ["g0", "g1", "g2"]
    assert all(c.seq == 7 and c.arrival_s == 12.5 and c.request_id == "r1" for c in choices)
    plain = AddRequest("r2", [5], SamplingParams(), seq=8, arrival_s=1.0).to_request(frozenset({0}), 64)
    assert plain.constraint is None and not plain.forks and plain.max_model_len == 64
