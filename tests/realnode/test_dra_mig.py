"""A MIG instance through DRA on the real node (a real kubelet + containerd + runc): the simulated H200
in MIG mode of tests/realnode/test_mig_node.py (added live to the node's simulated inventory, with
fake device nodes) in a VGPUPool with ``allocation: dra``; kube-scheduler allocates one of its
instances by profile from the node's ResourceSlice, the real kubelet calls the agent's
NodePrepareResources, and containerd applies its CDI spec: the container has its instance's nodes
and no shim. A simulated card: no real MIG card is used, so no CUDA runs here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvgpu.core.inventory import Card
from kvgpu.devcluster.realnode import RealNode
from kvgpu.dra.mig import MIG_CLASS, mig_device_name
from kvgpu.dra.slices import DRIVER, device_classes, slice_name
from realnode.conftest import RealPods
from realnode.gpupods import wait_for
from realnode.test_mig_node import mig_card  # noqa: F401 (the fixture)

STATE_DIR = Path("/var/lib/kvgpu/dra/claims")


def _slice_devices(node: RealNode) -> list[str]:
    p = node.cluster.kubectl("get", "resourceslice", slice_name(node.name), "-o", "json", check=False)
    return [d["name"] for d in json.loads(p.stdout)["spec"].get("devices", [])] if p.returncode == 0 else []


@pytest.fixture
def dra_mig(real_node: RealNode, mig_card: Card) -> Iterator[Card]:  # noqa: F811
    """The MIG card in a pool of its own with ``allocation: dra``; the pool (and DeviceClasses this
    fixture created) deleted after."""
    pool = f"{real_node.pool_name}-mig-dra"
    k = real_node.cluster.kubectl
    classes = [c for c in device_classes()
               if k("get", "deviceclass", c["metadata"]["name"], check=False).returncode != 0]
    labels = {"kvgpu.io/gpu-node": "true", "kubernetes.io/hostname": real_node.name}
    objs = [*classes, {"apiVersion": "kvgpu.io/v1alpha1", "kind": "VGPUPool", "metadata": {"name": pool},
                       "spec": {"nodeSelector": {"matchLabels": labels}, "devices": {"indexes": [mig_card.index]},
                                "splitCount": 4, "allocation": "dra"}}]
    k("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    want = sorted(mig_device_name(mig_card, i) for i in mig_card.mig_instances)
    try:
        wait_for(lambda: sorted(_slice_devices(real_node)) == want, 90, f"the MIG devices {want} in the slice")
        yield mig_card
    finally:
        k("delete", "vgpupool", pool, "--ignore-not-found")
        wait_for(lambda: _slice_devices(real_node) == [], 60, "the ResourceSlice without the MIG devices")
        for c in classes:
            k("delete", "deviceclass", c["metadata"]["name"], "--ignore-not-found")


def _template(rp: RealPods, name: str) -> dict[str, Any]:
    sel = {"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "1g.18gb"'}}
    req = {"name": "mig", "exactly": {"deviceClassName": MIG_CLASS, "selectors": [sel]}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": rp.ns}, "spec": {"spec": {"devices": {"requests": [req]}}}}


def test_a_dra_mig_claim_gets_its_instance_and_no_shim(real_node: RealNode, real_pods: RealPods,
                                                       dra_mig: Card) -> None:
    real_pods.apply(_template(real_pods, "mig-1g"))
    pod = real_pods.pod("dramig")
    pod["spec"].pop("nodeName")  # placed by kube-scheduler, which allocates the claim
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": real_node.name}
    pod["spec"]["resourceClaims"] = [{"name": "mig", "resourceClaimTemplateName": "mig-1g"}]
    pod["spec"]["containers"][0]["resources"] = {"claims": [{"name": "mig"}]}
    real_pods.apply(pod)
    real_pods.wait_running("dramig", timeout=120)
    out = real_pods.exec("dramig", "sh", "-c", "echo $NVIDIA_VISIBLE_DEVICES; ls /dev; echo --; ls /dev/nvidia-caps; "
                                               "echo --; cat /etc/ld.so.preload 2>/dev/null | wc -c; "
                                               "ls /etc/kvgpu /var/run/kvgpu 2>/dev/null | wc -l").split("--")
    visible, *devs = out[0].split()
    caps = out[1].split()
    preload, kvgpu_files = out[2].split()
    (mine,) = [i for i in dra_mig.mig_instances if i.uuid == visible]
    (other,) = [i for i in dra_mig.mig_instances if i.uuid != visible]
    assert f"nvidia{dra_mig.index}" in devs and "nvidia0" not in devs, devs  # the parent only
    assert sorted(caps) == sorted([f"nvidia-cap{mine.gi_cap_minor}", f"nvidia-cap{mine.ci_cap_minor}"]), caps
    assert f"nvidia-cap{other.gi_cap_minor}" not in caps
    assert preload == "0" and kvgpu_files == "0"  # no shim, no claim file, no region
    (st,) = real_pods.get("dramig")["status"]["resourceClaimStatuses"]
    claim = json.loads(real_node.cluster.kubectl("get", "resourceclaim", st["resourceClaimName"], "-n",
                                                 real_pods.ns, "-o", "json").stdout)
    uid = claim["metadata"]["uid"]
    assert sorted(p.name for p in (STATE_DIR / uid).iterdir()) == ["prepared.json"]
    real_node.cluster.kubectl("delete", "pod", "dramig", "-n", real_pods.ns, "--wait=true", "--timeout=60s")
    wait_for(lambda: not (STATE_DIR / uid).exists() and not (real_node.cdi_dir / f"{DRIVER}-{uid}.json").exists(),
             60, "the MIG claim's files removed")
