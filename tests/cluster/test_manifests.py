"""The chart charts/kvgpu against the real API server: `helm template` renders it, and every
rendered object passes a server-side dry-run apply (schema, RBAC escalation checks, admission);
its roles are checked with SubjectAccessReviews and by running the components as its
ServiceAccounts. (`helm install` itself: tests/cluster/test_chart.py.)

The CRDs go in for real first (custom resources of the same render need them Established), as
does the kvgpu-system namespace (namespaced objects need it). cert-manager is not installed on
the local control plane, so the test installs stand-in CRDs for its two kinds (open schema) to
dry-run the cert-manager variant's Issuer/Certificate objects too; they are removed afterwards.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from clusterkit import stop_process
from kvgpu.devcluster import Cluster
from kvgpu.dra.slices import device_classes

from tests.helmkit import render

EXPECTED = {
    "CustomResourceDefinition": 3, "VGPUPool": 1, "DeviceClass": len(device_classes()),
    "ServiceAccount": 3, "ClusterRole": 5, "ClusterRoleBinding": 3, "Role": 2, "RoleBinding": 3,
    "StatefulSet": 1, "Service": 2, "PodDisruptionBudget": 1, "ConfigMap": 1, "Deployment": 1,
    "DaemonSet": 2,  # the agent; the MPS control daemons (kvgpu-mps: their own, kept across agent upgrades)
    "MutatingWebhookConfiguration": 1, "ValidatingWebhookConfiguration": 1,
    # VGPUClaim writers (vgpuclaims.kvgpu.io) and the pod checks after every mutation (pods.kvgpu.io)
    "NetworkPolicy": 1, "ValidatingAdmissionPolicy": 2, "ValidatingAdmissionPolicyBinding": 2,
}
# the webhook's root/CA/serving certificate; the extender's CA and its serving and client certificates
CERT_MANAGER = {"Issuer": 3, "Certificate": 5}
STAND_IN = "cert-manager-stand-in"
OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvgpu-system"}}
CERT_MANAGER_VALUES = {"certManager": {"enabled": True}}


def _chart(values: dict[str, Any] | None = None, *, crds: bool = False) -> list[dict[str, Any]]:
    """The chart's objects in kvgpu-system (``helm template``), with the CRDs when ``crds``."""
    return render(values, include_crds=crds)


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


def test_chart_renders_without_cert_manager(cluster: Cluster) -> None:
    docs = _chart(crds=True)
    assert Counter(d["kind"] for d in docs) == EXPECTED
    assert not [d for d in docs if d["apiVersion"].startswith("cert-manager.io/")]
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    assert version == "v1.36.3", "the chart's default scheduler tag below is the cluster's version"
    images = {c["image"] for d in docs if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"ghcr.io/kvgpu/kvgpu-operator:0.1.0", "ghcr.io/kvgpu/kvgpu-agent:0.1.0",
                      "registry.k8s.io/kube-scheduler:v1.36.3"}


@pytest.fixture
def stand_in_cert_manager(cluster: Cluster) -> Any:
    crds = [_stand_in_crd("Issuer"), _stand_in_crd("Certificate")]
    # an apply over CRDs still terminating passes, and then no object of their kinds may be made
    cluster.kubectl("wait", "--for=delete", "crd", "-l", f"kvgpu.io/test={STAND_IN}", "--timeout=60s", check=False)
    cluster.kubectl("apply", "--server-side", "-f", "-", input=_as_list(crds))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "-l", f"kvgpu.io/test={STAND_IN}",
                    "--timeout=60s")
    yield
    # waited for: the next test's apply would otherwise land on the terminating CRDs
    cluster.kubectl("delete", "crd", "-l", f"kvgpu.io/test={STAND_IN}", "--timeout=60s", check=False)


