"""deploy/k8s: the overlays render with kustomize, every object passes the Kubernetes schemas (strict,
offline, kubernetes-validate) and the objects agree with each other and with the server's contract."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy_tools import K8S, K8S_VERSIONS, OVERLAYS, by_kind, env_of, kustomize, server_container

ADAPTER = K8S / "prometheus-adapter"


def _validate(doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def _adapter_rules() -> list[dict[str, Any]]:
    """The adapter rules of both examples: the ConfigMap's embedded config.yaml and the Helm values."""
    configmap = yaml.safe_load((ADAPTER / "adapter-config.yaml").read_text())
    values = yaml.safe_load((ADAPTER / "values.yaml").read_text())
    return yaml.safe_load(configmap["data"]["config.yaml"])["rules"] + values["rules"]["custom"]


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
def test_renders_the_four_objects(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    kinds = sorted(doc["kind"] for doc in rendered[name])
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", [*OVERLAYS, "base"])
def test_objects_pass_the_kubernetes_schema(
    rendered: dict[str, list[dict[str, Any]]], name: str, version: str
) -> None:
    for doc in rendered[name]:
        _validate(doc, version)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_adapter_configmap_passes_the_schema(version: str) -> None:
    _validate(yaml.safe_load((ADAPTER / "adapter-config.yaml").read_text()), version)


def test_schema_check_rejects_an_unknown_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The validator is strict: a misspelt pod field is an error, so the passing tests mean something."""
    deployment = copy.deepcopy(by_kind(rendered["cpu"], "Deployment"))
    spec = deployment["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriodSecond"):
        _validate(deployment, K8S_VERSIONS[-1])


@pytest.mark.parametrize("name", OVERLAYS)
def test_selectors_pick_the_server_pods(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    docs = rendered[name]
    deployment = by_kind(docs, "Deployment")
    labels = _pod_labels(deployment)
    assert _selected(deployment["spec"]["selector"]["matchLabels"], labels)
    assert _selected(by_kind(docs, "Service")["spec"]["selector"], labels)
    assert _selected(by_kind(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    for constraint in deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", []):
        assert _selected(constraint["labelSelector"]["matchLabels"], labels)


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_and_service_reach_the_health_port(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    deployment = by_kind(rendered[name], "Deployment")
    container = server_container(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = env_of(container)
    assert ports == {"http": int(env["ORTSERVE_PORT"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http_get = container[probe]["httpGet"]
        assert http_get["path"] == "/health", probe
        assert http_get["port"] in ports, probe
    # The startup probe covers loading: failureThreshold x period is the time a load may take.
    startup = container["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
    service_port = by_kind(rendered[name], "Service")["spec"]["ports"][0]
    assert service_port["targetPort"] in ports
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("name", OVERLAYS)
def test_termination_grace_covers_prestop_and_drain(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    pod = by_kind(rendered[name], "Deployment")["spec"]["template"]["spec"]
    container = server_container(by_kind(rendered[name], "Deployment"))
    drain_s = float(env_of(container)["ORTSERVE_SHUTDOWN_GRACE_S"])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s


def test_gpu_overlay_gives_each_pod_exactly_one_gpu(rendered: dict[str, list[dict[str, Any]]]) -> None:
    pod = by_kind(rendered["amd-gpu"], "Deployment")["spec"]["template"]["spec"]
    server = server_container(by_kind(rendered["amd-gpu"], "Deployment"))
    assert server["resources"]["limits"]["amd.com/gpu"] == 1
    assert env_of(server)["ORTSERVE_DEVICE"] == "0"  # the one GPU the device plugin mounted
    assert env_of(server)["ORTSERVE_PROVIDER"] == "amdgpu"
    for init in pod["initContainers"]:
        assert "amd.com/gpu" not in init.get("resources", {}).get("limits", {}), init["name"]
    # A surge pod would wait for a free GPU: GPU rollouts replace pods in place.
    rolling = by_kind(rendered["amd-gpu"], "Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxSurge"] == 0 and rolling["maxUnavailable"] == 1
    assert 44 in pod["securityContext"]["supplementalGroups"]  # video: /dev/kfd


def test_cpu_overlay_asks_for_no_gpu(rendered: dict[str, list[dict[str, Any]]]) -> None:
    server = server_container(by_kind(rendered["cpu"], "Deployment"))
    assert "amd.com/gpu" not in server["resources"].get("limits", {})
    assert env_of(server)["ORTSERVE_PROVIDER"] == "cpu"
    # ONNX Runtime's threads match the cores the pod asked for, not the node's.
    assert env_of(server)["ORTSERVE_INTRA_OP_THREADS"] == server["resources"]["requests"]["cpu"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_run_non_root_on_a_read_only_root(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    deployment = by_kind(rendered[name], "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001  # the uid the Dockerfiles create
    assert pod["automountServiceAccountToken"] is False
    # Service links would put ORTSERVE_PORT=tcp://... (the Service `ortserve`) into the server's settings.
    assert pod["enableServiceLinks"] is False
    mounts_needed = {"/tmp"}
    for container in pod["initContainers"] + pod["containers"]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, container["name"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        # Everything the process writes (model cache, pip's temp folder, $HOME) is on a volume.
        env = env_of(container)
        assert mounts_needed | {env["ORTSERVE_CACHE_DIR"], env["HOME"]} <= mounts, container["name"]
    init = {c["name"]: c for c in pod["initContainers"]}["pull-model"]
    assert init["command"] == ["ortserve", "pull"]
    assert init["image"] == server_container(deployment)["image"]
    assert env_of(init)["ORTSERVE_CACHE_DIR"] == env_of(server_container(deployment))["ORTSERVE_CACHE_DIR"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_image_tag_matches_the_overlay(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    image = server_container(by_kind(rendered[name], "Deployment"))["image"]
    assert image.endswith({"cpu": "-cpu", "amd-gpu": "-rocm"}[name])


@pytest.mark.parametrize("name", OVERLAYS)
def test_hpa_scales_on_queue_depth_with_cpu_fallback(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    docs = rendered[name]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    deployment = by_kind(docs, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert set(metrics) == {"Pods", "Resource"}
    pods_metric = metrics["Pods"]["pods"]
    assert pods_metric["metric"]["name"] == "ortserve_requests_waiting"
    assert pods_metric["target"]["type"] == "AverageValue"
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    # CPU utilization is relative to the request: without one the fallback never fires.
    assert "cpu" in server_container(deployment)["resources"]["requests"]
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_adapter_rule_serves_the_hpa_metric(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Both adapter examples expose, per pod, the metric name every overlay's HPA asks for."""
    hpa_metrics = {
        m["pods"]["metric"]["name"]
        for name in OVERLAYS
        for m in by_kind(rendered[name], "HorizontalPodAutoscaler")["spec"]["metrics"]
        if m["type"] == "Pods"
    }
    rules = _adapter_rules()
    assert len(rules) == 2
    for rule in rules:
        assert rule["name"]["as"] in hpa_metrics
        assert rule["seriesQuery"].startswith(rule["name"]["as"] + "{")
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        # every ortserve_* series carries model_name: the rule sums it away, one value per pod (the HPA's)
        query = rule["metricsQuery"].replace(" ", "")
        assert query.startswith("sum(") and query.endswith("by(<<.GroupBy>>)"), rule["metricsQuery"]
    assert rules[0] == rules[1], "adapter-config.yaml and values.yaml disagree"


def test_podmonitor_scrapes_the_server_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    monitor = yaml.safe_load((ADAPTER / "podmonitor.yaml").read_text())
    deployment = by_kind(rendered["cpu"], "Deployment")
    assert _selected(monitor["spec"]["selector"]["matchLabels"], _pod_labels(deployment))
    port_names = {p["name"] for p in server_container(deployment)["ports"]}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"


def _with_component(tmp_path: Path, overlay: str, component: str) -> list[dict[str, Any]]:
    """An overlay plus one of deploy/k8s/components, rendered; every object validated against the newest schema."""
    # NOTE(deploy): kustomize refuses absolute resource paths, so the scratch kustomization names the
    # repository's folders relative to itself.
    base = os.path.relpath(K8S / "overlays" / overlay, tmp_path)
    part = os.path.relpath(K8S / "components" / component, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {base}\ncomponents:\n  - {part}\n"
    )
    docs = kustomize(tmp_path)
    for doc in docs:
        _validate(doc, K8S_VERSIONS[-1])
    return docs


def test_shared_model_cache_component_swaps_in_the_claim(tmp_path: Path) -> None:
    """An overlay plus components/shared-model-cache renders, validates, and mounts the RWX claim."""
    docs = _with_component(tmp_path, "cpu", "shared-model-cache")
    claim = by_kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes = {v["name"]: v for v in by_kind(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model-cache"] == {
        "name": "model-cache",
        "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]},
    }


@pytest.mark.parametrize("name", OVERLAYS)
def test_shared_state_component_gives_every_replica_the_database_url(
        tmp_path: Path, rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    """An overlay plus components/shared-state: the server reads --state-url from the Secret (a required key, so a
    pod never starts on a per-pod store by mistake), and keeps every other variable of the overlay."""
    from server.settings import ENV_PREFIX, Settings

    docs = _with_component(tmp_path, name, "shared-state")
    container = server_container(by_kind(docs, "Deployment"))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e}
    ref = refs[f"{ENV_PREFIX}STATE_URL"]
    assert ref["key"] == "url" and ref["name"] and not ref.get("optional", False)
    assert "state_url" in Settings.model_fields  # the variable names a real setting
    assert env_of(container) == env_of(server_container(by_kind(rendered[name], "Deployment")))
    without = server_container(by_kind(rendered[name], "Deployment"))
    assert f"{ENV_PREFIX}STATE_URL" not in {e["name"] for e in without.get("env", [])}
