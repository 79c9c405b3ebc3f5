"""deploy/k8s: every manifest validated offline against the Kubernetes OpenAPI schemas of a pinned
version (kubernetes-validate, strict: unknown fields are errors), plus the cross-references a
schema cannot see (selectors, ports, service account, the router config itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvrouter.router.config import parse_config

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[test]')"
)

KUBERNETES_VERSION = "1.33.0"  # oldest release the manifests target (native sidecars are GA)
ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in docs(p)]


def find(kind: str, name: str) -> dict[str, Any]:
    for d in all_docs():
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind}/{name} in deploy/k8s")


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path):
    for doc in docs(path):
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # no schema in kubernetes-validate: checked in test_prometheus_operator_objects
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_broken_manifests():
    deployment = find("Deployment", "kvrouter")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    pod_spec(broken)["containers"][0]["livenessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest_but_the_sidecar_example():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in MANIFESTS} - {"sidecar-example.yaml"}


def test_router_deployment():
    dep = find("Deployment", "kvrouter")
    assert dep["spec"]["replicas"] >= 2
    spec = pod_spec(dep)
    (c,) = spec["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert any(m["mountPath"] == "/etc/kvrouter" for m in c["volumeMounts"])
    assert "/etc/kvrouter/config.yaml" in c["args"]  # the path the Dockerfile documents
    assert "/etc/kvrouter/config.yaml" in (ROOT / "Dockerfile").read_text()
    find("ServiceAccount", spec["serviceAccountName"])
    labels = dep["spec"]["template"]["metadata"]["labels"]
    pdb = find("PodDisruptionBudget", "kvrouter")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] >= 1
    svc = find("Service", "kvrouter")
    assert svc["spec"]["selector"].items() <= labels.items()
    # Long streams may finish: the grace period covers the router's own shutdown delay + grace.
    config = parse_config(yaml.safe_load(find("ConfigMap", "kvrouter-config")["data"]["config.yaml"]))
    assert spec["terminationGracePeriodSeconds"] >= config.server.shutdown_delay_s + config.server.shutdown_grace_s


def test_router_config_is_a_valid_kvrouter_config_wired_to_the_manifests():
    config = parse_config(yaml.safe_load(find("ConfigMap", "kvrouter-config")["data"]["config.yaml"]),
                          "deploy/k8s/router-config.yaml")
    assert config.policy.name == "coding-agent"
    assert config.server.host == "0.0.0.0" and config.server.port == 8000
    k = config.discovery.kubernetes
    svc = find("Service", k.service)
    assert svc["spec"]["clusterIP"] == "None"  # headless: one endpoint per pod
    assert k.port_name in {p["name"] for p in svc["spec"]["ports"]}
    redis_host = config.affinity.redis_url.split("//")[1].split(":")[0]
    assert config.affinity.store == "redis"
    find("Service", redis_host)
    find("Deployment", redis_host)


def test_rbac_grants_exactly_the_endpointslice_watch():
    role = find("Role", "kvrouter-endpointslices")
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert set(rule["verbs"]) == {"get", "list", "watch"}
    binding = find("RoleBinding", "kvrouter-endpointslices")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod_spec(find("Deployment", "kvrouter"))["serviceAccountName"]


def test_sglang_statefulset():
    sts = find("StatefulSet", "sglang")
    svc = find("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    (c,) = pod_spec(sts)["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 4
    port_names = {p["name"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert "preStop" in c["lifecycle"]  # drained, not cut, on scale-in


def test_prometheus_operator_objects():
    """No OpenAPI schema for these CRDs ships with kubernetes-validate; checked structurally, and
    the PrometheusRule's rules are the promtool-checked metrics/kvrouter-alerts.yaml."""
    services = {d["metadata"]["name"]: d for d in all_docs() if d["kind"] == "Service"}
    monitors = [d for d in all_docs() if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"kvrouter", "sglang"}
    for mon in monitors:
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(mon["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        matched = [s for s in services.values()
                   if mon["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert len(matched) == 1, mon["metadata"]["name"]
        ports = {p["name"] for p in matched[0]["spec"]["ports"]}
        for ep in mon["spec"]["endpoints"]:
            assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
            assert ep["port"] in ports and ep["path"] == "/metrics"
    rule = find("PrometheusRule", "kvrouter")
    assert set(rule["spec"]) == {"groups"}
    alerts = yaml.safe_load((ROOT / "metrics" / "kvrouter-alerts.yaml").read_text())
    assert rule["spec"]["groups"] == alerts["groups"]


def test_sidecar_example():
    dep = find("Deployment", "coding-agent")
    spec = pod_spec(dep)
    (router,) = [c for c in spec["initContainers"] if c["name"] == "kvrouter"]
    assert router["restartPolicy"] == "Always"  # native sidecar: up before the app, down after it
    (app,) = spec["containers"]
    env = {e["name"]: e["value"] for e in app["env"]}
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:8000")
    cm = find("ConfigMap", "coding-agent-kvrouter")
    config = parse_config(yaml.safe_load(cm["data"]["config.yaml"]), "sidecar-example.yaml")
    assert config.server.host == "127.0.0.1" and config.server.port == 8000
    assert config.discovery.dns.name.startswith(find("StatefulSet", "sglang")["spec"]["serviceName"] + ".")