@pytest.mark.parametrize("values", [None, CERT_MANAGER_VALUES], ids=["operator-certs", "cert-manager"])
def test_install_dry_runs_on_the_server(cluster: Cluster, stand_in_cert_manager: Any,
                                        values: dict[str, Any] | None) -> None:
    docs = _chart(values, crds=True)
    hooks = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    if values is None:
        assert Counter(d["kind"] for d in docs) == EXPECTED
        assert all("annotations" not in h["metadata"] for h in hooks)
    else:
        assert Counter(d["kind"] for d in docs) == EXPECTED | CERT_MANAGER
        for h in hooks:
            assert h["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "kvgpu-system/kvgpu-webhook"
    docs.insert(0, NAMESPACE)

    # What the rest depends on goes in for real: CRDs (Established) and the namespace.
    first = [d for d in docs if d["kind"] in ("CustomResourceDefinition", "Namespace")]
    rest = [d for d in docs if d not in first]
    # The session's operator runs dev-mode webhook configurations of the same names (url-based);
    # an apply would merge into them. Dry-run ours under their own names.
    for d in rest:
        if d["kind"].endswith("WebhookConfiguration"):
            d["metadata"]["name"] += "-dry-run"
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=_as_list(first))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "-l", "app.kubernetes.io/part-of=kvgpu",
                    "--timeout=60s")

    # The API server's handler of custom resources reads CRDs from its own cache: right after the
    # stand-in CRDs were deleted (the previous case) and made again, it can still hold the old,
    # terminating ones for a moment (seen on a loaded 2-core machine) and refuse their objects.
    deadline = time.monotonic() + 60
    while True:
        p = cluster.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server",
                            "--field-manager=kvgpu-manifests-test", "-o", "json", "-f", "-",
                            input=_as_list(rest), check=False)
        if p.returncode == 0 or "definition is terminating" not in p.stderr or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert p.returncode == 0, p.stderr
    applied = json.loads(p.stdout)
    items = applied.get("items", [applied])
    assert Counter(i["kind"] for i in items) == Counter(d["kind"] for d in rest)
    # Defaults filled in by the server show the objects went through admission and schema.
    sts = next(i for i in items if i["kind"] == "StatefulSet")
    op = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")
    assert op["env"][0]["name"] == "POD_NAME"
    assert sts["spec"]["revisionHistoryLimit"] == 10


# --------------------------------------------------------------------------- RBAC, for real

SA = "system:serviceaccount:kvgpu-system:"

