"""server.embeddings.protocol: OpenAI's input forms (and llama.cpp's object entries), errors naming the item,
base64 as the openai SDK decodes it."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from engine.types import InvalidRequestError
from server.embeddings.protocol import (
    EmbeddingRequest, embedding_response, encode_vector, llamacpp_embedding_response, parse_inputs,
)


def test_input_forms() -> None:
    assert [(i.param, i.text) for i in parse_inputs("hi")] == [("input", "hi")]
    assert [(i.param, i.text) for i in parse_inputs(["a", ""])] == [("input[0]", "a"), ("input[1]", "")]
    assert [i.token_ids for i in parse_inputs([1, 2, 3])] == [(1, 2, 3)]  # one token list
    assert [i.token_ids for i in parse_inputs([[1, 2], [3]])] == [(1, 2), (3,)]
    mixed = parse_inputs(["a", [5, 6], {"prompt_string": "b"}, {"content": [{"type": "text", "text": "c"},
                                                                           {"type": "text", "text": "d"}]}])
    assert [(i.text, i.token_ids) for i in mixed] == [("a", None), (None, (5, 6)), ("b", None), ("cd", None)]


@pytest.mark.parametrize("value, param", [
    ([], "input"), (["a", 1], "input[1]"), (["a", None], "input[1]"), ([True, False], "input[0]"),
    ([[1, 2], [1.5]], "input[1]"), ([[1], []], "input[1]"), (3, "input"), (None, "input"),
    ({"content": "text"}, "input"), ({"content": [{"type": "input_audio"}]}, "input.content[0]"),
    (["x"] * 2049, "input"),
])
def test_bad_inputs_name_the_item(value, param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        parse_inputs(value)
    assert exc.value.param == param


def test_truncate_and_dimensions_bounds() -> None:
    assert EmbeddingRequest(input="x").truncate_to(256) is None
    assert EmbeddingRequest(input="x", truncate_prompt_tokens=-1).truncate_to(256) == 256
    assert EmbeddingRequest(input="x", truncate_prompt_tokens=8).truncate_to(256) == 8
    with pytest.raises(InvalidRequestError) as exc:
        EmbeddingRequest(input="x", truncate_prompt_tokens=257).truncate_to(256)
    assert exc.value.param == "truncate_prompt_tokens"


def test_base64_is_little_endian_float32() -> None:
    v = np.array([0.25, -1.5, 3.0e-8], np.float32)
    assert np.array_equal(np.frombuffer(base64.b64decode(encode_vector(v, "base64")), "<f4"), v)
    assert encode_vector(v, "float") == [float(x) for x in v]


def test_response_shapes() -> None:
    body = embedding_response([np.ones(3, np.float32), np.zeros(3, np.float32)], "m", 7)
    assert body["object"] == "list" and body["model"] == "m"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    assert llamacpp_embedding_response([np.ones(2, np.float32)]) == [{"index": 0, "embedding": [[1.0, 1.0]]}]
    per_token = llamacpp_embedding_response([np.ones((3, 2), np.float32)])
    assert len(per_token[0]["embedding"]) == 3
