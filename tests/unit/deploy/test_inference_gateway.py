"""deploy/k8s/inference-gateway: ortserve replicas as an InferencePool behind llm-d's endpoint picker.

The kustomization renders; the built-in objects pass the Kubernetes schemas (strict, offline); the InferencePool
and HTTPRoute pass their APIs' schemas (crd_schemas.py); and the objects point at each other: the pool selects
the server pods on their port, the pool's picker is the EPP Service, the route's backend is the pool, the EPP
reads the pool and the config file it mounts, and that config scrapes the servers' /metrics.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from crd_schemas import validate_custom
from deploy_tools import K8S, K8S_VERSIONS, by_kind, kustomize, server_container

GATEWAY = K8S / "inference-gateway"
CUSTOM_KINDS = {"InferencePool", "HTTPRoute"}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return kustomize(GATEWAY)


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _epp(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _named(docs, "Deployment", "ortserve-epp")


def _epp_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return yaml.safe_load(configmap["data"]["epp-config.yaml"])


def _args(container: dict[str, Any]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def test_renders_the_servers_the_pool_and_the_picker(docs: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Deployment", "Deployment", "Service", "Service", "PodDisruptionBudget",
                            "HorizontalPodAutoscaler", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                            "InferencePool", "HTTPRoute"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_pass_the_kubernetes_schema(docs: list[dict[str, Any]], version: str) -> None:
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_pool_and_route_pass_their_api_schemas(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            validate_custom(doc)


@pytest.mark.parametrize("break_it", [
    lambda pool: pool["spec"].__setitem__("targetPort", pool["spec"].pop("targetPorts")),  # misspelt field
    lambda pool: pool["spec"]["targetPorts"][0].__setitem__("number", 0),
    lambda pool: pool["spec"].__setitem__("appProtocol", "grpc"),
    lambda pool: pool["spec"]["selector"]["matchLabels"].__setitem__("app", "-bad-"),
])
def test_pool_schema_rejects_bad_pools(docs: list[dict[str, Any]], break_it) -> None:
    """The checks are strict, so the passing test above means something."""
    pool = copy.deepcopy(by_kind(docs, "InferencePool"))
    break_it(pool)
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(pool)


def test_pool_cel_rules_are_checked(docs: list[dict[str, Any]]) -> None:
    pool = copy.deepcopy(by_kind(docs, "InferencePool"))
    del pool["spec"]["endpointPickerRef"]["port"]
    with pytest.raises(AssertionError, match="port is required"):
        validate_custom(pool)
    pool = copy.deepcopy(by_kind(docs, "InferencePool"))
    pool["spec"]["targetPorts"].append({"number": 8000})
    with pytest.raises(AssertionError, match="unique"):
        validate_custom(pool)


def test_pool_selects_the_server_pods_on_their_port(docs: list[dict[str, Any]]) -> None:
    pool = by_kind(docs, "InferencePool")["spec"]
    server = _named(docs, "Deployment", "ortserve")
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["selector"]["matchLabels"].items())
    epp_labels = _epp(docs)["spec"]["template"]["metadata"]["labels"]
    assert not all(epp_labels.get(k) == v for k, v in pool["selector"]["matchLabels"].items())
    ports = {p["containerPort"] for p in server_container(server)["ports"]}
    assert {p["number"] for p in pool["targetPorts"]} <= ports
    # The picker scrapes each endpoint's /metrics on the same port: the path the pods announce.
    config = _epp_config(docs)
    source = {p["type"]: p for p in config["plugins"]}["metrics-data-source"]["parameters"]
    assert source["path"] == server["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]


def test_the_pools_picker_is_the_epp_service(docs: list[dict[str, Any]]) -> None:
    ref = by_kind(docs, "InferencePool")["spec"]["endpointPickerRef"]
    service = _named(docs, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = _epp(docs)
    assert all(epp["spec"]["template"]["metadata"]["labels"].get(k) == v
               for k, v in service["spec"]["selector"].items())
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    named_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named_ports[port["targetPort"]] == int(_args(container)["grpc-port"])
    assert port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC


def test_the_route_sends_everything_to_the_pool(docs: list[dict[str, Any]]) -> None:
    pool = by_kind(docs, "InferencePool")
    (rule,) = by_kind(docs, "HTTPRoute")["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]


def test_the_epp_reads_its_pool_and_its_mounted_config(docs: list[dict[str, Any]]) -> None:
    epp = _epp(docs)
    pod = epp["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _args(container)
    pool = by_kind(docs, "InferencePool")
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-group"] == pool["apiVersion"].split("/")[0]
    (mount,) = container["volumeMounts"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]  # kustomize's hashed name
    directory, _, filename = args["config-file"].rpartition("/")
    assert directory == mount["mountPath"] and filename in configmap["data"]
    # The probes ask the EPP's own health port.
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["grpc"]["port"] == int(args["grpc-health-port"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_epp_may_read_the_pool_and_its_pods(docs: list[dict[str, Any]]) -> None:
    pod = _epp(docs)["spec"]["template"]["spec"]
    binding = by_kind(docs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    role = _named(docs, "Role", binding["roleRef"]["name"])
    granted = {(group, resource) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] if {"get", "watch", "list"} <= set(rule["verbs"])}
    assert ("inference.networking.k8s.io", "inferencepools") in granted
    assert ("", "pods") in granted


def test_epp_config_scores_on_the_metrics_ortserve_exports(docs: list[dict[str, Any]]) -> None:
    config = _epp_config(docs)
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    declared = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert len(declared) == len(config["plugins"]), "two plugins share a name"
    (profile,) = config["schedulingProfiles"]
    refs = {r["pluginRef"]: r.get("weight", 1) for r in profile["plugins"]}
    assert set(refs) <= set(declared), "a profile names an undeclared plugin"
    assert all(isinstance(w, int) and w > 0 for w in refs.values())
    # The three scorers that read vllm:num_requests_waiting, vllm:kv_cache_usage_perc and the prefix index.
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"} <= set(refs)
    # The default ("vllm") engine mapping: the metric names ortserve serves (tests/integration/server/
    # test_api_gateway_metrics.py reads them from a live server).
    assert declared["core-metrics-extractor"]["parameters"]["defaultEngine"] == "vllm"


def test_the_epp_image_is_a_pinned_release(docs: list[dict[str, Any]]) -> None:
    (container,) = _epp(docs)["spec"]["template"]["spec"]["containers"]
    name, _, tag = container["image"].rpartition(":")
    assert name.endswith("llm-d-router-endpoint-picker") and tag.startswith("v"), container["image"]
