"""The device plugin as a boundary: a pod kvgpu's webhooks never saw (a namespace they skip, e.g.
``kube-system``) that asks the plugin's resource ``nvidia.com/gpu`` directly gets no replica —
not an unlimited, unaccounted card with the shim mounted but no claim."""

from __future__ import annotations

import json

from realnode.gpupods import container, wait_for
from security.conftest import RealPods


def test_pod_without_a_claim_never_starts(real_pods: RealPods) -> None:
    # kube-system is never seen by the webhooks: such a pod asking the plugin's resource directly
    # (bound with nodeName, no kvgpu scheduler) must be refused by Allocate, not run unlimited.
    name = f"noclaim-{real_pods.ns}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "kube-system"},
           "spec": {"nodeName": real_pods.node.name, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                    "containers": [container("main", {"nvidia.com/gpu": 1})]}}
    real_pods.cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        def status() -> dict | None:
            p = json.loads(real_pods.cluster.kubectl("get", "pod", name, "-n", "kube-system", "-o", "json").stdout)
            return p["status"] if p["status"].get("phase") in ("Failed", "Running", "Succeeded") else None

        st = wait_for(status, 60, "the kubelet's verdict")
        assert st["phase"] == "Failed", st
        assert st.get("reason") == "UnexpectedAdmissionError", st
        assert "no kvgpu claim" in st.get("message", ""), st
    finally:
        real_pods.cluster.kubectl("delete", "pod", name, "-n", "kube-system", "--wait=false", check=False)
