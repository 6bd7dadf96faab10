"""manifests/ against the real API server: `kubectl kustomize` renders it, and every rendered
object passes a server-side dry-run apply (schema, RBAC escalation checks, admission).

The CRDs go in for real first (custom resources of the same render need them Established), as
does the kvgpu-system namespace (namespaced objects need it). cert-manager is not installed on
the local control plane, so the test installs stand-in CRDs for its two kinds (open schema) to
dry-run the default install's Issuer/Certificate objects too; they are removed afterwards.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import yaml
from kvgpu.devcluster import Cluster

EXPECTED = {
    "Namespace": 1, "CustomResourceDefinition": 3, "ClusterKopfPeering": 1,
    "ServiceAccount": 3, "ClusterRole": 3, "ClusterRoleBinding": 3, "Role": 1, "RoleBinding": 2,
    "StatefulSet": 1, "Service": 2, "PodDisruptionBudget": 1, "ConfigMap": 1, "Deployment": 1,
    "DaemonSet": 1, "MutatingWebhookConfiguration": 1, "ValidatingWebhookConfiguration": 1,
}
CERT_MANAGER = {"Issuer": 2, "Certificate": 2}
STAND_IN = "cert-manager-stand-in"
OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _render(cluster: Cluster, path: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("kustomize", path).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _stand_in_crd(kind: str) -> dict[str, Any]:
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.cert-manager.io", "labels": {"kvgpu.io/test": STAND_IN}},
        "spec": {"group": "cert-manager.io", "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                 "versions": [{"name": "v1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": OPEN}}]},
    }


def _as_list(docs: list[dict[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": docs})


def test_base_renders_without_cert_manager(cluster: Cluster) -> None:
    docs = _render(cluster, "manifests/base")
    assert Counter(d["kind"] for d in docs) == EXPECTED
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    images = {c["image"] for d in docs if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"ghcr.io/kvgpu/kvgpu-operator:0.1.0", "ghcr.io/kvgpu/kvgpu-agent:0.1.0",
                      "registry.k8s.io/kube-scheduler:v1.36.3"}


@pytest.fixture
def stand_in_cert_manager(cluster: Cluster) -> Any:
    crds = [_stand_in_crd("Issuer"), _stand_in_crd("Certificate")]
    cluster.kubectl("apply", "--server-side", "-f", "-", input=_as_list(crds))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "-l", f"kvgpu.io/test={STAND_IN}",
                    "--timeout=60s")
    yield
    cluster.kubectl("delete", "crd", "-l", f"kvgpu.io/test={STAND_IN}", "--wait=false", check=False)


def test_default_install_dry_runs_on_the_server(cluster: Cluster, stand_in_cert_manager: Any) -> None:
    docs = _render(cluster, "manifests")
    assert Counter(d["kind"] for d in docs) == EXPECTED | CERT_MANAGER
    hooks = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    for h in hooks:
        assert h["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "kvgpu-system/kvgpu-webhook"

    # What the rest depends on goes in for real: CRDs (Established) and the namespace.
    first = [d for d in docs if d["kind"] in ("CustomResourceDefinition", "Namespace")]
    rest = [d for d in docs if d not in first]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=_as_list(first))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "-l", "app.kubernetes.io/part-of=kvgpu",
                    "--timeout=60s")

    p = cluster.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server",
                        "--field-manager=kvgpu-manifests-test", "-o", "json", "-f", "-",
                        input=_as_list(rest), check=False)
    assert p.returncode == 0, p.stderr
    applied = json.loads(p.stdout)
    items = applied.get("items", [applied])
    assert Counter(i["kind"] for i in items) == Counter(d["kind"] for d in rest)
    # Defaults filled in by the server show the objects went through admission and schema.
    sts = next(i for i in items if i["kind"] == "StatefulSet")
    assert sts["spec"]["template"]["spec"]["containers"][0]["env"][0]["name"] == "POD_INDEX"
    assert sts["spec"]["revisionHistoryLimit"] == 10
