"""engine.structured_output on a real byte-level BPE tokenizer (trained in-process): compiling every kind,
refusing what cannot be enforced, masks, accept / rollback / done, the compile cache and its time limit."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import pytest

from engine.structured_output import StructuredOutputBackend, bitmask_words, check_schema
from engine.types import InvalidRequestError, StructuredOutput

EOS = 0  # <|endoftext|> in the fixture tokenizer
IM_END = 2


@pytest.fixture(scope="module")
def backend(bpe_tokenizer):
    b = StructuredOutputBackend(bpe_tokenizer, bpe_tokenizer.get_vocab_size(), {EOS, IM_END})
    yield b
    b.shutdown()


def allowed_ids(backend, constraint) -> np.ndarray:
    bitmask = backend.allocate_bitmask(1)
    constraint.fill(bitmask, 0)
    return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:backend.vocab_size])


def walk(backend, constraint, tokenizer, text: str) -> None:
    """Feed ``text``'s tokens, checking each one is in the mask before it is accepted."""
    for token in tokenizer.encode(text).ids:
        assert token in allowed_ids(backend, constraint), (text, tokenizer.decode([token]))
        assert constraint.accept(token), constraint.error


@pytest.mark.parametrize("kind, spec, text", [
    ("json_object", "", '{"a":[1,true,null]}'),
    ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                "additionalProperties": False}), '{"n":42}'),
    ("regex", r"[0-9]{3}-[a-z]{2}", "123-ab"),
    ("choice", json.dumps(["yes", "no", 'say "hi"']), 'say "hi"'),
    ("lark", 'start: "x" NUM\nNUM: /[0-9]+/', "x17"),
    ("gbnf", 'root ::= "ab" [0-9]+', "ab99"),
])
def test_each_kind_accepts_a_matching_text(backend, bpe_tokenizer, kind, spec, text):
    constraint = backend.constraint_sync(StructuredOutput(kind, spec))
    walk(backend, constraint, bpe_tokenizer, text)
    assert constraint.is_accepting and constraint.error is None
    # complete: the end-of-sequence tokens are allowed now, and each is accepted
    assert {EOS, IM_END} <= set(allowed_ids(backend, constraint).tolist())


def test_json_is_compact_and_eos_is_forbidden_until_complete(backend, bpe_tokenizer):
    constraint = backend.constraint_sync(StructuredOutput("json_object"))
    walk(backend, constraint, bpe_tokenizer, '{"a":1')
    allowed = set(allowed_ids(backend, constraint).tolist())
    assert EOS not in allowed and IM_END not in allowed
    texts = {bpe_tokenizer.decode([t]) for t in allowed}
    assert not any(t.startswith((" ", "\n")) for t in texts)  # no whitespace between tokens
    walk(backend, constraint, bpe_tokenizer, "}")
    assert constraint.is_done  # an object is complete after its brace: nothing more may follow
    assert constraint.accept(IM_END) and constraint.error is None


def test_a_rejected_token_puts_the_constraint_in_error(backend, bpe_tokenizer):
    constraint = backend.constraint_sync(StructuredOutput("regex", "[0-9]+"))
    letter = bpe_tokenizer.encode("x").ids[0]
    assert letter not in allowed_ids(backend, constraint)
    assert not constraint.accept(letter)
    assert constraint.error and not constraint.is_done


def test_rollback_returns_to_an_earlier_state(backend, bpe_tokenizer):
    constraint = backend.constraint_sync(StructuredOutput("choice", json.dumps(["alpha", "beta"])))
    start = allowed_ids(backend, constraint).tolist()
    walk(backend, constraint, bpe_tokenizer, "alpha")
    assert constraint.is_done
    constraint.rollback(constraint.num_accepted)
    assert allowed_ids(backend, constraint).tolist() == start and not constraint.is_done
    with pytest.raises(ValueError):
        constraint.rollback(1)


