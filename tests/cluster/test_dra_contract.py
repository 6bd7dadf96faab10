"""The DRA contract against the real kube-apiserver and kube-scheduler: the API server accepts
kvgpu's ResourceSlices and DeviceClass as :mod:`kvgpu.dra.slices` writes them, and kube-scheduler
allocates slices of one card by consumable capacity (fake node: no kubelet, so nothing is
prepared; the node path is tests/realnode)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kvgpu.core.inventory import Slicing
from kvgpu.dra.slices import DRIVER, device_classes, resource_slices

from .conftest import GpuEnv

pytestmark = pytest.mark.cluster


def _template(ns: str, name: str, memory: str, cores: str) -> dict[str, Any]:
    req = {"name": "gpu", "exactly": {"deviceClassName": DRIVER,
                                      "capacity": {"requests": {"memory": memory, "cores": cores}}}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": {"requests": [req]}}}}


def _pod(ns: str, name: str, node: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "cuda", "command": ["sleep", "inf"],
                                     "resources": {"claims": [{"name": "gpu"}]}}]}}


@pytest.fixture
def dra_node(gpu: GpuEnv) -> Iterator[str]:
    (node,) = gpu.nodes(1, cards=1, memory_mib=10000)
    inv = json.loads(gpu.cluster.kubectl("get", "node", node, "-o", "json").stdout)
    from kvgpu.core.inventory import NodeInventory

    parsed = NodeInventory.loads(inv["metadata"]["annotations"]["kvgpu.io/inventory"])
    parsed = parsed.with_slicing({c.uuid: Slicing(pool="p", split_count=2, allocation="dra") for c in parsed.cards})
    objs = device_classes() + resource_slices(parsed)
    gpu.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    try:
        yield node
    finally:
        gpu.cluster.kubectl("delete", "resourceslice", f"{node}-{DRIVER}", "--ignore-not-found")
        # the DeviceClass stays: the kvgpu system installs it (KvgpuSystem.install_device_classes)


def test_kube_scheduler_shares_one_card_by_capacity(gpu: GpuEnv, dra_node: str) -> None:
    t = f"seed-{uuid.uuid4().hex[:6]}"
    gpu.apply(_template(gpu.ns, t, "3000Mi", "30"),
              _pod(gpu.ns, "a", dra_node, t), _pod(gpu.ns, "b", dra_node, t), _pod(gpu.ns, "c", dra_node, t))
    # the scheduler takes the three pods in any order: whichever two come first get the two shares
    bound = gpu.wait(lambda: (b := [p for p in gpu.pods() if p["spec"].get("nodeName")]) and len(b) == 2 and b,
                     30, "two of three pods bound")
    claims = gpu.get("resourceclaims")["items"]
    allocated = [c for c in claims if (c.get("status") or {}).get("allocation")]
    assert len(allocated) == 2, claims
    for c in allocated:
        (res,) = c["status"]["allocation"]["devices"]["results"]
        assert res["driver"] == DRIVER and res["device"] == "gpu-0" and res["pool"] == dra_node
        assert res["consumedCapacity"] == {"memory": "3000Mi", "cores": "30", "shares": "1"}
        assert res.get("shareID")
    assert len({(c["status"]["allocation"]["devices"]["results"][0]["shareID"]) for c in allocated}) == 2
    # splitCount 2: the third pod finds no share left and stays pending with the scheduler's reason
    (pending,) = {"a", "b", "c"} - {p["metadata"]["name"] for p in bound}
    assert not gpu.get("pod", pending)["spec"].get("nodeName")
    gpu.wait(lambda: any("FailedScheduling" in e for e in gpu.events(pending)), 30, f"FailedScheduling of {pending}")
