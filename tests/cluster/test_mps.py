"""A VGPUPool with ``mode: mps`` on the real control plane (fake nodes): its cards take slices,
accounted like hami-core, and each claim string says ``mode=mps`` (the device plugin and the
shim make the container an MPS client from it). Before the MPS backend such a pool's cards were
unusable (``in a pool mode not supported yet``)."""

from __future__ import annotations

import json

from kvgpu.core import claimstr

from tests.cluster.conftest import GpuEnv


def test_an_mps_pool_places_pods_and_the_claim_says_mps(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=2)
    name = f"mps-{gpu.ns}"[:63]
    gpu.cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": name},
        "spec": {"mode": "mps", "splitCount": 4,
                 "nodeSelector": {"matchLabels": {"kvgpu.io/gpu-node": "true", "kvgpu.io/test": gpu.ns}}}}))
    try:
        gpu.create(*(gpu.pod(f"inf{i}", {"kvgpu.io/gpumem": "3000", "kvgpu.io/gpucores": "30"}) for i in range(3)))
        pods = [gpu.wait_bound(f"inf{i}") for i in range(3)]
        for p in pods:
            cs = claimstr.decode(p["metadata"]["annotations"]["kvgpu.io/claim.main"])
            assert cs.mode == "mps" and (cs.devices[0].memory_mib, cs.devices[0].cores) == (3000, 30)
        assert {c["spec"]["pool"] for c in gpu.claims()} == {name}
        # one card per MPS client: a two-card pod is refused with the reason
        gpu.create(gpu.pod("two", {"kvgpu.io/gpu": "2", "kvgpu.io/gpumem": "1000"}))
        ev = gpu.wait(lambda: [e for e in gpu.events("two") if "mps mode" in e], what="mps reason")
        assert "one card per container" in ev[0], ev[0]
    finally:
        gpu.cluster.kubectl("delete", "vgpupool", name, "--ignore-not-found", "--wait=true", check=False)