def test_a_checkpoint_takes_back_draft_tokens_keys_included(backend, bpe_tokenizer):
    """Speculative decoding's rollback: tokens tried after a checkpoint are undone, the repeated-key rule's state with
    them: afterwards every mask is the one of a constraint that never saw them."""
    def mask_after(constraint) -> np.ndarray:
        row = backend.allocate_bitmask(1)
        constraint.fill(row, 0)
        return row[0]

    tried = backend.constraint_sync(StructuredOutput("json_object"))
    fresh = backend.constraint_sync(StructuredOutput("json_object"))
    for c in (tried, fresh):
        walk(backend, c, bpe_tokenizer, '{"ab":1,"x":{"c":2},')
    saved = tried.checkpoint()
    walk(backend, tried, bpe_tokenizer, '"cd":3,"e":[4]}')
    assert tried.is_done
    tried.restore(saved)
    assert tried.num_accepted == fresh.num_accepted and not tried.is_done
    for text in ('"cd', '":5,"ab'):  # a key of the undone tokens is free again; one written before is not
        walk(backend, tried, bpe_tokenizer, text)
        walk(backend, fresh, bpe_tokenizer, text)
        np.testing.assert_array_equal(mask_after(tried), mask_after(fresh), err_msg=text)
    assert '"' not in quote_tokens(bpe_tokenizer, allowed_ids(backend, tried))  # "ab" would repeat
    with pytest.raises(ValueError):
        tried.restore((tried.num_accepted + 1, None))


def test_batched_fill_equals_single_fills(backend, bpe_tokenizer):
    specs = [StructuredOutput("json_object"), StructuredOutput("regex", "[a-c]+"), StructuredOutput("choice", '["q"]')]
    constraints = [backend.constraint_sync(s) for s in specs]
    walk(backend, constraints[0], bpe_tokenizer, '{"k":')
    for parallel_min_rows in (1, 1 << 30):  # llguidance's parallel executor, then row by row
        backend.parallel_min_rows = parallel_min_rows
        batched = backend.allocate_bitmask(5)
        backend.fill([(c, row) for c, row in zip(constraints, (4, 0, 2))], batched)
        for c, row in zip(constraints, (4, 0, 2)):
            single = backend.allocate_bitmask(1)
            c.fill(single, 0)
            np.testing.assert_array_equal(batched[row], single[0])
        assert (batched[[1, 3]] == -1).all()  # rows not named are left alone
        assert batched.shape == (5, bitmask_words(backend.vocab_size))


@pytest.mark.parametrize("schema, feature", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "contains": {"type": "string"}}, "contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "credit-card"}, "credit-card"),
])
def test_a_schema_feature_that_cannot_be_enforced_is_refused_by_name(backend, schema, feature):
    with pytest.raises(InvalidRequestError) as err:
        backend.constraint_sync(StructuredOutput("json_schema", json.dumps(schema), param="guided_json"))
    assert feature in str(err.value) and err.value.param == "guided_json"
    assert err.value.code == "invalid_structured_output"


@pytest.mark.parametrize("kind, spec, needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("json_schema", json.dumps({"type": "strin"}), "strin"),
    ("json_schema", json.dumps({"$ref": "#/$defs/missing"}), "missing"),
    ("json_schema", json.dumps({"type": "object", "required": "a"}), "required"),
    ("json_schema", json.dumps({"anyOf": []}), "anyOf"),
    ("regex", "[a-", "unclosed"),
    ("choice", "[]", "non-empty"),
    ("choice", '["a", 1]', "strings"),
    ("lark", "start: undefined_rule", "undefined_rule"),
    ("gbnf", "root ::= missing", "missing"),
])
def test_specs_that_do_not_compile_are_invalid_requests(backend, kind, spec, needle):
    with pytest.raises(InvalidRequestError) as err:
        backend.constraint_sync(StructuredOutput(kind, spec, param="structured_outputs"))
    assert needle in str(err.value) and err.value.param == "structured_outputs"


