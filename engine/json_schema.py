"""JSON Schema rewrites for generation (pure Python: no grammar library, no onnxruntime).

A validator reads a schema that does not say ``additionalProperties`` as "any other key is fine"; a model
that is only *constrained* by it then invents keys (SmolLM2 writes ``{"city": "Paris", "parameters": {}}``).
Generation therefore treats an object schema that lists its ``properties`` and says nothing about other keys
as closed, as xgrammar's strict mode (vLLM's default) and llama.cpp's schema converter do. A schema that
states ``additionalProperties`` (true or a schema), ``patternProperties`` or ``unevaluatedProperties`` keeps
its own rule, and an ``allOf`` and its branches are left open (closing any of them would make the
intersection refuse the keys the others bring).

Closing must not make a valid document impossible: a key that the object (or one of its ``anyOf``/``oneOf``
branches) lists in ``required`` but not in ``properties`` may take any value under the schema as written,
so it becomes a free property (``{}``) of the closed object. A ``oneOf`` branch that is only a local
``$ref`` is inlined (one level), so that the grammar library sees the ``const``/``enum``/type discriminator
that makes the branches exclusive (llguidance enforces a ``oneOf`` only when it can prove that); an
``allOf`` branch that is one is inlined as well, and stays open there (the definition itself is closed).
"""

from __future__ import annotations

from typing import Any

# NOTE(engine): llguidance's own lenient mode (x-guidance options), for the schemas a request did not ask to have
# enforced exactly (tool parameters, unless the tool is strict): a keyword it cannot enforce (propertyNames,
# if/then/else, not, ...) is left out of the grammar and the rest enforced, and a oneOf it cannot prove exclusive is
# enforced as an anyOf. engine.structured_output.check_schema says what a schema loses this way.
LENIENT_JSON_OPTIONS = {"lenient": True, "coerce_one_of": True}

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords whose value is one subschema / a list of subschemas / a mapping of name -> subschema.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, *, _close: bool = True, _root: Any = None) -> Any:
    """A copy of ``schema`` in which object schemas with ``properties`` and no rule for other keys get
    ``additionalProperties: false`` (required keys they do not list become free properties), and ``oneOf``
    branches that are local ``$ref``s are inlined. Non-dict schemas (``true``, ``false``) come back unchanged."""
    if not isinstance(schema, dict):
        return schema
    root = schema if _root is None else _root
    out = dict(schema)
    if isinstance(out.get("oneOf"), list):
        out["oneOf"] = [_inline_ref(branch, root) for branch in out["oneOf"]]
    for key in _ONE:
        if key in out:
            out[key] = close_objects(out[key], _root=root)
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s, _root=root) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s, _root=root) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):  # its $ref branches inlined too: they must stay open here
        out["allOf"] = [close_objects(_inline_ref(s, root), _close=False, _root=root) for s in out["allOf"]]
    closable = _close and "allOf" not in out  # an allOf's branches bring keys of their own
    if closable and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        missing = [k for k in _required_keys(out) if k not in out["properties"]]
        if missing:
            out["properties"] = {**out["properties"], **{k: {} for k in missing}}
        out["additionalProperties"] = False
    return out


def _required_keys(schema: dict[str, Any]) -> list[str]:
    """The keys ``schema`` requires, and those its ``anyOf``/``oneOf`` branches require (without properties
    of their own: such a branch names keys of this object), in order, each once."""
    keys: list[str] = []
    groups = [schema.get("required")]
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            if isinstance(branch, dict) and "properties" not in branch:
                groups.append(branch.get("required"))
    for group in groups:
        if isinstance(group, list):
            keys += [k for k in group if isinstance(k, str) and k not in keys]
    return keys


def _inline_ref(branch: Any, root: Any) -> Any:
    """A ``oneOf`` branch ``{"$ref": "#/..."}`` (a local JSON pointer, no other keys) as the schema it names;
    anything else, or a pointer that does not resolve, unchanged."""
    if not (isinstance(branch, dict) and set(branch) == {"$ref"} and isinstance(branch["$ref"], str)
            and branch["$ref"].startswith("#/")):
        return branch
    target = root
    for part in branch["$ref"][2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return branch
        target = target[part]
    return target if isinstance(target, dict) else branch
