"""perf.structured: the grammars it times are valid (they compile in the engine's backend), and each compile
variant is new (a different cache key), so every cold request really compiles."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from perf.structured import TOOLS, _auto_grammar, _calls_schema, _variant
from engine.structured_output import StructuredOutputBackend
from server.openai.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(['{"name": "get_weather", "arguments": {"city": "Paris"}} <tool_call>'] * 50, trainer)
    return tok


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer):
    b = StructuredOutputBackend(tokenizer, tokenizer.get_vocab_size(), {0})
    yield b
    b.shutdown()


@pytest.mark.parametrize("kind", ["schema", "tools_required", "tools_auto"])
def test_each_variant_is_a_new_grammar_that_compiles(backend, kind):
    specs = []
    for k in range(2):
        body = {"messages": [{"role": "user", "content": "Go."}], **_variant(kind, k)}
        specs.append(ChatCompletionRequest.model_validate(body).to_sampling_params(1, 64).structured)
    assert specs[0] != specs[1]
    for spec in specs:
        assert backend.constraint_sync(spec).error is None


def test_a_tool_call_walks_the_auto_grammar(backend, tokenizer):
    from engine.types import StructuredOutput

    constraint = backend.constraint_sync(StructuredOutput("lark", _auto_grammar(TOOLS)))
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}, separators=(",", ":"))
    for text in ("Let me look. ", "<tool_call>", "\n", call, "\n</tool_call>"):
        for token in tokenizer.encode(text).ids:
            assert constraint.accept(token), (text, constraint.error)
    assert constraint.is_accepting
    assert _calls_schema(TOOLS)["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
