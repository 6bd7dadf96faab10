"""kvgpu.devcluster.incluster without a cluster: the base manifests (read like test_manifests
does, without kustomize) adapted for the real node carry every knob where the workloads read it.
The install itself runs on the real node: tests/realnode/test_in_cluster.py."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from kvgpu.devcluster import incluster

ROOT = Path(__file__).resolve().parents[2]


def _base() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted((ROOT / "manifests" / "base").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


@pytest.fixture
def adapted(tmp_path: Path) -> tuple[list[dict[str, Any]], incluster.InClusterValues]:
    v = incluster.InClusterValues("kvgpu.local/op:1", "kvgpu.local/ag:1", "kvgpu.local/ks:v1", api_port=6443,
                                  agent_args=("--simulated=/n/sim.json",), agent_host_paths=("/n",))
    certs = incluster.dev_certificates(tmp_path, "10.250.0.1")
    return incluster.adapt_for_real_node(_base(), v, certs, b"API-CA"), v


def _spec(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return dict(incluster._find(docs, kind, name)["spec"]["template"]["spec"])


def test_operator_knobs(adapted: tuple[list[dict[str, Any]], incluster.InClusterValues]) -> None:
    docs, v = adapted
    spec = _spec(docs, "StatefulSet", "kvgpu-operator")
    [c] = spec["containers"]
    assert spec["hostNetwork"] is True and c["image"] == v.operator_image and c["imagePullPolicy"] == "Never"
    assert f"--extender-address=0.0.0.0:{v.extender_port}" in c["args"]
    assert f"--metrics-address=0.0.0.0:{v.metrics_port}" in c["args"]
    assert f"--webhook-port={v.webhook_port}" in c["args"]
    assert sum(a.startswith("--webhook-port") for a in c["args"]) == 1
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "extender": v.extender_port, "metrics": v.metrics_port, "webhooks": v.webhook_port}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == ("127.0.0.1", "6443")
    assert "requests" not in c["resources"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {incluster.SA_MOUNT, "/etc/kvgpu/webhook-tls"}
    assert incluster._find(docs, "StatefulSet", "kvgpu-operator")["spec"]["replicas"] == 1


def test_agent_and_scheduler_knobs(adapted: tuple[list[dict[str, Any]], incluster.InClusterValues]) -> None:
    docs, v = adapted
    agent = _spec(docs, "DaemonSet", "kvgpu-agent")
    [c] = agent["containers"]
    assert "runtimeClassName" not in agent and c["image"] == v.agent_image
    assert "--simulated=/n/sim.json" in c["args"] and f"--metrics-port={v.agent_metrics_port}" in c["args"]
    assert not [a for a in c["args"] if a.startswith("--dev-root=/host")]
    assert {"mountPath": "/n", "name": "node-0", "readOnly": True} in c["volumeMounts"]
    sched = _spec(docs, "Deployment", "kvgpu-scheduler")
    [s] = sched["containers"]
    assert s["image"] == v.scheduler_image and f"--secure-port={v.scheduler_port}" in s["command"]
    cfg = yaml.safe_load(incluster._find(docs, "ConfigMap", "kvgpu-scheduler-config")["data"]["config.yaml"])
    assert [e["urlPrefix"] for e in cfg["extenders"]] == [v.extender_url]
    assert v.extender_url == f"https://127.0.0.1:{v.extender_port}/scheduler"


def test_certificates_and_ca_bundle(adapted: tuple[list[dict[str, Any]], incluster.InClusterValues]) -> None:
    docs, _ = adapted
    secrets = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}
    assert set(secrets) == {"kvgpu-webhook-tls", "kvgpu-extender-tls", "kvgpu-scheduler-extender-client"}
    cert = x509.load_pem_x509_certificate(base64.b64decode(secrets["kvgpu-webhook-tls"]["tls.crt"]))
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kvgpu-webhook.kvgpu-system.svc" in sans.get_values_for_type(x509.DNSName)
    ext = x509.load_pem_x509_certificate(base64.b64decode(secrets["kvgpu-extender-tls"]["tls.crt"]))
    ips = {str(i) for i in ext.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
           .get_values_for_type(x509.IPAddress)}
    assert ips == {"127.0.0.1", "10.250.0.1"}
    bundles = {w["clientConfig"]["caBundle"] for d in docs if d["kind"].endswith("WebhookConfiguration")
               for w in d["webhooks"]}
    assert bundles == {secrets["kvgpu-webhook-tls"]["ca.crt"]}
    kinds = [d["kind"] for d in docs]
    assert kinds.index("Namespace") < kinds.index("Secret") < kinds.index("StatefulSet")
    ca = incluster._find(docs, "ConfigMap", incluster.API_CA_CONFIGMAP)
    assert ca["data"]["ca.crt"] == "API-CA"


def test_missing_workload_is_named() -> None:
    docs = [d for d in _base() if d["kind"] != "DaemonSet"]
    v = incluster.InClusterValues("o", "a", "s", api_port=1)
    with pytest.raises(incluster.InClusterError, match="DaemonSet kvgpu-agent"):
        incluster.adapt_for_real_node(docs, v, [], b"")
