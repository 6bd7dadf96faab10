"""``kubectl vgpu doctor`` and ``kubectl vgpu top`` (the real executable) on the real node: doctor
passes — its sample pod really runs on the real kubelet through the webhooks, kvgpu-scheduler and
the device plugin, and NVML in it (the stub driver behind the shim) shows the slice's 256 MiB —
then names the fault it is shown (the installed shim deleted from the host); top shows a running
CUDA program's memory, read by the agent from the shim's region, through the API server's pod
proxy.

The dev node runs the agent as a host process (RealNode.start_agent), not as a DaemonSet pod.
So that the plugin finds it through the API as in a cluster, a hostNetwork pod labelled as the
agent stands in for the DaemonSet's pod: it shares the node's network, so the pod proxy reaches
the real agent's metrics port (9394, turned on for this test), and its readiness probe is the
agent's /metrics. Everything behind the port is the real agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvgpu.core import keys
from kvgpu.devcluster.realnode import RealNode
from realnode.conftest import RealPods
from realnode.gpupods import container, gpu_pod, hami_limits, wait_for

PLUGIN = Path(sys.executable).with_name("kubectl-vgpu")
AGENT_NS = "kvgpu-system"
STANDIN = "kvgpu-agent-standin"
MIB = 1 << 20


def vgpu(node: RealNode, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PLUGIN), f"--kubeconfig={node.cluster.kubeconfig}", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture
def agent_pod(real_node: RealNode) -> Iterator[str]:
    """The real agent serving metrics on the node's address, and its stand-in pod (see above)."""
    k = real_node.cluster.kubectl
    created_ns = k("get", "namespace", AGENT_NS, check=False).returncode != 0
    if created_ns:
        k("create", "namespace", AGENT_NS)
    real_node.restart_agent(["--metrics-port", "9394"])
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": STANDIN, "namespace": AGENT_NS,
                        "labels": {"app.kubernetes.io/name": "kvgpu", "app.kubernetes.io/component": "agent"}},
           "spec": {"nodeName": real_node.name, "hostNetwork": True, "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "agent", "image": real_node.image("tenant"), "imagePullPolicy": "Never",
                                    "command": ["sleep", "3600"],
                                    "readinessProbe": {"httpGet": {"path": "/metrics", "port": 9394},
                                                       "periodSeconds": 2}}]}}
    k("apply", "-f", "-", input=json.dumps(pod))
    try:
        wait_for(lambda: '"Ready"' in (out := k("get", "pod", STANDIN, "-n", AGENT_NS, "-o",
                                                 "jsonpath={.status.conditions}").stdout)
                 and '"status":"True","type":"Ready"' in out.replace(" ", ""), 90, "the stand-in agent pod Ready")
        yield STANDIN
    finally:
        k("delete", "pod", STANDIN, "-n", AGENT_NS, "--wait=true", "--timeout=60s", check=False)
        if created_ns:
            k("delete", "namespace", AGENT_NS, "--wait=false", check=False)
        real_node.restart_agent([])  # reinstalls the shim; metrics off again, as the fixture runs it


def _shim_report(real_node: RealNode) -> dict[str, Any]:
    node = real_node.node() or {}
    return dict(json.loads(node["metadata"]["annotations"][keys.NODE_SHIM]))


def test_doctor_passes_top_shows_usage_and_doctor_names_a_removed_shim(real_pods: RealPods, agent_pod: str) -> None:
    doctor_top_and_a_removed_shim(real_pods, agent_pod)


