"""JSON Schemas of the two custom resources in deploy/k8s/inference-gateway, for offline validation.

kubernetes-validate ships only the built-in kinds' schemas, and no package registry ships these CRDs, so the
constraints of the published APIs are written out here: InferencePool `inference.networking.k8s.io/v1` (Gateway
API Inference Extension v1: every field, with its enums, patterns, bounds and the two CEL rules as checks
below) and the part of HTTPRoute `gateway.networking.k8s.io/v1` (Gateway API v1) that a route to a pool uses.
Both are strict like `kubectl apply --validate=strict`: an unknown field is an error. Bump them with the API
versions the manifests target.
"""

from __future__ import annotations

from typing import Any

import jsonschema

_DNS_GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"  # Gateway API Duration (GEP-2257)


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_PORT = _obj({"number": {"type": "integer", "minimum": 1, "maximum": 65535}}, ("number",))
_METADATA = {"type": "object", "required": ["name"]}  # ObjectMeta: the built-in schema's business

INFERENCE_POOL_V1 = _obj({
    "apiVersion": {"const": "inference.networking.k8s.io/v1"},
    "kind": {"const": "InferencePool"},
    "metadata": _METADATA,
    "spec": _obj({
        "selector": _obj({
            "matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                            "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE}},
        }, ("matchLabels",)),
        "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
        "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        "endpointPickerRef": _obj({
            "group": {"type": "string", "maxLength": 253, "pattern": _DNS_GROUP},
            "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
            "name": {"type": "string", "minLength": 1, "maxLength": 253},
            "port": _PORT,
            "failureMode": {"enum": ["FailOpen", "FailClose"]},
        }, ("name",)),
    }, ("selector", "targetPorts")),
}, ("apiVersion", "kind", "metadata", "spec"))

_PARENT_REF = _obj({
    "group": {"type": "string", "maxLength": 253, "pattern": _DNS_GROUP},
    "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
    "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
    "name": {"type": "string", "minLength": 1, "maxLength": 253},
    "sectionName": {"type": "string", "minLength": 1, "maxLength": 253},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
}, ("name",))
_BACKEND_REF = _obj({
    "group": {"type": "string", "maxLength": 253, "pattern": _DNS_GROUP},
    "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
    "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
    "name": {"type": "string", "minLength": 1, "maxLength": 253},
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
}, ("name",))
_MATCH = _obj({
    "path": _obj({"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                  "value": {"type": "string", "maxLength": 1024}}),
    "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]},
})

HTTP_ROUTE_V1 = _obj({
    "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
    "kind": {"const": "HTTPRoute"},
    "metadata": _METADATA,
    "spec": _obj({
        "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
        "hostnames": {"type": "array", "maxItems": 16, "items": {"type": "string", "maxLength": 253}},
        "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _obj({
            "name": {"type": "string", "minLength": 1, "maxLength": 253},
            "matches": {"type": "array", "maxItems": 64, "items": _MATCH},
            "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
            "timeouts": _obj({"request": {"type": "string", "pattern": _DURATION},
                              "backendRequest": {"type": "string", "pattern": _DURATION}}),
        })},
    }),
}, ("apiVersion", "kind", "metadata", "spec"))


def validate_custom(doc: dict[str, Any]) -> None:
    """Validate an InferencePool or HTTPRoute; raises jsonschema.ValidationError or AssertionError (CEL rules)."""
    kind = doc["kind"]
    schema = {"InferencePool": INFERENCE_POOL_V1, "HTTPRoute": HTTP_ROUTE_V1}[kind]
    jsonschema.validate(doc, schema)
    if kind == "InferencePool":
        spec = doc["spec"]
        ref = spec.get("endpointPickerRef")
        # CEL: port is required when kind is 'Service' or unspecified (it defaults to 'Service').
        assert ref is None or ref.get("kind", "Service") != "Service" or "port" in ref, \
            "endpointPickerRef.port is required when kind is 'Service'"
        numbers = [p["number"] for p in spec["targetPorts"]]
        assert len(set(numbers)) == len(numbers), "targetPorts: port number must be unique"
    elif kind == "HTTPRoute":
        for rule in doc["spec"].get("rules", []):
            for ref in rule.get("backendRefs", []):
                # CEL: a Service backend (kind Service in the core group, the default) needs a port.
                if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service":
                    assert "port" in ref, "backendRefs: port is required for a Service"
