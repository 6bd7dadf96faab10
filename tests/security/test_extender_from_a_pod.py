"""A tenant pod calls the scheduler extender's bind itself, to bind a pending GPU pod to a node
of its choice (skipping nodeSelector, affinity and taints). It runs on the real node with the
host's network — the most a pod can reach (in a cluster the extender is a ClusterIP Service,
and the NetworkPolicy admits only the kvgpu-scheduler pods) — and holds no client certificate:
plain HTTP and TLS without the scheduler's certificate, over HTTP/1.1 and over HTTP/2 (the
protocol kube-scheduler chooses), are all refused, the pod stays
unbound and no claim is made."""

from __future__ import annotations

import json
import time

from kvgpu.devcluster.system import KvgpuSystem
from realnode.gpupods import gpu_pod, hami_limits
from security.conftest import RealPods

ATTACK = r"""
import json, socket, ssl, sys, urllib.request
url, body = sys.argv[1], sys.argv[2].encode()
out = {}
for scheme in ("http", "https"):
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # the attacker trusts anything
    req = urllib.request.Request(f"{scheme}://{url}/scheduler/bind", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx if scheme == "https" else None) as r:
            out[scheme] = f"answered {r.status}: {r.read()[:200]!r}"
    except Exception as e:
        out[scheme] = f"refused: {type(e).__name__}: {e}"[:300]


def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def literal(name, value):  # HPACK: literal header field without indexing, new name
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


# HTTP/2, as kube-scheduler speaks it (ALPN h2), still without the scheduler's certificate
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
ctx.set_alpn_protocols(["h2"])
host, port = url.rsplit(":", 1)
try:
    with socket.create_connection((host, int(port)), timeout=10) as raw, ctx.wrap_socket(raw) as tls:
        headers = b"".join(literal(k, v) for k, v in ((b":method", b"POST"), (b":scheme", b"https"),
                           (b":path", b"/scheduler/bind"), (b":authority", url.encode()),
                           (b"content-type", b"application/json")))
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(1, 4, 1, headers)
                    + frame(0, 1, 1, body))
        got, kinds, i = b"", [], 0
        while (1, 1) not in kinds and (7, 0) not in kinds:  # until an answer (HEADERS) or a GOAWAY
            chunk = tls.recv(65536)
            if not chunk:
                break
            got += chunk
            while i + 9 <= len(got) and i + 9 + int.from_bytes(got[i:i + 3], "big") <= len(got):
                kinds.append((got[i + 3], int.from_bytes(got[i + 5:i + 9], "big") & 0x7FFFFFFF))
                i += 9 + int.from_bytes(got[i:i + 3], "big")
        answered = (1, 1) in kinds  # a HEADERS frame on our stream: an answer
        out["h2"] = (f"answered: frames {kinds}" if answered else
                     f"refused: ALPN {tls.selected_alpn_protocol()}, frames {kinds}")
except Exception as e:
    out["h2"] = f"refused: {type(e).__name__}: {e}"[:300]
print(json.dumps(out))
"""


def test_a_pod_without_the_schedulers_certificate_cannot_bind(real_pods: RealPods,
                                                               kvgpu_system: KvgpuSystem) -> None:
    # the victim: a GPU pod whose nodeSelector matches no node (the attacker binds it anyway)
    real_pods.apply(gpu_pod(real_pods, "victim", limits=hami_limits(1, 1000),
                            nodeSelector={"kubernetes.io/hostname": "no-such-node"}))
    time.sleep(2)
    victim = real_pods.get("victim")
    assert not victim["spec"].get("nodeName")
    body = json.dumps({"podName": "victim", "podNamespace": real_pods.ns, "podUID": victim["metadata"]["uid"],
                       "node": real_pods.node.name})
    attacker = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "attacker", "namespace": real_pods.ns},
                "spec": {"nodeName": real_pods.node.name, "hostNetwork": True, "restartPolicy": "Never",
                         "terminationGracePeriodSeconds": 1,
                         "containers": [{"name": "main", "image": "kvgpu.local/tenant:1",
                                         "imagePullPolicy": "Never",
                                         "command": ["python3", "-c", ATTACK,
                                                     f"127.0.0.1:{kvgpu_system.extender_port}", body]}]}}
    real_pods.apply(attacker)

    def done() -> str | None:
        p = real_pods.get("attacker")
        return p["status"].get("phase") if p["status"].get("phase") in ("Succeeded", "Failed") else None

    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not done():
        time.sleep(0.5)
    logs = real_pods.cluster.kubectl("logs", "attacker", "-n", real_pods.ns).stdout
    out = json.loads(logs.strip().splitlines()[-1])
    assert out["http"].startswith("refused") and out["https"].startswith("refused"), out
    assert out["h2"].startswith("refused"), out
    assert not real_pods.get("victim")["spec"].get("nodeName")
    claims = json.loads(real_pods.cluster.kubectl("get", "vgpuclaims", "-n", real_pods.ns, "-o", "json").stdout)
    assert claims["items"] == []
