"""The extender as a boundary for pods kvgpu's webhooks never saw: no slice for them."""

from __future__ import annotations

import json

from tests.cluster.conftest import GpuEnv, gpu

__all__ = ["gpu"]


def test_a_pod_the_webhooks_never_saw_gets_no_slice(gpu: GpuEnv) -> None:
    """kube-system is never seen by kvgpu's webhooks: a pod there naming kvgpu-scheduler would get a
    slice with no shim, no env and no claim volume — unlimited on a card kvgpu has sold."""
    gpu.nodes(1, cards=1)
    name = f"sneaky-{gpu.ns}"
    pod = gpu.pod(name, {"kvgpu.io/gpumem": "1000"})
    pod["metadata"]["namespace"] = "kube-system"
    pod["spec"]["schedulerName"] = "kvgpu-scheduler"
    gpu.cluster.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:
        def refused() -> list[str]:
            ev = json.loads(gpu.cluster.kubectl("get", "events", "-n", "kube-system", "-o", "json",
                                                f"--field-selector=involvedObject.name={name}").stdout)["items"]
            return [e["message"] for e in ev if e["reason"] == "FailedScheduling"]

        msgs = gpu.wait(refused, 30, "FailedScheduling for the kube-system pod")
        assert any("not admitted by kvgpu's webhook" in m for m in msgs), msgs
        got = json.loads(gpu.cluster.kubectl("get", "pod", name, "-n", "kube-system", "-o", "json").stdout)
        assert not got["spec"].get("nodeName")
        claims = json.loads(gpu.cluster.kubectl("get", "vgpuclaims", "-n", "kube-system", "-o", "json").stdout)
        assert claims["items"] == []
    finally:
        gpu.cluster.kubectl("delete", "pod", name, "-n", "kube-system", "--grace-period=0", "--force",
                            "--wait=false", check=False)
