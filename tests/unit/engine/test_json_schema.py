"""engine.json_schema.close_objects: what generation treats as a closed object, and what it leaves alone."""

from __future__ import annotations

import copy

import jsonschema
import pytest

from engine.json_schema import close_objects

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_an_object_with_properties_is_closed_and_the_input_is_unchanged() -> None:
    before = copy.deepcopy(CITY)
    closed = close_objects(CITY)
    assert CITY == before
    assert closed["additionalProperties"] is False
    jsonschema.validate({"city": "Paris"}, closed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "Paris", "parameters": {}}, closed)


@pytest.mark.parametrize("rule", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                  {"patternProperties": {"^x-": {}}}, {"unevaluatedProperties": False}])
def test_a_stated_rule_for_other_keys_is_kept(rule: dict) -> None:
    schema = {**CITY, **rule}
    assert close_objects(schema) == schema


def test_nested_objects_are_closed_everywhere_a_subschema_can_stand() -> None:
    schema = {
        "type": "object",
        "properties": {"home": CITY, "trips": {"type": "array", "items": CITY, "prefixItems": [CITY]}},
        "$defs": {"c": CITY},
        "anyOf": [CITY, {"type": "null"}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    for sub in (closed["properties"]["home"], closed["properties"]["trips"]["items"],
                closed["properties"]["trips"]["prefixItems"][0], closed["$defs"]["c"], closed["anyOf"][0]):
        assert sub["additionalProperties"] is False


def test_all_of_and_its_branches_stay_open_so_their_keys_still_meet() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "allOf": [{"properties": {"b": {"type": "integer"}}}, {"properties": {"c": {"type": "integer"}}}]}
    closed = close_objects(schema)
    jsonschema.validate({"a": 1, "b": 2, "c": 3}, closed)
    assert "additionalProperties" not in closed
    assert all("additionalProperties" not in branch for branch in closed["allOf"])


@pytest.mark.parametrize("schema", [True, False, {"type": "object"}, {"type": "string"}])
def test_schemas_without_properties_are_unchanged(schema) -> None:
    assert close_objects(schema) == schema


def test_required_keys_outside_properties_become_free_and_ref_branches_are_inlined() -> None:
    closed = close_objects({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"],
                            "oneOf": [{"required": ["c"]}, {"properties": {"d": {}}, "required": ["d"]}]})
    assert closed["properties"] == {"a": {"type": "string"}, "b": {}, "c": {}}  # d's branch brings its own
    jsonschema.validate({"a": "x", "b": [1], "c": None}, closed)
    defs = {"A": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
            "B": {"type": "object", "properties": {"y": {"type": "number"}}, "required": ["y"]}}
    both = close_objects({"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], "$defs": defs})
    jsonschema.validate({"x": "s", "y": 1}, both)  # the allOf's inlined branches stay open
    assert both["$defs"]["A"]["additionalProperties"] is False  # the definition itself is closed
    either = close_objects({"oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], "$defs": defs})
    assert either["oneOf"][0]["properties"] == defs["A"]["properties"] and "$ref" not in either["oneOf"][0]