def doctor_top_and_a_removed_shim(real_pods: RealPods, agent_pod: str) -> None:
    """Doctor passes; top shows a CUDA program's memory; doctor names the shim deleted from the
    host and the fix (deleting ``agent_pod``). Leaves the shim deleted: the caller restores it."""
    node = real_pods.node
    args = (node.name, "-n", real_pods.ns, "--sample-image", node.image("tenant"), "--timeout", "90")
    t = time.monotonic()
    ok = vgpu(node, "doctor", *args)
    print(f"\n$ kubectl vgpu doctor {node.name} ... ({time.monotonic() - t:.1f} s)\n{ok.stdout}{ok.stderr}")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines() == ["cluster  OK", f"{node.name}  OK"], ok.stdout
    report = json.loads(vgpu(node, "doctor", *args, "-o", "json").stdout)
    sample = next(f for f in report["nodes"][node.name] if f["check"] == "sample")
    assert sample == {"check": "sample", "status": "ok", "message": "a 256 MiB slice ran and saw 256 MiB", "fix": ""}
    left = node.cluster.kubectl("get", "pods", "-n", real_pods.ns, "-l", "app.kubernetes.io/name=kvgpu-doctor",
                                "-o", "name").stdout.split()
    wait_for(lambda: not node.cluster.kubectl("get", "pods", "-n", real_pods.ns, "-l",
                                              "app.kubernetes.io/name=kvgpu-doctor", "-o", "name").stdout.split(),
             60, f"the sample pods deleted ({left})")

    # top: a CUDA program holding 2 x 256 MiB under a 1000 MiB / 30 % slice
    real_pods.apply(gpu_pod(real_pods, "fill", containers=[
        container("main", hami_limits(1, 1000, 30), command=("cuprog", "fill", "alloc", str(256 * MIB), "2", "600"))]))
    real_pods.wait_running("fill", timeout=90)

    last: list[str] = []

    def row() -> dict[str, Any] | None:
        p = vgpu(node, "top", "-n", real_pods.ns, "-o", "json")
        last[:] = [p.stdout, p.stderr]
        rows = [r for r in json.loads(p.stdout or "[]") if r["pod"] == "fill"] if p.returncode == 0 else []
        # the program's 2 x 256 MiB, plus what its CUDA context took (the stub driver's: 64 MiB)
        return rows[0] if rows and (rows[0]["memory_used_mib"] or 0) >= 512 else None

    try:
        r = wait_for(row, 60, "top showing the program's 512 MiB")
    except AssertionError as e:
        raise AssertionError(f"{e}; last top: {last}") from None
    assert r["memory_used_mib"] <= 1000, r
    assert (r["namespace"], r["node"], r["memory_limit_mib"], r["sm_limit_percent"]) == \
        (real_pods.ns, node.name, 1000, 30), r
    assert len(r["cards"]) == 1 and r["sm_percent"] is not None
    text = vgpu(node, "top", "-n", real_pods.ns, "--containers")
    print(f"$ kubectl vgpu top --containers\n{text.stdout}")
    assert text.stdout.splitlines()[1].split()[:2] == ["fill", "main"]
    assert f"{r['memory_used_mib']}/1000" in text.stdout, text.stdout
    everywhere = vgpu(node, "top", "-A", "--sort", "name").stdout.splitlines()
    assert everywhere[0].split()[:2] == ["NAMESPACE", "POD"]
    assert any(ln.split()[:3] == [real_pods.ns, "fill", node.name] for ln in everywhere[1:]), everywhere
    node.cluster.kubectl("delete", "pod", "fill", "-n", real_pods.ns, "--wait=true", "--timeout=60s")

    # the fault: the installed shim deleted from the host
    link = Path(keys.HOST_SHIM_DIR) / "libvgpu.so"
    target = link.resolve(strict=True)
    os.unlink(target)
    wait_for(lambda: _shim_report(node)["loadable"] is False, 30, "the agent reporting the shim gone")
    bad = vgpu(node, "doctor", *args)
    print(f"$ kubectl vgpu doctor (shim deleted)\n{bad.stdout}")
    assert bad.returncode == 1
    line = next(ln for ln in bad.stdout.splitlines() if ln.startswith(node.name))
    assert line.startswith(f"{node.name}  FAIL  shim: the shim is not usable on the node: {link} is missing "
                           f"(the link points at {target.name}, which is gone)"), line
    assert line.endswith(f"-> fix: kubectl -n {AGENT_NS} delete pod {agent_pod} (the agent reinstalls the shim "
                         "at start)"), line
    assert "sample: " not in line  # skipped: the node failed a check already
