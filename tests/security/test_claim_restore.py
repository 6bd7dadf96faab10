"""A VGPUClaim removed from under a running pod — deleted, or its status set to Released, by an
identity allowed to write claims (an admin, a controller with wide rights) — is put back by the
operator, and its cards stay reserved: no other pod gets them while the first one runs. Measured
from outside before: 186771 MiB promised on a 143771 MiB card."""

from __future__ import annotations

import json
import time

from kvgpu.api.vgpuclaim import claim_phase

from tests.cluster.conftest import GpuEnv, gpu

__all__ = ["gpu"]


def _claim(env: GpuEnv, pod: str) -> dict | None:
    found = [c for c in env.claims() if c["spec"]["podName"] == pod]
    return found[0] if found else None


def _stays_unbound(env: GpuEnv, name: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert not env.get("pod", name)["spec"].get("nodeName"), f"{name} got the running pod's cards"
        time.sleep(0.3)


def test_a_claim_removed_under_a_running_pod_is_restored(gpu: GpuEnv) -> None:
    gpu.nodes(1, cards=1, memory_mib=10000)
    gpu.create(gpu.pod("holder", {"kvgpu.io/gpumem": "8000"}))
    gpu.wait_bound("holder")
    gpu.mark_running("holder")
    first = gpu.wait(lambda: (c := _claim(gpu, "holder")) and claim_phase(c) == "Bound" and c,
                     30, "the holder's claim")
    name = first["metadata"]["name"]

    gpu.cluster.kubectl("delete", "vgpuclaim", name, "-n", gpu.ns, "--wait=true")  # as system:masters
    back = gpu.wait(lambda: (c := _claim(gpu, "holder")) and c["metadata"]["uid"] != first["metadata"]["uid"] and c,
                    15, "the claim re-created")
    assert back["spec"] == first["spec"]
    gpu.create(gpu.pod("greedy", {"kvgpu.io/gpumem": "8000"}))
    _stays_unbound(gpu, "greedy", 4)

    gpu.cluster.kubectl("patch", "vgpuclaim", name, "-n", gpu.ns, "--subresource=status", "--type=merge",
                        "-p", json.dumps({"status": {"phase": "Released"}}))
    gpu.wait(lambda: (c := _claim(gpu, "holder")) is not None and claim_phase(c) == "Bound", 15,
             "the claim put back (re-created, no phase: Bound)")
    _stays_unbound(gpu, "greedy", 3)

    gpu.delete_pod("holder")  # now the cards really free up
    gpu.wait_bound("greedy", timeout=30)