#: (account, verb, group, resource, subresource, namespace or "" for cluster-wide[, name]) the components
#: call — operator/kvgpu/kube.py and Kopf; agent/kube.py and agent/pods.py; kube-scheduler.
ALLOWED = [
    ("kvgpu-operator", v, "", "pods", "", "") for v in ("get", "list", "watch", "patch")
] + [
    ("kvgpu-operator", "create", "", "pods", "binding", "team"),
    ("kvgpu-operator", "create", "", "pods", "eviction", "team"),
    ("kvgpu-operator", "list", "policy", "poddisruptionbudgets", "", "team"),
    ("kvgpu-operator", "patch", "", "nodes", "", ""),
    ("kvgpu-operator", "watch", "", "nodes", "", ""),
    ("kvgpu-operator", "create", "", "events", "", "team"),
    ("kvgpu-operator", "patch", "", "events", "", "team"),
    ("kvgpu-operator", "create", "kvgpu.io", "vgpuclaims", "", "team"),
    ("kvgpu-operator", "delete", "kvgpu.io", "vgpuclaims", "", "team"),
    ("kvgpu-operator", "list", "kvgpu.io", "vgpuclaims", "", ""),
    ("kvgpu-operator", "patch", "kvgpu.io", "vgpuclaims", "status", "team"),
    ("kvgpu-operator", "watch", "kvgpu.io", "vgpupools", "", ""),
    ("kvgpu-operator", "patch", "kvgpu.io", "vgpupools", "status", ""),
    ("kvgpu-operator", "list", "", "resourcequotas", "", ""),
    ("kvgpu-operator", "watch", "", "resourcequotas", "", ""),
    ("kvgpu-operator", "watch", "kvgpu.io", "vgpuquotas", "", ""),
    ("kvgpu-operator", "patch", "kvgpu.io", "vgpuquotas", "status", "team"),
    ("kvgpu-operator", "create", "coordination.k8s.io", "leases", "", "kvgpu-system"),
    ("kvgpu-operator", "update", "coordination.k8s.io", "leases", "", "kvgpu-system", "kvgpu-operator"),
    # kvgpu certs (the operator pod's certificate containers; without cert-manager)
    ("kvgpu-operator", "create", "", "secrets", "", "kvgpu-system"),
    ("kvgpu-operator", "get", "", "secrets", "", "kvgpu-system", "kvgpu-ca"),
    ("kvgpu-operator", "update", "", "secrets", "", "kvgpu-system", "kvgpu-scheduler-extender-client"),
    ("kvgpu-operator", "update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "",
     "kvgpu-mutate"),
    ("kvgpu-operator", "get", "admissionregistration.k8s.io", "validatingwebhookconfigurations", "", "",
     "kvgpu-validate"),
    ("kvgpu-agent", "patch", "", "nodes", "", ""),
    ("kvgpu-agent", "watch", "", "nodes", "", ""),
    ("kvgpu-agent", "watch", "", "pods", "", ""),
    ("kvgpu-agent", "create", "", "events", "", "default"),
    ("kvgpu-agent", "patch", "", "events", "", "team"),
    ("kvgpu-agent", "list", "kvgpu.io", "vgpupools", "", ""),
    ("kvgpu-scheduler", "create", "", "pods", "binding", "team"),
    ("kvgpu-scheduler", "watch", "", "pods", "", ""),
    ("kvgpu-scheduler", "create", "events.k8s.io", "events", "", "team"),
    ("kvgpu-scheduler", "create", "coordination.k8s.io", "leases", "", "kvgpu-system"),
    ("kvgpu-scheduler", "watch", "storage.k8s.io", "csinodes", "", ""),
    ("kvgpu-scheduler", "get", "", "configmaps", "", "kube-system", "extension-apiserver-authentication"),
]
DENIED = [
    ("kvgpu-operator", "delete", "", "pods", "", "team"),
    ("kvgpu-operator", "delete", "policy", "poddisruptionbudgets", "", "team"),
    ("kvgpu-operator", "get", "", "secrets", "", "kvgpu-system"),
    ("kvgpu-operator", "list", "", "secrets", "", "kvgpu-system"),
    ("kvgpu-operator", "get", "", "secrets", "", "kvgpu-system", "someone-elses"),
    ("kvgpu-operator", "get", "", "secrets", "", "team", "kvgpu-ca"),
    ("kvgpu-operator", "update", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "",
     "other-webhook"),
    ("kvgpu-operator", "update", "coordination.k8s.io", "leases", "", "kube-system", "kvgpu-operator"),
    ("kvgpu-operator", "update", "kvgpu.io", "vgpupools", "", ""),
    ("kvgpu-operator", "update", "", "resourcequotas", "", "team"),
    ("kvgpu-operator", "patch", "", "resourcequotas", "status", "team"),
    ("kvgpu-operator", "patch", "kvgpu.io", "vgpuquotas", "", "team"),
    ("kvgpu-operator", "create", "kvgpu.io", "vgpuquotas", "", "team"),
    ("kvgpu-operator", "create", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", ""),
    ("kvgpu-agent", "patch", "", "pods", "", "team"),
    ("kvgpu-agent", "list", "kvgpu.io", "vgpuclaims", "", ""),
    ("kvgpu-agent", "delete", "", "nodes", "", ""),
    ("kvgpu-scheduler", "update", "coordination.k8s.io", "leases", "", "kube-system"),
    ("kvgpu-scheduler", "create", "coordination.k8s.io", "leases", "", "kube-system"),
    ("kvgpu-scheduler", "patch", "", "nodes", "", ""),
]


def _rbac_objects(cluster: Cluster) -> list[dict[str, Any]]:
    kinds = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    return [NAMESPACE, *[d for d in _chart() if d["kind"] in kinds]]


@pytest.fixture
def rbac(cluster: Cluster) -> Any:
    objs = _rbac_objects(cluster)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=_as_list(objs))
    yield
    rest = [d for d in objs if d["kind"] != "Namespace"]
    cluster.kubectl("delete", "--wait=false", "--ignore-not-found", "-f", "-", input=_as_list(rest),
                    check=False)


