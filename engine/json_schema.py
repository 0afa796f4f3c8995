"""JSON Schema rewrites for generation (pure Python: no grammar library, no onnxruntime).

A validator reads a schema that does not say ``additionalProperties`` as "any other key is fine"; a model
that is only *constrained* by it then invents keys (SmolLM2 writes ``{"city": "Paris", "parameters": {}}``).
Generation therefore treats an object schema that lists its ``properties`` and says nothing about other keys
as closed, as xgrammar's strict mode (vLLM's default) and llama.cpp's schema converter do. A schema that
states ``additionalProperties`` (true or a schema), ``patternProperties`` or ``unevaluatedProperties`` keeps
its own rule, and an ``allOf`` and its branches are left open (closing any of them would make the
intersection refuse the keys the others bring).
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema / a list of subschemas / a mapping of name -> subschema.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, *, _close: bool = True) -> Any:
    """A copy of ``schema`` in which object schemas with ``properties`` and no rule for other keys get
    ``additionalProperties: false``. Non-dict schemas (``true``, ``false``) come back unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = close_objects(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, _close=False) for s in out["allOf"]]
    closable = _close and "allOf" not in out  # an allOf's branches bring keys of their own
    if closable and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out
