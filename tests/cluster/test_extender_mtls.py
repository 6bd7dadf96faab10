"""Issue 14 on the real API server: the session's kvgpu kube-scheduler schedules GPU pods over
the extender's mutual TLS (HTTP/2, which it chooses by ALPN), and a process without
kube-scheduler's client certificate cannot use the extender to bind a pending pod to a node of
its choice (skipping its nodeSelector): plain HTTP, HTTPS without a certificate and HTTPS with a
certificate of the cluster's own CA (the admin's) are all refused; the pod stays unbound, no
claim is made and kvgpu posts no Event."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Any

import pytest

pytestmark = pytest.mark.cluster


def _bind(url: str, body: dict[str, Any], ctx: ssl.SSLContext | None) -> str:
    """POST /scheduler/bind; returns what came back ("HTTP <status> <body>" or the error)."""
    req = urllib.request.Request(f"{url}/bind", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return f"HTTP {r.status} {r.read().decode()}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} {e.read().decode()}"
    except (urllib.error.URLError, ssl.SSLError, ConnectionError, OSError) as e:
        return f"refused: {e!r}"


def test_gpu_pod_is_scheduled_over_mutual_tls(gpu: Any) -> None:
    system = gpu.system
    assert system.extender_url.startswith("https://")
    exts = system.scheduler_config()["extenders"]
    assert len(exts) == 2 and all(
        e["enableHTTPS"] is True and set(e["tlsConfig"]) == {"certFile", "keyFile", "caFile"} for e in exts)
    [node] = gpu.nodes(1, cards=1)
    gpu.create(gpu.pod("tls", {"kvgpu.io/gpumem": "2000", "kvgpu.io/gpucores": "20"}))
    pod = gpu.wait_bound("tls", timeout=60)
    assert pod["spec"]["nodeName"] == node
    [claim] = gpu.claims()
    assert claim["spec"]["devices"][0]["memory"] == 2000
    # kube-scheduler chose HTTP/2 (ALPN) for its extender calls: each a stream, not a connection
    with urllib.request.urlopen(f"{system.metrics_url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    counts = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("kvgpu_extender_") and "_total " in line}
    assert counts["kvgpu_extender_http2_connections_total"] >= 1  # kube-scheduler is the suite's only h2 client


def test_no_client_certificate_cannot_bind_a_pending_pod(gpu: Any) -> None:
    system, cluster = gpu.system, gpu.cluster
    [node] = gpu.nodes(1, cards=1)
    pod = gpu.pod("victim", {"kvgpu.io/gpumem": "2000", "kvgpu.io/gpucores": "20"})
    pod["spec"]["nodeSelector"] = {"kvgpu.io/test": "no-such-node"}  # unschedulable: stays Pending
    gpu.create(pod)
    gpu.wait(lambda: any("FailedScheduling" in e for e in gpu.events("victim")), 30, "FailedScheduling")
    live = gpu.get("pod", "victim")
    body = {"podName": "victim", "podNamespace": gpu.ns, "podUID": live["metadata"]["uid"], "node": node}

    plain = _bind(system.extender_url.replace("https://", "http://"), body, None)
    no_cert = _bind(system.extender_url, body, ssl.create_default_context(
        cafile=str(system.pki / "extender-ca.crt")))
    other_ca = ssl.create_default_context(cafile=str(system.pki / "extender-ca.crt"))
    other_ca.load_cert_chain(str(system.pki / "admin.crt"), str(system.pki / "admin.key"))  # system:masters
    admin = _bind(system.extender_url, body, other_ca)
    for answer in (plain, no_cert, admin):
        assert not answer.startswith("HTTP 200"), answer
        assert answer.startswith("refused") or answer.startswith(("HTTP 400", "HTTP 401", "HTTP 403")), answer
    print(f"plain HTTP: {plain}\nno certificate: {no_cert}\nadmin certificate (cluster CA): {admin}")

    live = gpu.get("pod", "victim")
    assert not live["spec"].get("nodeName"), "the pod stayed unbound"
    assert not gpu.claims(), "no claim was made"
    ev = json.loads(cluster.kubectl("get", "events", "-n", gpu.ns, "-o", "json",
                                    "--field-selector=involvedObject.name=victim").stdout)["items"]
    kvgpu = [e for e in ev if (e.get("source") or {}).get("component") == "kvgpu-operator"
             or e.get("reportingComponent") == "kvgpu-operator"]
    assert not kvgpu, [f"{e['reason']}: {e['message']}" for e in kvgpu]

    # The same call with kube-scheduler's certificate is answered: the refusals above were the
    # missing identity, not a malformed request (and this is why only kube-scheduler may call).
    assert _bind(system.extender_url, body, system.client_ssl()) == "HTTP 200 {}"
    assert gpu.get("pod", "victim")["spec"]["nodeName"] == node