def _review(account: str, verb: str, group: str, resource: str, sub: str, ns: str,
            name: str = "") -> dict[str, Any]:
    attrs = {"verb": verb, "group": group, "resource": resource}
    if name:
        attrs["name"] = name
    if sub:
        attrs["subresource"] = sub
    if ns:
        attrs["namespace"] = ns
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": SA + account, "groups": ["system:serviceaccounts",
                                                      "system:serviceaccounts:kvgpu-system",
                                                      "system:authenticated"],
                     "resourceAttributes": attrs}}


def _json_stream(text: str) -> list[dict[str, Any]]:
    """kubectl prints one JSON document per created object."""
    dec, i = json.JSONDecoder(), 0
    out: list[dict[str, Any]] = []
    while i < len(text.rstrip()):
        obj, i = dec.raw_decode(text, i)
        out += obj.get("items", [obj]) if obj.get("kind") == "List" else [obj]
        while i < len(text) and text[i].isspace():
            i += 1
    return out


def test_rbac_allows_the_calls_and_nothing_broader(cluster: Cluster, rbac: Any) -> None:
    cases = [(c, True) for c in ALLOWED] + [(c, False) for c in DENIED]
    p = cluster.kubectl("create", "-o", "json", "-f", "-", input=_as_list([_review(*c) for c, _ in cases]))
    results = _json_stream(p.stdout)
    wrong = [(c, want) for (c, want), r in zip(cases, results, strict=True)
             if bool(r["status"].get("allowed")) != want]
    assert not wrong, wrong


def test_agent_runs_with_its_own_service_account(cluster: Cluster, rbac: Any, namespace: str,
                                                 tmp_path: Any) -> None:
    """The simulated agent, authenticated as kvgpu-agent with the chart's ClusterRole (plus
    rbac.simulatedAgent's nodes/status), publishes its node's inventory and label, with
    no 403 anywhere in its log."""
    import asyncio
    import subprocess
    import sys
    import time

    from kvgpu.core import keys
    from kvgpu.core.inventory import SimulatedNode
    from kvgpu.devcluster.fakenodes import create_nodes

    node = f"{namespace}-agent"

    async def mk() -> None:
        async with cluster.api() as api:
            await create_nodes(api, [SimulatedNode(node, ())], with_inventory=False)

    asyncio.run(mk())
    extra = _as_list([d for d in _chart({"rbac": {"simulatedAgent": True}})
                      if d["metadata"]["name"] == "kvgpu-agent-simulated"])
    cluster.kubectl("apply", "--server-side", "-f", "-", input=extra)
    kubeconfig = _sa_kubeconfig(cluster, "kvgpu-agent", tmp_path / "agent.kubeconfig")
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"nodes": [{"name": node, "cards": [{"model": "NVIDIA H200", "count": 2}]}]}))
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgpu.cli.main", "agent", f"--node={node}", f"--simulated={sim}",
             f"--kubeconfig={kubeconfig}", "--no-device-plugin", "--metrics-port=0", "--interval=2"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        got: dict[str, Any] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            meta = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)["metadata"]
            if keys.NODE_INVENTORY in (meta.get("annotations") or {}) and \
                    (meta.get("labels") or {}).get(keys.NODE_LABEL_GPU) == "true":
                got = meta
                break
            time.sleep(0.5)
        text = log.read_text(errors="replace")
        assert got, f"no inventory published; agent log:\n{text[-3000:]}"
        inv = json.loads(got["annotations"][keys.NODE_INVENTORY])
        assert len(inv["cards"]) == 2
        time.sleep(2)  # let the pod and pool watches run a little
        text = log.read_text(errors="replace")
        assert not re.search(r"\(403\)|\b403\b", text) and "forbidden" not in text.lower(), text[-3000:]
        assert proc.poll() is None, text[-3000:]
    finally:
        stop_process(proc)
        cluster.kubectl("delete", "node", node, "--wait=false", check=False)
        cluster.kubectl("delete", "-f", "-", "--wait=false", "--ignore-not-found", input=extra, check=False)


def _sa_kubeconfig(cluster: Cluster, account: str, path: Path) -> Path:
    token = cluster.kubectl("create", "token", account, "-n", "kvgpu-system", "--duration=1h").stdout.strip()
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    kc["users"] = [{"name": account, "user": {"token": token}}]
    for ctx in kc["contexts"]:
        ctx["context"]["user"] = account
    path.write_text(yaml.safe_dump(kc))
    return path


