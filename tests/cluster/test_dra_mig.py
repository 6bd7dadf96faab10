"""MIG through DRA partitionable devices against the real kube-apiserver and kube-scheduler: the API
server accepts a MIG card's counter slice and device slice as :mod:`kvgpu.dra.slices` writes them for
a simulated H200 in MIG mode, and kube-scheduler allocates MIG devices by profile and never beyond
the card's counters (fake node: no kubelet, nothing is prepared; no real MIG card is used)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from kvgpu.core.inventory import NodeInventory, Slicing, parse_simulated
from kvgpu.dra.mig import MIG_CLASS
from kvgpu.dra.slices import DRIVER, device_classes, resource_slices

from .conftest import GpuEnv

pytestmark = pytest.mark.cluster

# 3g.71gb (60 SMs), 2g.35gb (32), 1g.18gb (16) x 2: 124 of the H200's 132 SMs
LAYOUT = [{"profile": "3g.71gb"}, {"profile": "2g.35gb"}, {"profile": "1g.18gb", "count": 2}]


def _template(ns: str, name: str, profile: str) -> dict[str, Any]:
    sel = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    req = {"name": "mig", "exactly": {"deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": sel}}]}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": ns}, "spec": {"spec": {"devices": {"requests": [req]}}}}


def _pod(ns: str, name: str, node: str, template: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0,
                     "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "cuda", "command": ["sleep", "inf"],
                                     "resources": {"claims": [{"name": "mig"}]}}]}}


def _mig_inventory(node: str, sm_count: int | None = None) -> NodeInventory:
    """The fake node's simulated H200 in MIG mode, in a ``dra`` pool; ``sm_count`` overrides the
    card's SMs (its counter), to show the counters bind."""
    (sim,) = parse_simulated({"nodes": [{"name": node, "cards": [{"model": "NVIDIA H200", "migInstances": LAYOUT}]}]})
    inv = sim.inventory()
    if sm_count is not None:
        inv = replace(inv, cards=tuple(replace(c, sm_count=sm_count) for c in inv.cards))
    return inv.with_slicing({c.uuid: Slicing(pool="p", allocation="dra") for c in inv.cards})


@pytest.fixture
def publish(gpu: GpuEnv) -> Iterator[Any]:
    """Publishes a node's slices; removes them after the test. The DeviceClasses are the kvgpu
    system's (KvgpuSystem.install_device_classes): they stay for the tests after this one."""
    published: list[dict[str, Any]] = []

    def _publish(inv: NodeInventory) -> list[dict[str, Any]]:
        gpu.cluster.kubectl("get", "deviceclass", *(dc["metadata"]["name"] for dc in device_classes()))
        objs = resource_slices(inv)
        gpu.apply(*objs)
        published.extend(objs)
        return objs

    yield _publish
    gpu.cluster.kubectl("delete", "pods", "--all", "-n", gpu.ns, "--grace-period=0", "--force", check=False)
    for o in published:
        gpu.cluster.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found", check=False)


def _allocated(gpu: GpuEnv, pod: str) -> list[dict[str, Any]]:
    claims = [c for c in gpu.get("resourceclaims")["items"]
              if c["metadata"].get("annotations", {}).get("resource.kubernetes.io/pod-claim-name") == "mig"
              and any(o["name"] == pod for o in c["metadata"].get("ownerReferences", []))]
    return [r for c in claims for r in ((c.get("status") or {}).get("allocation") or {}).get("devices", {})
            .get("results", [])]


def _wait_pending(gpu: GpuEnv, pod: str) -> list[str]:
    """The FailedScheduling events of ``pod``, once there is one; asserts it is not bound."""
    events = gpu.wait(lambda: [e for e in gpu.events(pod) if "FailedScheduling" in e], 30,
                      f"FailedScheduling of {pod}")
    assert not gpu.get("pod", pod)["spec"].get("nodeName")
    assert any("cannot allocate all claims" in e for e in events), events  # the DRA plugin's reason
    return list(events)


def test_api_server_accepts_the_counter_and_device_slices(gpu: GpuEnv, publish: Any) -> None:
    (node,) = gpu.nodes(1, cards=1)
    objs = publish(_mig_inventory(node))
    stored = json.loads(gpu.cluster.kubectl("get", "resourceslices", "-o", "json",
                                            f"--field-selector=spec.nodeName={node}").stdout)["items"]
    by_name = {s["metadata"]["name"]: s for s in stored}
    assert set(by_name) == {f"{node}-{DRIVER}", f"{node}-counters-{DRIVER}"}
    counters = by_name[f"{node}-counters-{DRIVER}"]["spec"]["sharedCounters"]
    written = next(o for o in objs if o["metadata"]["name"] == f"{node}-counters-{DRIVER}")
    assert counters == written["spec"]["sharedCounters"]  # kept as written: the gate is on, nothing dropped
    devices = by_name[f"{node}-{DRIVER}"]["spec"]["devices"]
    assert [d["name"] for d in devices] == ["gpu-0-mig-1-0", "gpu-0-mig-2-0", "gpu-0-mig-3-0", "gpu-0-mig-4-0"]
    assert all(d["consumesCounters"][0]["counterSet"] == "gpu-0-counters" for d in devices)


def test_kube_scheduler_allocates_mig_devices_by_profile(gpu: GpuEnv, publish: Any) -> None:
    (node,) = gpu.nodes(1, cards=1)
    publish(_mig_inventory(node))
    t1, t2 = f"mig1g-{uuid.uuid4().hex[:6]}", f"mig2g-{uuid.uuid4().hex[:6]}"
    gpu.apply(_template(gpu.ns, t1, "1g.18gb"), _template(gpu.ns, t2, "2g.35gb"),
              _pod(gpu.ns, "a", node, t1), _pod(gpu.ns, "b", node, t1), _pod(gpu.ns, "c", node, t2))
    for p in ("a", "b", "c"):
        gpu.wait_bound(p)
    got = {p: [(r["driver"], r["pool"], r["device"]) for r in _allocated(gpu, p)] for p in ("a", "b", "c")}
    assert sorted(got["a"] + got["b"]) == [(DRIVER, node, "gpu-0-mig-3-0"), (DRIVER, node, "gpu-0-mig-4-0")]
    assert got["c"] == [(DRIVER, node, "gpu-0-mig-2-0")]
    # both 1g.18gb instances are taken: a third 1g.18gb pod stays pending with the scheduler's reason
    gpu.apply(_pod(gpu.ns, "d", node, t1))
    _wait_pending(gpu, "d")


def test_kube_scheduler_never_allocates_beyond_the_counters(gpu: GpuEnv, publish: Any) -> None:
    """A card whose counter holds 80 SMs (not a real layout: its instances have 124): after the
    3g.71gb (60) and one 1g.18gb (16), the second 1g.18gb would need 92 and is not allocated,
    though its device is free."""
    (node,) = gpu.nodes(1, cards=1)
    publish(_mig_inventory(node, sm_count=80))
    t3, t1 = f"mig3g-{uuid.uuid4().hex[:6]}", f"mig1g-{uuid.uuid4().hex[:6]}"
    gpu.apply(_template(gpu.ns, t3, "3g.71gb"), _template(gpu.ns, t1, "1g.18gb"), _pod(gpu.ns, "big", node, t3))
    gpu.wait_bound("big")
    gpu.apply(_pod(gpu.ns, "small", node, t1))
    gpu.wait_bound("small")
    gpu.apply(_pod(gpu.ns, "over", node, t1))
    _wait_pending(gpu, "over")
    assert [r["device"] for r in _allocated(gpu, "big")] == ["gpu-0-mig-1-0"]