def test_supported_schema_features_compile_and_walk(backend, bpe_tokenizer):
    schema = {
        "$defs": {"tag": {"type": "string", "enum": ["a", "b"]}},
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 2},
            "kind": {"const": "x"},
            "note": {"type": ["string", "null"]},
            "either": {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[0-9]{2}$"}]},
        },
        "required": ["id", "tags", "kind", "note", "either"],
        "additionalProperties": False,
    }
    text = '{"id":3,"tags":["a","b"],"kind":"x","note":null,"either":"42"}'
    jsonschema.validate(json.loads(text), schema)
    constraint = backend.constraint_sync(StructuredOutput("json_schema", json.dumps(schema)))
    walk(backend, constraint, bpe_tokenizer, text)
    assert constraint.is_done


def test_compiled_grammars_are_cached_and_evicted_least_recently_used(bpe_tokenizer):
    backend = StructuredOutputBackend(bpe_tokenizer, bpe_tokenizer.get_vocab_size(), {EOS}, cache_size=2)
    try:
        a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
        first = backend.compile_future(a)
        assert backend.compile_future(StructuredOutput("regex", "a+", param="other")) is first  # param not in key
        backend.compile_future(b)
        backend.compile_future(a)  # a is now the most recently used
        backend.compile_future(c)  # evicts b
        assert backend.compile_future(a) is first
        # each request gets its own matcher from the cached template
        one, two = backend.constraint_sync(a), backend.constraint_sync(a)
        assert one.accept(bpe_tokenizer.encode("a").ids[0])
        assert one.num_accepted == 1 and two.num_accepted == 0
    finally:
        backend.shutdown()


def test_a_grammar_over_the_time_limit_is_refused_and_not_cached(bpe_tokenizer):
    # NOTE(tests): 400 properties with patterns take milliseconds to compile on any machine, so a 1 us limit
    # is exceeded by construction; the tokenizer (built first) is not counted against it.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
                                               for i in range(400)}, "required": [f"p{i}" for i in range(400)]}
    spec = StructuredOutput("json_schema", json.dumps(schema), param="response_format")
    backend = StructuredOutputBackend(bpe_tokenizer, bpe_tokenizer.get_vocab_size(), {EOS}, compile_timeout_s=1e-6)
    try:
        backend.start().result()
        with pytest.raises(InvalidRequestError) as err:
            asyncio.run(backend.constraint_for(spec))
        assert err.value.code == "grammar_compile_timeout" and err.value.param == "response_format"
        assert "time limit" in str(err.value)
        backend.compile_timeout_s = 60.0
        assert asyncio.run(backend.constraint_for(spec)).error is None  # compiled afresh, within the limit
    finally:
        backend.shutdown()


def test_an_object_that_says_nothing_of_other_keys_is_generated_closed(backend, bpe_tokenizer):
    # NOTE(tests): SmolLM2 constrained by {"properties": {"city": ...}} wrote {"city": "Paris", "parameters": {}}.
    spec = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    closed = backend.constraint_sync(StructuredOutput("json_schema", spec))
    walk(backend, closed, bpe_tokenizer, '{"city":"Paris"')
    assert bpe_tokenizer.token_to_id(",") not in allowed_ids(backend, closed)  # no second key
    walk(backend, closed, bpe_tokenizer, "}")
    assert closed.is_accepting
    open_spec = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "additionalProperties": True})
    opened = backend.constraint_sync(StructuredOutput("json_schema", open_spec))
    walk(backend, opened, bpe_tokenizer, '{"city":"Paris","parameters":{}}')
    assert opened.is_accepting


def test_a_required_key_missing_from_properties_is_a_free_property(backend, bpe_tokenizer):
    """JSONSchemaBench's commonest refusal: an object requires a key its ``properties`` do not define. The
    schema as written allows any value there, so the closed object gets it as a free property and compiles;
    the other keys stay closed."""
    spec = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name", "id"]})
    constraint = backend.constraint_sync(StructuredOutput("json_schema", spec))
    walk(backend, constraint, bpe_tokenizer, '{"name":"a","id":[1,{"x":null}]}')
    assert constraint.is_accepting
    other = backend.constraint_sync(StructuredOutput("json_schema", spec))
    walk(backend, other, bpe_tokenizer, '{"name":"a","id":1')
    assert bpe_tokenizer.token_to_id(",") not in allowed_ids(backend, other)  # still no invented third key


