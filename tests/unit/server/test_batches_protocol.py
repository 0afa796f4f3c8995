"""server.batches.protocol's usage totals: a batch's ``usage`` sums its 2xx lines' usage in OpenAI's Batch shape,
whichever of the four endpoints answered; error lines add nothing."""

from __future__ import annotations

from typing import Any

from server.batches.protocol import add_usage, answered_model, error_line, no_usage, result_line
from server.openai.protocol import usage as chat_usage
from server.responses.protocol import response_usage


def _answer(usage: dict[str, Any], status: int = 200, model: str = "smol") -> dict[str, Any]:
    return result_line("c", status, {"object": "x", "model": model, "usage": usage}, "req")


def _total(*results: dict[str, Any]) -> dict[str, Any]:
    usage = no_usage()
    for result in results:
        usage = add_usage(usage, result)
    return usage


def batch_usage(num_input: int, num_cached: int, num_output: int, num_reasoning: int = 0) -> dict[str, Any]:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached},
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": num_reasoning},
            "total_tokens": num_input + num_output}


def test_nothing_answered_is_zero_in_openais_shape() -> None:
    assert no_usage() == batch_usage(0, 0, 0)
    assert add_usage(None, _answer(chat_usage(3, 2))) == batch_usage(3, 0, 2)


def test_chat_and_completions_lines_sum_prompt_completion_cached_and_reasoning() -> None:
    with_reasoning = {**chat_usage(10, 6, 4), "completion_tokens_details": {"reasoning_tokens": 5}}
    assert _total(_answer(chat_usage(7, 3, 2)), _answer(with_reasoning)) == batch_usage(17, 6, 9, 5)


def test_responses_lines_sum_input_and_output_tokens_with_their_details() -> None:
    reasoned = {**response_usage(4, 8, 1), "output_tokens_details": {"reasoning_tokens": 6}}
    assert _total(_answer(response_usage(5, 2, 3)), _answer(reasoned)) == batch_usage(9, 4, 10, 6)


def test_embeddings_lines_have_input_only() -> None:
    embeddings = {"prompt_tokens": 11, "total_tokens": 11}
    assert _total(_answer(embeddings), _answer(embeddings)) == batch_usage(22, 0, 0)


def test_refused_and_unsent_lines_add_nothing() -> None:
    refused = result_line("c", 404, {"error": {"code": "model_not_found"}}, "req")
    odd = [refused, error_line("c", "invalid_url", "no"), error_line(None, "invalid_json_line", "no"),
           _answer(chat_usage(5, 5), status=500), result_line("c", 200, "not JSON", "req"),
           result_line("c", 200, {"usage": None}, "req"),
           _answer({"prompt_tokens": None, "prompt_tokens_details": None, "completion_tokens": True})]
    assert _total(_answer(chat_usage(1, 2)), *odd) == batch_usage(1, 0, 2)


def test_the_answering_model_is_the_bodys() -> None:
    assert answered_model(_answer(chat_usage(1, 1), model="smol-v2")) == "smol-v2"
    assert answered_model(error_line("c", "invalid_url", "no")) is None
    assert answered_model(result_line("c", 200, "text", "req")) is None
