"""engine.json_keys.KeyTracker on byte strings: keys per open object through strings, escapes, nesting, arrays
of objects, text around JSON, and keys split across tokens in every possible way."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.json_keys import KeyTracker


def fed(text: str | bytes, json_only: bool = True, pieces: int = 1) -> KeyTracker:
    data = text.encode() if isinstance(text, str) else text
    keys = KeyTracker(json_only)
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        keys.feed(data[i:i + step])
    return keys


def test_keys_of_the_innermost_open_object():
    keys = fed('{"a":1,"b":"x","c":{"d":[1,2],"e":')
    assert keys.keys() == {"d", "e"} and keys.depth == 2
    keys.feed(b'null},"f":')
    assert keys.keys() == {"a", "b", "c", "f"} and keys.depth == 1


def test_a_token_that_closes_a_used_key_is_a_repeat_and_the_probe_changes_nothing():
    keys = fed('{"id":1,"name":"x","')
    assert keys.quotes_needed() == 1
    assert keys.closes_repeat(b'id":') and keys.closes_repeat(b'name"') and keys.closes_repeat(b'id"')
    assert not keys.closes_repeat(b'ids":') and not keys.closes_repeat(b'i') and not keys.closes_repeat(b'nam')
    assert keys.keys() == {"id", "name"} and keys.quotes_needed() == 1  # unchanged by the probes
    keys.feed(b'i')
    assert keys.closes_repeat(b'd"') and not keys.closes_repeat(b'dx"')


def test_key_split_across_tokens_in_every_way():
    text = b'{"ContentType":"a","ContentType'
    for cut in range(1, len(text)):
        keys = KeyTracker(True)
        keys.feed(text[:cut])
        keys.feed(text[cut:])
        assert keys.closes_repeat(b'"'), cut
        assert keys.closes_repeat(b'":"'), cut
        assert not keys.closes_repeat(b's"'), cut


def test_strings_that_look_like_json_are_values_not_keys():
    keys = fed(r'{"a":"{\"b\":1,\"a\":2}","c":"x\\","d":"}]"')
    assert keys.keys() == {"a", "c", "d"} and keys.depth == 1


def test_escaped_keys_are_compared_decoded():
    keys = fed(r'{"ab":1,"a\u0062')
    assert keys.closes_repeat(b'"')
    keys = fed(r'{"q\"x":1,"q\"')
    assert keys.closes_repeat(b'x"') and not keys.closes_repeat(b'y"')
    keys = fed('{"q\\\\":1,"q\\\\')  # the key q\ (an escaped backslash): its quote closes it
    assert keys.closes_repeat(b'"')
    keys = fed('{"q\\"":1,"q\\')  # inside an escape: this quote is the key's text, not its end
    assert not keys.closes_repeat(b'"') and keys.closes_repeat(b'"":')


def test_unicode_keys_split_inside_a_character():
    data = '{"naïve":1,"naïve'.encode()
    cut = data.rindex("ï".encode()) + 1  # between the two bytes of ï
    keys = KeyTracker(True)
    keys.feed(data[:cut])
    keys.feed(data[cut:])
    assert keys.closes_repeat(b'"')


def test_each_object_has_its_own_keys():
    keys = fed('[{"a":1},{"')
    assert keys.keys() == set() and keys.quotes_needed() == 0 and not keys.closes_repeat(b'a"')
    keys = fed('{"a":{"a":{"a":1},"')
    assert keys.keys() == {"a"} and keys.closes_repeat(b'a"') and not keys.closes_repeat(b'b"')
    keys.feed(b'b":2},"')
    assert keys.keys() == {"a"} and keys.closes_repeat(b'a"')


def test_arrays_of_objects_inside_an_object():
    keys = fed('{"rows":[{"x":1,"y":2},{"x":3,"')
    assert keys.keys() == {"x"} and keys.closes_repeat(b'x":') and not keys.closes_repeat(b'rows":')
    keys.feed(b'y":4}],"')
    assert keys.keys() == {"rows"} and keys.closes_repeat(b'rows":') and not keys.closes_repeat(b'x":')


def test_a_token_that_opens_and_closes_a_key_is_checked_from_outside_the_key():
    keys = fed('{"id":1')
    assert keys.quotes_needed() == 2
    assert keys.closes_repeat(b',"id":') and not keys.closes_repeat(b',"ids":') and not keys.closes_repeat(b',"')
    keys = fed('{"id":"x')
    assert keys.quotes_needed() == 3 and keys.closes_repeat(b'","id"') and not keys.closes_repeat(b'","')
    keys = fed('{"id":{"a":true}')
    assert keys.closes_repeat(b',"id"')
    keys = fed('{"id":2.5e')
    assert keys.closes_repeat(b'3,"id"') and not keys.closes_repeat(b'3,"i')
    keys = fed('{"')
    assert keys.closes_repeat(b'x":1,"x"')  # a repeat inside one token


def test_numbers_and_literals_end_at_the_next_structural_byte():
    keys = fed('{"a":-12.5e+3,"b":true,"c":null,"d":false,"e":[1,2.0,true],"')
    assert keys.keys() == {"a", "b", "c", "d", "e"}


def test_whitespace_between_tokens_and_in_keys():
    keys = fed('{ "a b" : 1 ,\n "c" :[ 1 , { "d" : 2 } ] , "')
    assert keys.keys() == {"a b", "c"} and keys.closes_repeat(b'a b"') and not keys.closes_repeat(b'a"')


def test_json_in_text_starts_at_a_brace_and_ends_with_its_object():
    keys = fed('Calling {tool} now. <tool_call>\n{"name": "f", "arguments": {"x": 1, "', json_only=False)
    assert keys.keys() == {"x"} and keys.closes_repeat(b'x": ')
    keys.feed(b'y": 2}}\n</tool_call> and {"')
    assert keys.depth == 1 and keys.keys() == set()
    keys.restart_text()
    assert keys.depth == 0 and keys.quotes_needed() == 0


def test_text_that_is_not_json_puts_the_scanner_back_to_text():
    keys = fed('{x} {"a":1,"a" oops', json_only=False)
    assert keys.depth == 0
    keys.feed(b'{"a":1,"')
    assert keys.closes_repeat(b'a"')


def test_top_level_values_other_than_objects():
    for text in ('"{\\"a\\":1,"', '12', '[1,"x",[]]', 'true'):
        keys = fed(text)
        assert keys.depth == 0 and keys.quotes_needed() == 0, text
    keys = fed('[{"k":1},{"k":2,"')
    assert keys.closes_repeat(b'k"')


def test_reset_forgets_everything():
    keys = fed('{"a":1,"')
    keys.reset()
    assert keys.depth == 0 and not keys.closes_repeat(b'a"')


# Random JSON documents, fed in random pieces: the tracker's key sets equal the document's own objects'.
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(doc=st.dictionaries(st.text(max_size=4), _json, min_size=1, max_size=5), ascii_only=st.booleans(),
       seps=st.sampled_from([(",", ":"), (", ", ": ")]), cuts=st.lists(st.integers(0, 400), max_size=30))
def test_any_document_in_any_pieces(doc, ascii_only, seps, cuts):
    data = json.dumps(doc, ensure_ascii=ascii_only, separators=seps).encode()
    body = data[:-1]  # the top object still open: its keys are all written
    keys = KeyTracker(True)
    start = 0
    for cut in sorted(c for c in cuts if c < len(body)) + [len(body)]:
        keys.feed(body[start:cut])
        start = max(start, cut)
    assert keys.depth == 1 and keys.keys() == set(doc)
    keys.feed(b"}")
    assert keys.depth == 0


@pytest.mark.parametrize("json_only", [True, False])
def test_probe_equals_feeding_a_copy(json_only):
    prefix = b'{"a":{"b":1},"c":[{"d":"e"}],"'
    for token in (b'a"', b'c":', b'x"', b'a', b'"', b'},"a"', b'b":1},"b":'):
        keys = KeyTracker(json_only)
        keys.feed(prefix)
        probe = keys.closes_repeat(token)
        closed = [name for name in ("a", "c") if token.startswith(name.encode() + b'"')]
        assert probe == bool(closed), token


@pytest.mark.parametrize("prefix", [b'{"ab":1,"a', b'{"ab":1,"', b'{"a\\"b":1,"a\\', b'{"ab":1,"a\\u00', b'{"ab":1', b'{"ab":"x'])
def test_repeats_equals_a_probe_per_token(prefix):
    tokens = [b'"', b'b"', b'b":', b'b":"', b'c"', b'":1,"ab"', b'b":1,"ab":', b'\\"', b'"b"', b'62"', b'b', b'",',
              b',"ab"', b'","ab":', b'"b":1,"ab"', b'\\u0062"']
    keys = fed(prefix)
    assert keys.repeats(tokens) == [i for i, t in enumerate(tokens) if keys.closes_repeat(t)]
    assert keys.repeats(tokens) or prefix in (b'{"ab":1,"a\\u00',)