DISCRIMINATED = {
    "$defs": {
        "circle": {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                   "required": ["kind", "r"]},
        "square": {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
                   "required": ["kind", "side"]},
    },
    "oneOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/square"}],
}


@pytest.mark.parametrize("text", ['{"kind":"circle","r":1.5}', '{"kind":"square","side":3}'])
def test_a_discriminated_one_of_is_enforced(backend, bpe_tokenizer, text):
    """Branches that a ``const`` discriminator makes exclusive (here behind ``$ref``s, as generators write
    them) compile; each branch's documents are accepted, and the discriminator decides the rest."""
    jsonschema.validate(json.loads(text), DISCRIMINATED)
    constraint = backend.constraint_sync(StructuredOutput("json_schema", json.dumps(DISCRIMINATED)))
    walk(backend, constraint, bpe_tokenizer, text)
    assert constraint.is_done
    # a circle with a square's key is no document of either branch: some token of it is refused
    mixed = backend.constraint_sync(StructuredOutput("json_schema", json.dumps(DISCRIMINATED)))
    refused = False
    for token in bpe_tokenizer.encode('{"kind":"circle","side":3}').ids:
        if token not in allowed_ids(backend, mixed) or not mixed.accept(token):
            refused = True
            break
    assert refused


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # 1 matches both
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
               {"type": "object", "properties": {"b": {"type": "string"}}}]},  # {} matches both
    {"type": "object", "properties": {"t": {"type": "string"}},
     "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},  # {"a": 1, "b": 2} matches both
])
def test_a_one_of_whose_branches_may_overlap_is_refused_by_name(backend, schema):
    with pytest.raises(InvalidRequestError) as err:
        backend.constraint_sync(StructuredOutput("json_schema", json.dumps(schema), param="response_format"))
    assert "oneOf" in str(err.value) and err.value.param == "response_format"
    assert err.value.code == "invalid_structured_output"


def quote_tokens(tokenizer, allowed) -> set[str]:
    return {t for t in (tokenizer.decode([i]) for i in allowed) if '"' in t}


OPEN_OBJECTS = [
    ("json_object", ""),
    ("json_schema", json.dumps({"type": "object"})),
    ("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"}},
                                "additionalProperties": True})),
    ("json_schema", json.dumps({"type": "array", "items": {"type": "object", "additionalProperties": {"type": "integer"}}})),
    ("lark", 'start: "call " %json {"type": "object"}'),
]


@pytest.mark.parametrize("kind, spec", OPEN_OBJECTS)
def test_an_open_object_never_repeats_a_key(backend, bpe_tokenizer, kind, spec):
    """The grammar alone accepts {"ab":1,"ab":2} in an open object; the key tracker clears the closing quote."""
    prefix = {"lark": "call ", "json_schema": ""}.get(kind, "")
    opening = "[" if '"array"' in spec else ""
    unconstrained = backend.constraint_sync(StructuredOutput(kind, spec))
    unconstrained._keys = None  # the grammar alone
    walk(backend, unconstrained, bpe_tokenizer, prefix + opening + '{"ab":1,"ab')
    assert '"' in quote_tokens(bpe_tokenizer, allowed_ids(backend, unconstrained))
    constraint = backend.constraint_sync(StructuredOutput(kind, spec))
    walk(backend, constraint, bpe_tokenizer, prefix + opening + '{"ab":1,"ab')
    allowed = allowed_ids(backend, constraint)
    assert '"' not in quote_tokens(bpe_tokenizer, allowed)
    assert bpe_tokenizer.token_to_id("c") in allowed  # the key may still grow into a new one
    walk(backend, constraint, bpe_tokenizer, 'c":2,"a')
    assert '"' in quote_tokens(bpe_tokenizer, allowed_ids(backend, constraint))  # "a" is new