def test_operator_and_scheduler_work_with_only_their_roles(gpu: Any, rbac: Any, tmp_path: Path) -> None:
    """The session's operator and kvgpu kube-scheduler (both with broad identities) are replaced
    for this test by ones authenticated as the kvgpu-operator and kvgpu-scheduler
    ServiceAccounts with the chart's roles: the operator with leader election as in the
    StatefulSet, the scheduler with the generated ConfigMap's configuration (leader election on,
    only the extender URL pointed at the local operator). A pod is admitted, scheduled, bound,
    claimed, followed to Running and released, with no request refused in either log. The
    session's components are restored afterwards."""
    import subprocess
    import sys
    import time

    cluster, system = gpu.cluster, gpu.system
    crds = [d for d in _chart(crds=True) if d["kind"] == "CustomResourceDefinition"]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=_as_list(crds))
    kubeconfig = _sa_kubeconfig(cluster, "kvgpu-operator", tmp_path / "operator.kubeconfig")
    pki = cluster.run_dir / "pki"
    ready, log = tmp_path / "ready", tmp_path / "operator.log"
    argv = [sys.executable, "-m", "kvgpu.cli.main", "operator", f"--kubeconfig={kubeconfig}",
            *system.extender_args(), f"--webhook-port={system.webhook_port}",
            "--webhook-host=127.0.0.1", f"--webhook-cert={pki / 'webhook.crt'}",
            f"--webhook-key={pki / 'webhook.key'}", f"--operator-username={SA}kvgpu-operator",
            "--exclude-namespace=kvgpu-system", "--leader-elect", "--lease-namespace=kvgpu-system",
            f"--ready-file={ready}"]
    sched_cfg = yaml.safe_load(next(d for d in _chart()
                                    if d["kind"] == "ConfigMap")["data"]["config.yaml"])
    for ext in sched_cfg["extenders"]:  # filter and prioritize, then bind
        assert ext["enableHTTPS"] is True and set(ext["tlsConfig"]) == {"certFile", "keyFile", "caFile"}
        # the same files as the chart mounts, from the dev PKI
        ext["urlPrefix"], ext["tlsConfig"] = system.extender_url, system.scheduler_tls().config()  # type: ignore[union-attr]
    sched_cfg["clientConnection"]["kubeconfig"] = str(
        _sa_kubeconfig(cluster, "kvgpu-scheduler", tmp_path / "scheduler.kubeconfig"))
    sched_path = tmp_path / "scheduler.yaml"
    sched_path.write_text(yaml.safe_dump(sched_cfg))
    sched_log = tmp_path / "scheduler.log"
    system.stop_operator()
    cluster.stop_component("kube-scheduler-kvgpu-scheduler")
    # the chart's VGPUClaim policy (the operator's ServiceAccount writes claims) and pod policy in
    # place of the session's dev ones; the session operator puts its own back when it restarts below
    policy = [d for d in _chart() if d["kind"].startswith("ValidatingAdmissionPolicy")]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=_as_list(policy))
    proc = sched = None
    try:
        with sched_log.open("wb") as out:
            sched = subprocess.Popen(
                [str(cluster.bin_dir / "kube-scheduler"), f"--config={sched_path}",
                 "--bind-address=127.0.0.1", "--secure-port=0", "--v=2"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        gpu.wait(lambda: ready.exists() or proc.poll() is not None, 60, "operator ready")
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]

        [node] = gpu.nodes(1, cards=2)
        gpu.create(gpu.pod("seed", {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}))
        pod = gpu.wait_bound("seed", timeout=90)  # the operator first takes its Lease
        assert pod["spec"]["nodeName"] == node and pod["spec"]["schedulerName"] == "kvgpu-scheduler"
        [claim] = gpu.claims()
        assert claim["spec"]["devices"][0]["memory"] == 3000
        gpu.cluster.kubectl("patch", "pod", "seed", "-n", gpu.ns, "--subresource=status", "--type=merge",
                            "-p", json.dumps({"status": {"phase": "Succeeded"}}))
        gpu.wait(lambda: gpu.claims()[0].get("status", {}).get("phase") == "Released", 30,
                 "claim Released (the claim-phase worker runs)")
        # An earlier version's usage annotation on the node: the operator removes it (its RBAC
        # lets it patch nodes), and writes nothing per allocation there.
        cluster.kubectl("annotate", "node", node, 'kvgpu.io/allocation={"version":1}')

        def stale_gone() -> bool:
            node_obj = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)
            return "kvgpu.io/allocation" not in node_obj["metadata"]["annotations"]

        try:
            gpu.wait(stale_gone, 15, "the old allocation annotation removed")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text(errors='replace')[-3000:]}") from None
        gpu.delete_pod("seed")
        gpu.wait(lambda: not gpu.claims(), 30, "claim removed with its pod")
        text = log.read_text(errors="replace")
        assert not re.search(r"\(403\)|\b403\b", text) and "forbidden" not in text.lower(), text[-3000:]
        op_lease = json.loads(cluster.kubectl("get", "lease", "kvgpu-operator", "-n", "kvgpu-system",
                                              "-o", "json").stdout)
        assert op_lease["spec"]["holderIdentity"], "the operator holds its Lease"
        lease = json.loads(cluster.kubectl("get", "lease", "kvgpu-scheduler", "-n", "kvgpu-system",
                                           "-o", "json").stdout)
        assert lease["spec"]["holderIdentity"]
        assert sched.poll() is None
        text = sched_log.read_text(errors="replace")
        refused = [line for line in text.splitlines() if "forbidden" in line.lower()]
        assert not refused, "\n".join(refused[:20])
    finally:
        stop_process(proc)
        stop_process(sched)
        time.sleep(0.5)
        system.start_operator()
        system.start_scheduler()
        cluster.kubectl("delete", "lease", "kvgpu-scheduler", "-n", "kvgpu-system", "--ignore-not-found",
                        check=False)


