"""`helm install` of charts/kvgpu into the real kube-apiserver, then `helm uninstall`.

The local control plane has no kubelet, so the chart's pods never run; their processes are run
on the host instead, as the chart's containers would run them and authenticated as the chart's
ServiceAccount (a token of kvgpu-operator): `kvgpu certs --once` (the init container) issues
the Secrets and fills the caBundle of the installed webhook configurations; the operator then
starts on the files it wrote, becomes ready (leader) with the chart's roles alone, and its
extender answers the kube-scheduler's client certificate from the Secret and refuses a client
without one. The session's operator (whose dev-mode webhook configurations and VGPUClaim
policy have the chart's names) is stopped meanwhile and restarted afterwards. A `helm upgrade` keeps the
caBundle (a field the chart does not set). The CRDs are the session's (already installed: Helm
skips existing CRDs), so the test checks they are Established rather than that Helm created
them.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from clusterkit import stop_process
from kvgpu.devcluster.cluster import free_port
from kvgpu.dra.slices import device_classes

from tests.helmkit import CHART, helm

NS = "kvgpu-helm"
RELEASE = "kvgpu"
CLUSTER_SCOPED = [("clusterrole", "kvgpu-operator"), ("clusterrole", "kvgpu-scheduler"), ("clusterrole", "kvgpu-agent"),
                  ("mutatingwebhookconfiguration", "kvgpu-mutate"),
                  ("validatingwebhookconfiguration", "kvgpu-validate"),
                  ("validatingadmissionpolicy", "vgpuclaims.kvgpu.io"),
                  ("validatingadmissionpolicy", "pods.kvgpu.io"), ("vgpupool", "helm-test"),
                  *(("deviceclass", dc["metadata"]["name"]) for dc in device_classes())]


def _sa_kubeconfig(cluster: Any, path: Path) -> Path:
    token = cluster.kubectl("create", "token", "kvgpu-operator", "-n", NS, "--duration=1h").stdout.strip()
    kc = yaml.safe_load(cluster.kubeconfig.read_text())
    kc["users"] = [{"name": "kvgpu-operator", "user": {"token": token}}]
    for ctx in kc["contexts"]:
        ctx["context"]["user"] = "kvgpu-operator"
    path.write_text(yaml.safe_dump(kc))
    return path


def _exists(cluster: Any, kind: str, name: str, ns: str | None = None) -> bool:
    args = ["get", kind, name, "--ignore-not-found", "-o", "name"] + (["-n", ns] if ns else [])
    return bool(cluster.kubectl(*args).stdout.strip())


def _readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def _extender_answers(port: int, ca: Path, cert: tuple[Path, Path] | None) -> bool:
    """Whether the extender answers an HTTP request over TLS from this client (verified against
    ``ca`` under the Service's DNS name)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert:
        ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=f"kvgpu-operator.{NS}.svc") as tls:
            tls.sendall(b"GET /scheduler/filter HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return tls.recv(64).startswith(b"HTTP/1.1 ")
    except (ssl.SSLError, ConnectionError):
        return False


def test_helm_install_issue_certificates_and_uninstall(kvgpu_system: Any, tmp_path: Path) -> None:
    cluster, system = kvgpu_system.cluster, kvgpu_system
    kc = ["--kubeconfig", str(cluster.kubeconfig)]
    system.stop_operator()
    for kind, name in (("mutatingwebhookconfiguration", "kvgpu-mutate"),
                       ("validatingwebhookconfiguration", "kvgpu-validate"),
                       ("validatingadmissionpolicybinding", "vgpuclaims.kvgpu.io"),
                       ("validatingadmissionpolicy", "vgpuclaims.kvgpu.io"),
                       ("validatingadmissionpolicybinding", "pods.kvgpu.io"),
                       ("validatingadmissionpolicy", "pods.kvgpu.io"),
                       *(("deviceclass", dc["metadata"]["name"]) for dc in device_classes())):
        cluster.kubectl("delete", kind, name, "--ignore-not-found")  # the session system's, re-made below
    op = None
    try:
        out = helm("install", RELEASE, str(CHART), "-n", NS, "--create-namespace", *kc,
                   "--set", "pool.name=helm-test",
                   "--set-json", 'pool.nodeSelector={"matchLabels":{"kvgpu.io/test":"none"}}',
                   "--set", "operator.replicas=1", "--set", "scheduler.replicas=1", "--timeout=60s").stdout
        assert "STATUS: deployed" in out, out
        assert "kubectl get vgpupool helm-test" in out and "Certificates: the operator pod issues them" in out, out
        status = json.loads(helm("status", RELEASE, "-n", NS, "-o", "json", *kc).stdout)
        assert status["info"]["status"] == "deployed"
        for kind, name in (("statefulset", "kvgpu-operator"), ("deployment", "kvgpu-scheduler"),
                           ("daemonset", "kvgpu-agent"), ("service", "kvgpu-webhook"),
                           ("configmap", "kvgpu-scheduler-config"), ("networkpolicy", "kvgpu-operator"),
                           ("role", "kvgpu-operator-lease")):
            assert _exists(cluster, kind, name, NS), (kind, name)
        for kind, name in CLUSTER_SCOPED:
            assert _exists(cluster, kind, name), (kind, name)
        for crd in ("vgpupools.kvgpu.io", "vgpuclaims.kvgpu.io", "vgpuquotas.kvgpu.io"):
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=30s")
        version = json.loads(cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
        dep = json.loads(cluster.kubectl("get", "deployment", "kvgpu-scheduler", "-n", NS, "-o", "json").stdout)
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == f"registry.k8s.io/kube-scheduler:{version}"
        hooks = json.loads(cluster.kubectl("get", "mutatingwebhookconfiguration", "kvgpu-mutate", "-o", "json").stdout)
        assert not hooks["webhooks"][0]["clientConfig"].get("caBundle"), "empty until kvgpu certs runs"

        # the init container, as a host process with the operator's ServiceAccount
        kubeconfig = _sa_kubeconfig(cluster, tmp_path / "operator.kubeconfig")
        tls = tmp_path / "tls"
        env_json = {"KVGPU_LOG_FORMAT": "json"}
        p = subprocess.run([sys.executable, "-m", "kvgpu.cli.main", "certs", "--once", f"--kubeconfig={kubeconfig}",
                            f"--namespace={NS}", f"--out-dir={tls}"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **env_json})
        assert p.returncode == 0, p.stderr[-3000:]
        events = [json.loads(line)["event"] for line in p.stderr.splitlines() if line.startswith("{")]
        assert events.count("certificate issued") == 5 and events.count("webhook caBundle set") == 2, events
        ca = base64.b64decode(json.loads(cluster.kubectl("get", "secret", "kvgpu-ca", "-n", NS, "-o", "json").stdout)
                              ["data"]["ca.crt"])
        for kind, name in (("mutatingwebhookconfiguration", "kvgpu-mutate"),
                           ("validatingwebhookconfiguration", "kvgpu-validate")):
            obj = json.loads(cluster.kubectl("get", kind, name, "-o", "json").stdout)
            assert [base64.b64decode(h["clientConfig"]["caBundle"]) for h in obj["webhooks"]] == \
                [ca] * len(obj["webhooks"])
        # helm upgrade keeps the caBundle it does not manage (three-way merge)
        helm("upgrade", RELEASE, str(CHART), "-n", NS, *kc, "--reuse-values", "--set", "operator.webhookWorkers=1")
        for kind, name in (("mutatingwebhookconfiguration", "kvgpu-mutate"),
                           ("validatingwebhookconfiguration", "kvgpu-validate")):
            obj = json.loads(cluster.kubectl("get", kind, name, "-o", "json").stdout)
            assert all(base64.b64decode(h["clientConfig"]["caBundle"]) == ca for h in obj["webhooks"]), name
        sts = json.loads(cluster.kubectl("get", "statefulset", "kvgpu-operator", "-n", NS, "-o", "json").stdout)
        op_args = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "operator")["args"]
        assert "--webhook-workers=1" in op_args
        # the operator on those files, with the chart's roles only
        ext_port, metrics_port, webhook_port = free_port(), free_port(), free_port()
        d = tls / "kvgpu-extender-tls"
        w = tls / "kvgpu-webhook-tls"
        op_log = tmp_path / "operator.log"
        with op_log.open("wb") as f:
            op = subprocess.Popen(
                [sys.executable, "-m", "kvgpu.cli.main", "operator", f"--kubeconfig={kubeconfig}", "--leader-elect",
                 f"--lease-namespace={NS}", "--identity=kvgpu-operator-0", f"--extender-address=127.0.0.1:{ext_port}",
                 f"--extender-cert={d / 'tls.crt'}", f"--extender-key={d / 'tls.key'}",
                 f"--extender-client-ca={d / 'ca.crt'}", f"--metrics-address=127.0.0.1:{metrics_port}",
                 f"--webhook-port={webhook_port}", "--webhook-workers=1", f"--webhook-cert={w / 'tls.crt'}",
                 f"--webhook-key={w / 'tls.key'}", f"--operator-username=system:serviceaccount:{NS}:kvgpu-operator",
                 f"--exclude-namespace={NS}"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **env_json})
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and op.poll() is None and _readyz(metrics_port) != 200:
            time.sleep(0.5)
        text = op_log.read_text(errors="replace")
        assert _readyz(metrics_port) == 200, text[-3000:]
        assert not re.search(r"\(403\)|\b403\b", text) and "forbidden" not in text.lower(), text[-3000:]
        # kube-scheduler's side: the client certificate from its Secret, as the pod mounts it
        client = json.loads(cluster.kubectl("get", "secret", "kvgpu-scheduler-extender-client", "-n", NS,
                                            "-o", "json").stdout)["data"]
        for key, value in client.items():
            (tmp_path / f"client-{key}").write_bytes(base64.b64decode(value))
        cafile = tmp_path / "client-ca.crt"
        assert _extender_answers(ext_port, cafile, (tmp_path / "client-tls.crt", tmp_path / "client-tls.key"))
        assert not _extender_answers(ext_port, cafile, None), "a client without the certificate is refused"
        # the sidecar's next round adopts: nothing re-issued
        p = subprocess.run([sys.executable, "-m", "kvgpu.cli.main", "certs", "--once", f"--kubeconfig={kubeconfig}",
                            f"--namespace={NS}", f"--out-dir={tls}"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, **env_json})
        assert p.returncode == 0 and "certificate issued" not in p.stderr, p.stderr[-2000:]
    finally:
        stop_process(op)
        helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout=60s", *kc, check=False)
        gone = [(k, n) for k, n in CLUSTER_SCOPED if _exists(cluster, k, n)]
        left = [(k, n) for k, n in (("statefulset", "kvgpu-operator"), ("service", "kvgpu-webhook"))
                if _exists(cluster, k, n, NS)]
        cluster.kubectl("delete", "namespace", NS, "--wait=false", "--ignore-not-found", check=False)
        system.install_device_classes()
        system.start_operator()
    assert not gone and not left, f"helm uninstall left {gone + left}"