def test_every_key_of_a_document_stays_new_and_nested_objects_keep_their_own(backend, bpe_tokenizer):
    constraint = backend.constraint_sync(StructuredOutput("json_object"))
    walk(backend, constraint, bpe_tokenizer, '{"a":{"a":[{"a":1},{"a":2,"b":3}],"b":4},"b":5,"c":{},"')
    for key in ("a", "b", "c"):
        probe = backend.constraint_sync(StructuredOutput("json_object"))
        walk(backend, probe, bpe_tokenizer, '{"a":{"a":[{"a":1},{"a":2,"b":3}],"b":4},"b":5,"c":{},"' + key)
        assert '"' not in quote_tokens(bpe_tokenizer, allowed_ids(backend, probe)), key


def test_rollback_replays_the_keys(backend, bpe_tokenizer):
    constraint = backend.constraint_sync(StructuredOutput("json_object"))
    walk(backend, constraint, bpe_tokenizer, '{"ab":1,"ab')
    assert '"' not in quote_tokens(bpe_tokenizer, allowed_ids(backend, constraint))
    constraint.rollback(len(bpe_tokenizer.encode(',"ab').ids) + len(bpe_tokenizer.encode('1').ids))
    walk(backend, constraint, bpe_tokenizer, '2}')
    assert constraint.is_done
    other = backend.constraint_sync(StructuredOutput("json_object"))
    walk(backend, other, bpe_tokenizer, '{"ab":1,"ab')
    other.rollback(other.num_accepted)
    walk(backend, other, bpe_tokenizer, '{"ab":1}')  # the first "ab" is forgotten with its tokens
    assert other.is_done


def test_when_only_a_used_key_is_allowed_the_grammar_mask_stands(backend, bpe_tokenizer):
    """A schema whose only key pattern is used up: an empty mask would be worse than the repeat."""
    spec = json.dumps({"type": "object", "patternProperties": {"^ab$": {"type": "integer"}},
                       "additionalProperties": False})
    constraint = backend.constraint_sync(StructuredOutput("json_schema", spec))
    walk(backend, constraint, bpe_tokenizer, '{"ab":1,"ab')
    assert allowed_ids(backend, constraint).size > 0


def test_the_parallel_fill_masks_repeats_too(backend, bpe_tokenizer):
    constraints = [backend.constraint_sync(StructuredOutput("json_object")) for _ in range(2)]
    for c in constraints:
        walk(backend, c, bpe_tokenizer, '{"ab":1,"ab')
    try:
        backend.parallel_min_rows = 1
        batched = backend.allocate_bitmask(2)
        backend.fill([(c, row) for row, c in enumerate(constraints)], batched)
    finally:
        backend.parallel_min_rows = 1 << 30
    single = backend.allocate_bitmask(1)
    constraints[0].fill(single, 0)
    np.testing.assert_array_equal(batched[0], single[0])
    np.testing.assert_array_equal(batched[1], single[0])
    assert bpe_tokenizer.token_to_id('"') is not None
    assert not (batched[0][bpe_tokenizer.token_to_id('"') >> 5] >> (bpe_tokenizer.token_to_id('"') & 31)) & 1


@pytest.mark.parametrize("schema, relaxed", [
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, ("propertyNames",)),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, ("if", "then")),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ("oneOf",)),
    ({"type": "string", "format": "credit-card"}, ("format: credit-card",)),
    ({"type": "object", "properties": {"a": {"type": "string"}}}, ()),
])
def test_check_schema_names_what_a_lenient_grammar_leaves_out(schema, relaxed):
    check = check_schema(schema)
    assert check.relaxed == relaxed and check.error is None and check.exact == (not relaxed)


def test_check_schema_says_why_no_grammar_can_be_built():
    check = check_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}})
    assert check.error is not None and "nowhere" in check.error and not check.exact
    assert check_schema(False).error is not None and check_schema(True).exact