def test_standby_operator_is_not_ready_and_takes_over(kvgpu_system: Any, rbac: Any, tmp_path: Path) -> None:
    """Two replicas as the StatefulSet runs them (--leader-elect, the operator's own
    ServiceAccount): only the Lease holder answers /readyz with 200 (the Services route to ready
    pods only), the standby answers 503; when the leader dies, the standby takes over."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from kvgpu.devcluster.cluster import free_port

    cluster, system = kvgpu_system.cluster, kvgpu_system
    kubeconfig = _sa_kubeconfig(cluster, "kvgpu-operator", tmp_path / "operator.kubeconfig")
    ports = {0: free_port(), 1: free_port()}  # the plain probe ports (--metrics-address)

    def readyz(port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def wait_for(cond: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.2)
        return False

    system.stop_operator()
    procs: dict[int, Any] = {}
    try:
        for ordinal, port in ports.items():
            with (tmp_path / f"op{ordinal}.log").open("wb") as out:
                procs[ordinal] = subprocess.Popen(
                    [sys.executable, "-m", "kvgpu.cli.main", "operator", f"--kubeconfig={kubeconfig}",
                     *system.extender_args(port=0, metrics_port=port), "--leader-elect",
                     "--lease-namespace=kvgpu-system",
                     f"--identity=kvgpu-operator-{ordinal}"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert wait_for(lambda: sorted(readyz(p) for p in ports.values()) == [200, 503], 60), (
            {o: readyz(p) for o, p in ports.items()},
            (tmp_path / "op0.log").read_text(errors="replace")[-2000:],
            (tmp_path / "op1.log").read_text(errors="replace")[-2000:])
        leader = next(o for o, p in ports.items() if readyz(p) == 200)
        standby = 1 - leader
        os.kill(procs[leader].pid, signal.SIGKILL)  # a crash: the lease is not released
        procs[leader].wait(10)
        t0 = time.monotonic()
        assert wait_for(lambda: readyz(ports[standby]) == 200, 60), (
            (tmp_path / f"op{standby}.log").read_text(errors="replace")[-3000:])
        print(f"standby took over {time.monotonic() - t0:.1f} s after the leader was killed")
    finally:
        for p in procs.values():
            stop_process(p)
        time.sleep(0.5)
        system.start_operator()
